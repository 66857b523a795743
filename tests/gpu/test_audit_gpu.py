"""The audit log on CUDA: ``LLM(audit_log=...)`` with CUDA graphs and the engine running a step
ahead (generations with adapters, seeded samples, logprobs and prompt logprobs; a decision),
then ``detlora verify`` in batches of another size: every request identical, bit for bit.
The CPU proves the same logic (tests/audit)."""

from __future__ import annotations

import pytest
from tests.helpers.tiny_chat_model import build_tiny_chat_model

from detlora.audit.verify import VerifyOptions, verify
from detlora.config import SamplingParams
from detlora.entrypoints.llm import LLM
from detlora.lora.request import LoRARequest

pytestmark = pytest.mark.gpu


def test_a_cuda_log_replays_identical_in_other_batches(tmp_path):
    model, adapters = build_tiny_chat_model(tmp_path / "assets")
    loras = [LoRARequest(f"a{k}", k + 1, str(p)) for k, p in enumerate(adapters)]
    log = tmp_path / "log"
    prompts = [[5 + k, 6, 7 + k % 3, 8] * (1 + k % 4) for k in range(24)]
    params = [SamplingParams(max_tokens=12, temperature=0.8, seed=k, logprobs=2, n=2,
                             prompt_logprobs=1) if k % 3 == 0 else
              SamplingParams(max_tokens=10, temperature=0.0, logprobs=0) if k % 3 == 1 else
              SamplingParams(max_tokens=8, temperature=1.0) for k in range(24)]
    with LLM(model, device="cuda", enable_lora=True, max_loras=2, max_model_len=256,
             audit_log=log) as llm:
        llm.generate(prompts, params, [loras[k % 3] if k % 3 < 2 else None
                                       for k in range(24)], use_tqdm=False)
        llm.decide("the customer is angry", {
            "toxic": {"type": "noul", "criteria": "Is this comment toxic?"},
            "mood": {"type": "choice", "criteria": ["calm", "angry", "sad"]}},
            lora_request=loras[1])
    for batch in (None, 5):
        report = verify([log], VerifyOptions(batch_size=batch, progress=False))
        assert report.count("identical") == 25 and report.exit_status == 0, report.render()

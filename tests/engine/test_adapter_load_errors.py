"""An adapter that cannot be loaded fails its own requests, not the batch.

Adapters are read when a step first needs them. One whose weights hold NaN (refused when
loaded), whose tensors disagree with its config, or whose patterns run away ends its requests
with finish_reason "error" and a message naming the adapter and the reason; the other
requests of the same ``generate`` call run as if it had not been there. A missing directory
is still refused before anything runs.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
from safetensors.torch import load_file, save_file
from tests.helpers.engine_outputs import random_prompts, same_outputs

from detlora.config import SamplingParams
from detlora.entrypoints.llm import LLM
from detlora.lora.request import LoRARequest


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), enable_lora=True, max_loras=2, max_lora_rank=8, device="cpu",
               max_model_len=64)


def _nan_adapter(src, dst):
    shutil.copytree(src, dst)
    file = dst / "adapter_model.safetensors"
    tensors = load_file(file)
    key = sorted(tensors)[3]
    tensors[key][0, 0] = float("nan")
    save_file(tensors, file)
    return key


def _config(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps({**cfg, **changes}))


@pytest.mark.parametrize("case", ["nan_weights", "rank_mismatch", "runaway_pattern"])
def test_a_bad_adapter_errors_its_requests_and_the_others_run(llm, llama_adapters, tmp_path,
                                                              case):
    bad = tmp_path / "bad"
    if case == "nan_weights":
        key = _nan_adapter(llama_adapters[0], bad)
        reason = rf"tensor '{key}' holds 1 non-finite value"
    elif case == "rank_mismatch":
        _config(llama_adapters[0], bad, r=4)
        reason = "has rank 8 but adapter_config.json says r=4"
    else:
        _config(llama_adapters[0], bad,
                rank_pattern={r"(?:(?P<x>.)|(?P<y>.))*(?P=x)(?P=y)": 8})
        reason = "took more than 1 s"
    prompts = random_prompts(4, seed=50)
    params = [SamplingParams(max_tokens=4, temperature=0.0, logprobs=0),
              SamplingParams(max_tokens=4, temperature=0.9, seed=3),
              SamplingParams(max_tokens=4, temperature=0.0),
              SamplingParams(max_tokens=4, temperature=0.7, seed=4, logprobs=1)]
    good = LoRARequest("a1", 2, str(llama_adapters[1]))
    lora_id = {"nan_weights": 7, "rank_mismatch": 17, "runaway_pattern": 27}[case]
    broken = LoRARequest("broken", lora_id, str(bad))
    loras = [good, broken, None, broken]
    outs = llm.generate(prompts, params, loras, use_tqdm=False)
    for k in (1, 3):
        c = outs[k].outputs[0]
        assert outs[k].finished and c.finish_reason == "error" and c.token_ids == []
        assert f"adapter 'broken' (id {lora_id}," in c.error and "could not be loaded" in c.error
        assert re.search(reason, c.error), c.error
    alone = llm.generate([prompts[0], prompts[2]], [params[0], params[2]], [good, None],
                         use_tqdm=False)
    assert same_outputs(outs[0], alone[0]) and same_outputs(outs[2], alone[1])
    assert not llm.engine.has_unfinished()
    assert llm.engine.block_manager.num_free == llm.engine.num_kv_blocks
    # The id is not pinned by the failed load: the fixed adapter runs under it.
    fixed = LoRARequest("broken", lora_id, str(llama_adapters[0]))
    ok = llm.generate(prompts[1], params[1], fixed, use_tqdm=False)
    assert ok[0].outputs[0].finish_reason == "length"


def test_every_request_of_the_step_failing_still_returns_them(llm, llama_adapters, tmp_path):
    bad = tmp_path / "bad"
    _nan_adapter(llama_adapters[0], bad)
    broken = LoRARequest("broken", 8, str(bad))
    outs = llm.generate(random_prompts(2, seed=51), SamplingParams(max_tokens=3, seed=1),
                        broken, use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs] == ["error", "error"]
    assert not llm.engine.has_unfinished()


def test_a_missing_directory_is_refused_before_anything_runs(llm, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"adapter directory .*gone does not exist"):
        llm.generate([[3, 4, 5], [6, 7]], SamplingParams(max_tokens=2, seed=1),
                     [None, LoRARequest("gone", 9, str(tmp_path / "gone"))], use_tqdm=False)
    assert not llm.engine.has_unfinished()

"""The engine says what it built: model, dtype, device, level, KV cache and fingerprint under
the ``detlora`` logger, and adapter loads and evictions."""

from __future__ import annotations

import logging

import pytest

from detlora.config import SamplingParams
from detlora.entrypoints.llm import LLM
from detlora.lora.request import LoRARequest


@pytest.fixture
def records():
    got: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            got.append(record)

    handler = Keep(level=logging.DEBUG)
    root = logging.getLogger("detlora")
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)  # adapter traffic is logged at DEBUG
    yield got
    root.removeHandler(handler)
    root.setLevel(level)


def test_engine_start_and_adapter_traffic_are_logged(llama_dir, llama_adapters, records):
    llm = LLM(str(llama_dir), device="cpu", enable_lora=True, max_loras=1, max_lora_rank=8,
              num_kv_blocks=64)
    ready = [r.getMessage() for r in records if "engine ready" in r.getMessage()]
    assert len(ready) == 1
    assert all(part in ready[0] for part in (
        str(llama_dir), "on cpu", "float32", "determinism batch_invariant",
        "KV cache 64 blocks of 16 tokens", llm.engine.fingerprint_of(None)))
    assert any(r.getMessage().startswith("loaded ") for r in records)
    a, b = (LoRARequest(f"a{k}", k + 1, str(p)) for k, p in enumerate(llama_adapters[:2]))
    llm.generate([[5, 6], [7, 8]], SamplingParams(temperature=0.0, max_tokens=2), [a, b],
                 use_tqdm=False)
    messages = [r.getMessage() for r in records]
    assert any("adapter 'a0' (id 1) copied into slot 0" in m for m in messages)
    assert any("adapter id 1 evicted from slot 0" in m for m in messages)
    assert all(r.name.startswith("detlora.") for r in records)

"""Fuzz tier: random sampling parameters, prompts and adapter configs through ``LLM.generate``.

Every outcome must be a result whose token ids lie in the vocabulary, or a ValueError,
TypeError or FileNotFoundError with a message; never another exception, and never a hang
(more than ``HANG_S`` seconds for one call). Hypothesis draws the inputs (derandomized, so CI
runs the same examples every time; bounded by ``max_examples``): values of every type for
every field, mixed with plausible ones so that most calls get past validation and run.

SamplingParams fields are read from the dataclass, so fields added later are fuzzed too. The
model is the demo's (a real tokenizer with a chat template: text and chat prompts run).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import time
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from detlora.config import SamplingParams
from detlora.entrypoints.demo import build_demo_assets
from detlora.entrypoints.llm import LLM
from detlora.lora.request import LoRARequest

HANG_S = 10.0
ALLOWED = (ValueError, TypeError, FileNotFoundError)
# DETLORA_FUZZ_EXAMPLES=N runs N random (not derandomized) examples per test: a deeper search.
_DEEP = int(os.environ.get("DETLORA_FUZZ_EXAMPLES", "0"))
FUZZ = settings(max_examples=_DEEP or 40, deadline=None, derandomize=not _DEEP, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    model_dir, adapters = build_demo_assets(tmp_path_factory.mktemp("fuzz"))
    llm = LLM(str(model_dir), enable_lora=True, max_loras=2, max_lora_rank=16, device="cpu",
              max_model_len=48, max_num_batched_tokens=64)
    return llm, adapters, tmp_path_factory.mktemp("fuzz_adapters")


@contextmanager
def _watchdog(seconds: float):
    """Fail a call that takes longer than ``seconds`` (SIGALRM: the test's main thread)."""
    def hang(signum, frame):
        raise _Hang(f"no outcome after {seconds} s")

    previous = signal.signal(signal.SIGALRM, hang)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class _Hang(Exception):
    """A call that never returned: a test failure, not an error the engine may raise."""


def _outcome(llm, call):
    """Run ``call()``; assert it gave a result in the vocabulary or an allowed error."""
    vocab = llm.engine.spec.vocab_size
    start = time.monotonic()
    try:
        with _watchdog(HANG_S):
            outs = call()
    except ALLOWED as e:
        assert str(e), f"{type(e).__name__} without a message"
        assert not llm.engine.has_unfinished()
        return e
    finally:
        assert time.monotonic() - start < HANG_S
    for out in outs:
        for c in out.outputs:
            assert all(isinstance(t, int) and 0 <= t < vocab for t in c.token_ids), c.token_ids
            assert c.finish_reason in ("stop", "length", "error"), c.finish_reason
            if c.logprobs is not None:
                assert all(0 <= t < vocab for entry in c.logprobs for t in entry)
    assert not llm.engine.has_unfinished()
    return outs


# ---- values

_WEIRD_NUMBERS = [math.nan, math.inf, -math.inf, -0.0, 1e308, 5e-324, 2**63, -(2**63), 2**64,
                  10**30, np.int64(3), np.float32(0.5), np.bool_(True), True, False]
_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 130), st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6),
    st.sampled_from(_WEIRD_NUMBERS), st.binary(max_size=4),
)
_anything = st.recursive(
    _scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.tuples(inner, inner),
                            st.dictionaries(st.one_of(st.integers(-5, 130), st.text(max_size=3)),
                                            inner, max_size=3)),
    max_leaves=8,
)
_token = st.integers(0, 98)
_PLAUSIBLE = {
    "max_tokens": st.one_of(st.integers(1, 6), st.none()),
    "n": st.integers(1, 3),
    "temperature": st.one_of(st.just(0.0), st.floats(0.05, 2.0)),
    "top_k": st.one_of(st.just(-1), st.integers(0, 120)),
    "top_p": st.floats(0.01, 1.0),
    "min_p": st.floats(0.0, 1.0),
    "seed": st.one_of(st.none(), st.integers(0, 2**64 - 1)),
    "logprobs": st.one_of(st.none(), st.integers(0, 120)),
    "prompt_logprobs": st.one_of(st.none(), st.integers(0, 5)),
    "stop_token_ids": st.lists(_token, max_size=3),
    "min_tokens": st.integers(0, 4),
    "stop": st.one_of(st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1, max_size=3),
                                                                 max_size=2)),
    "repetition_penalty": st.floats(0.1, 3.0),
    "presence_penalty": st.floats(-2.0, 2.0),
    "frequency_penalty": st.floats(-2.0, 2.0),
    "logit_bias": st.dictionaries(_token, st.floats(-200, 200), max_size=3),
    "allowed_token_ids": st.lists(_token, min_size=1, max_size=5),
}


@st.composite
def sampling_kwargs(draw):
    """A random subset of SamplingParams' fields: in half the examples plausible values only
    (they mostly run), in the other half some fields get anything at all."""
    wild = draw(st.booleans())
    kwargs = {}
    for f in dataclasses.fields(SamplingParams):
        if draw(st.integers(0, 2)) != 0:  # most fields keep their default
            continue
        plausible = _PLAUSIBLE.get(f.name)
        if plausible is None or (wild and draw(st.integers(0, 2)) == 0):
            kwargs[f.name] = draw(_anything)
        else:
            kwargs[f.name] = draw(plausible)
    return kwargs


_ids = st.lists(st.one_of(_token, st.integers(-3, 200), st.sampled_from(_WEIRD_NUMBERS)),
                max_size=6)
_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant",
                                                           "tool", ""])},
                                 optional={"content": st.one_of(st.text(max_size=12), _anything),
                                           "name": _anything})
_valid_prompt = st.one_of(
    st.text(max_size=24),
    st.lists(_token, min_size=1, max_size=12),
    st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                    "content": st.text(max_size=12)}), min_size=1, max_size=3),
    st.fixed_dictionaries({"prompt_token_ids": st.lists(_token, min_size=1, max_size=8)}),
    st.fixed_dictionaries({"prompt": st.text(max_size=12)}),
)
_weird_prompt = st.one_of(
    _ids,
    st.lists(_token, min_size=1, max_size=6).map(np.array),
    st.lists(_token, min_size=1, max_size=6).map(lambda x: torch.tensor(x)),
    st.lists(_token, min_size=1, max_size=6).map(lambda x: [np.int64(t) for t in x]),
    st.lists(_message, min_size=1, max_size=3),
    st.fixed_dictionaries({}, optional={"prompt": st.one_of(st.text(max_size=12), _anything),
                                        "prompt_token_ids": st.one_of(_ids, _anything),
                                        "extra": _anything}),
    _anything,
)
_prompt = st.integers(0, 5).flatmap(lambda k: _weird_prompt if k == 0 else _valid_prompt)


@FUZZ
@given(kwargs=sampling_kwargs(), prompts=st.lists(_prompt, min_size=1, max_size=3))
def test_fuzz_sampling_params_and_prompts(demo, kwargs, prompts):
    llm, _, _ = demo

    def call():
        params = SamplingParams(**kwargs)
        if params.n > 4:  # a valid request for much work: not what this tier looks for
            return []
        return llm.generate(prompts, params, use_tqdm=False)

    _outcome(llm, call)


_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
_PATTERN = st.one_of(st.sampled_from([".*", "q_proj", r"layers\.0\..*", "(.|.)*z", "[",
                                      "(a{1000}){1000}", "x{e<=1}", r"(?P<x>.)(?P=x)",
                                      "layers", "model.layers.1.mlp.down_proj"]),
                     st.text(max_size=12))
_ADAPTER_PLAUSIBLE = {
    "r": st.sampled_from([8, 4, 16]),
    "lora_alpha": st.one_of(st.floats(0.5, 64), st.sampled_from([1e38, 16])),
    "target_modules": st.one_of(st.lists(st.sampled_from(_TARGETS), min_size=1, unique=True),
                                _PATTERN, st.just("all-linear")),
    "rank_pattern": st.dictionaries(_PATTERN, st.sampled_from([4, 8, 16]), max_size=3),
    "alpha_pattern": st.dictionaries(_PATTERN, st.floats(0.5, 64), max_size=3),
    "layers_to_transform": st.one_of(st.none(), st.integers(0, 3),
                                     st.lists(st.integers(0, 3), max_size=3)),
    "layers_pattern": st.one_of(st.none(), _PATTERN, st.lists(_PATTERN, max_size=2)),
    "use_rslora": st.booleans(),
    "bias": st.sampled_from(["none", "all"]),
    "peft_type": st.sampled_from(["LORA", "IA3"]),
    "use_dora": st.booleans(),
}


def _json_safe(value):
    """What json can write of a hypothesis value (bytes as text, numpy as Python)."""
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, bytes):
        return value.decode("latin-1")
    if isinstance(value, np.generic):
        return value.item()
    return value


@st.composite
def adapter_configs(draw):
    """Changes to a valid adapter's config: in half the examples a few plausible ones (most
    still load), in the other half more fields, some with anything at all."""
    wild = draw(st.booleans())
    fields = {}
    for name, plausible in _ADAPTER_PLAUSIBLE.items():
        if draw(st.integers(0, 2 if wild else 4)) != 0:
            continue  # as the adapter has it
        fields[name] = draw(_anything) if wild and draw(st.booleans()) else draw(plausible)
    return _json_safe(fields)


_made = iter(range(10**9))


@FUZZ
@given(changes=adapter_configs())
def test_fuzz_adapter_configs(demo, changes):
    llm, adapters, root = demo
    k = next(_made)
    path = root / f"a{k}"
    path.mkdir()
    (path / "adapter_model.safetensors").write_bytes(
        (adapters[0] / "adapter_model.safetensors").read_bytes())
    cfg = json.loads((adapters[0] / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**cfg, **changes}))
    request = LoRARequest(f"fuzz{k}", 100 + k, str(path))
    params = SamplingParams(max_tokens=3, logprobs=1)

    def call():
        return llm.generate(["the engine reads the prompt and", [5, 6, 7]], params,
                            [request, None], use_tqdm=False)

    result = _outcome(llm, call)
    if not isinstance(result, Exception):
        assert result[1].outputs[0].finish_reason in ("stop", "length")  # the other request

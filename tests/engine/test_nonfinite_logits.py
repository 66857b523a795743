"""A row whose logits are not all finite ends with finish_reason "error"; the others go on.

A NaN or inf in the logits (a broken base model, an adapter whose ``lora_alpha`` overflows,
corrupt bytes that happen to be finite) must never turn into a token id: greedy argmax over
NaN returns ``vocab_size`` on the CPU reference. The sampler flags such rows on the device
(in the one read it already makes), gives them a safe token for any step launched ahead, and
the engine finishes them with an error naming the adapter (or the base model) and the step.
The other rows keep their bits: compared with the same batch where the bad row is a finite
twin of the same shapes (every level), and with the batch without the bad row
(batch_invariant).
"""

import json
import shutil

import pytest
import torch
from tests.helpers.engine_outputs import VOCAB, random_prompts, same_outputs

from detlora.config import SamplingParams
from detlora.engine.runner.model_runner import StepLogits
from detlora.entrypoints.llm import LLM
from detlora.lora.request import LoRARequest

LEVELS = ("fast", "run_to_run", "batch_invariant")


@pytest.fixture(scope="module")
def overflow_adapter(llama_adapters, tmp_path_factory):
    """Adapter a0 with lora_alpha 1e38: finite numbers whose LoRA update overflows."""
    path = tmp_path_factory.mktemp("overflow") / "big"
    shutil.copytree(llama_adapters[0], path)
    cfg = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**cfg, "lora_alpha": 1e38}))
    return path


def _llm(llama_dir, level, **kw):
    return LLM(str(llama_dir), enable_lora=True, max_loras=3, max_lora_rank=8, device="cpu",
               max_model_len=96, determinism=level, **kw)


def _params(k: int, max_tokens: int = 6) -> SamplingParams:
    if k % 2:
        return SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.9, seed=k,
                              logprobs=1)
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0 if k % 4 else None)


def _emulate_graph_head(engine):
    """On the CPU the runner runs eagerly; a CUDA decode/step graph also returns the greedy
    head of its logits. Wrap ``execute`` so every sampling step carries that head too: the
    non-finite flag must travel inside it."""
    execute = engine.runner.execute

    def with_head(step, decode_only):
        out = execute(step, decode_only)
        if out is None or out.logits is None or out.prompt_hidden is not None:
            return out
        return StepLogits(out.logits, engine.sampler.greedy_head(out.logits))

    engine.runner.execute = with_head


def _assert_error(out, who: str):
    c = out.outputs[0]
    assert out.finished and c.finish_reason == "error", c
    assert c.token_ids == [] and c.text == ""
    assert c.error is not None and who in c.error and "not finite" in c.error, c.error
    assert "step" in c.error, c.error


def _assert_in_vocab(outs):
    for o in outs:
        for c in o.outputs:
            assert all(0 <= t < VOCAB for t in c.token_ids), c.token_ids


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("graph_head", [False, True], ids=["eager", "graph_head"])
def test_overflowing_adapter_row_errors_and_its_neighbours_keep_their_bits(
        llama_dir, llama_adapters, overflow_adapter, level, graph_head):
    a0, a1 = (LoRARequest(f"a{k}", k + 1, str(p)) for k, p in enumerate(llama_adapters))
    big = LoRARequest("big", 9, str(overflow_adapter))
    twin = LoRARequest("twin", 8, str(llama_adapters[0]))  # big's shapes, finite numbers
    prompts = random_prompts(5, seed=40)
    params = [_params(k) for k in range(5)]
    # The bad row ends at its first token; its twin too (max_tokens=1), so both batches have
    # the same shapes at every step.
    params[2] = SamplingParams(temperature=0.0, max_tokens=1, logprobs=0)
    loras = [None, a0, big, a1, None]
    llm = _llm(llama_dir, level)
    if graph_head:
        _emulate_graph_head(llm.engine)
    outs = llm.generate(prompts, params, loras, use_tqdm=False)
    _assert_error(outs[2], "adapter 'big'")
    assert str(overflow_adapter) in outs[2].outputs[0].error
    _assert_in_vocab(outs)
    twin_outs = llm.generate(prompts, params, [*loras[:2], twin, *loras[3:]], use_tqdm=False)
    assert twin_outs[2].outputs[0].finish_reason == "length"
    for k in (0, 1, 3, 4):
        assert outs[k].outputs[0].finish_reason in ("length", "stop")
        assert outs[k].outputs[0].error is None
        assert same_outputs(outs[k], twin_outs[k]), k
        assert torch.equal(torch.tensor(outs[k].outputs[0].token_ids),
                           torch.tensor(twin_outs[k].outputs[0].token_ids))
    # The engine is clean and serves the same adapter id again (it errors again).
    assert not llm.engine.has_unfinished()
    assert llm.engine.block_manager.num_free == llm.engine.num_kv_blocks
    again = llm.generate(prompts[2], SamplingParams(temperature=0.0,
                                                    max_tokens=3), big, use_tqdm=False)
    _assert_error(again[0], "adapter 'big'")


@pytest.mark.parametrize("run_ahead", [False, True])
@pytest.mark.parametrize("graph_head", [False, True], ids=["eager", "graph_head"])
def test_batch_invariant_rows_are_those_of_the_batch_without_the_bad_one(
        llama_dir, llama_adapters, overflow_adapter, run_ahead, graph_head):
    """batch_invariant: the good rows' bits are those of the batch without the bad row, also
    when the engine runs one step ahead (the row launched ahead for the errored sequence is
    dropped)."""
    a0 = LoRARequest("a0", 1, str(llama_adapters[0]))
    big = LoRARequest("big", 9, str(overflow_adapter))
    prompts = random_prompts(4, seed=41)
    params = [_params(k, 8) for k in range(4)]
    loras = [a0, big, None, a0]
    llm = _llm(llama_dir, "batch_invariant")
    llm.engine.run_ahead = run_ahead
    if graph_head:
        _emulate_graph_head(llm.engine)
    outs = llm.generate(prompts, params, loras, use_tqdm=False)
    _assert_error(outs[1], "adapter 'big'")
    _assert_in_vocab(outs)
    keep = [0, 2, 3]
    alone = llm.generate([prompts[k] for k in keep], [params[k] for k in keep],
                         [loras[k] for k in keep], use_tqdm=False)
    for k, ref in zip(keep, alone, strict=True):
        assert same_outputs(outs[k], ref), k
    if run_ahead:
        assert llm.engine.num_steps_ahead > 0


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("max_tokens", [1, 4])
def test_a_nan_base_model_errors_every_row_naming_the_base_model(llama_dir, level, max_tokens):
    llm = LLM(str(llama_dir), device="cpu", max_model_len=64, determinism=level)
    with torch.no_grad():
        llm.engine.model.norm.weight[3] = float("nan")  # after loading: the check passed
    prompts = random_prompts(3, seed=42)
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens),
              SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=1, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for o in outs:
        _assert_error(o, "base model")
    assert not llm.engine.has_unfinished()


def test_sampler_flags_nonfinite_rows_and_gives_them_a_safe_token():
    """Unit level: every sampler path (greedy, sampled, with and without the greedy head, with
    and without logprobs, banned tokens, penalties) reads back a flag per row and never an id
    outside [0, vocab), whatever the bad row holds (NaN, +inf, -inf, all NaN)."""
    from detlora.engine.sample.logit_adjust import has_adjustments, row_adjust
    from detlora.engine.sample.sampler import Sampler, SampleRequest
    from detlora.ops.reductions import argmax_ref
    from detlora.ops.softmax import log_softmax_ref

    s = Sampler(argmax_ref, log_softmax_ref)
    g = torch.Generator().manual_seed(3)
    vocab = 50
    for bad in ("nan_row", "one_nan", "pos_inf", "neg_inf"):
        logits = torch.randn(4, vocab, generator=g) * 3
        if bad == "nan_row":
            logits[1] = float("nan")
        elif bad == "one_nan":
            logits[1, 7] = float("nan")
        elif bad == "pos_inf":
            logits[1, 7] = float("inf")
        else:
            logits[1, 7] = float("-inf")
        head = s.greedy_head(logits)
        assert head.shape == (4, 3)
        assert head[:, 2].tolist() == [1.0, 0.0, 1.0, 1.0]
        assert all(0 <= t < vocab for t in head[:, 0].tolist())
        mixes = [
            [SamplingParams(temperature=0.0)] * 4,
            [SamplingParams(temperature=0.0, logprobs=0)] * 4,
            [SamplingParams(temperature=0.7, seed=1)] * 4,
            [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=5, seed=2),
             SamplingParams(temperature=0.0,
                            logprobs=3), SamplingParams(temperature=1.1, top_p=0.8, seed=3)],
            [SamplingParams(temperature=1.0, seed=4, logprobs=0), SamplingParams(temperature=0.0,
                                                                                 logprobs=0),
             SamplingParams(temperature=0.0), SamplingParams(temperature=0.5, seed=5)],
            [SamplingParams(temperature=0.0, presence_penalty=0.5, logprobs=0),
             SamplingParams(repetition_penalty=1.2, temperature=0.9, seed=6),
             SamplingParams(min_p=0.1, temperature=1.0, seed=7), SamplingParams(temperature=0.0)],
        ]
        for params in mixes:
            reqs = [SampleRequest(p, seed=k, position=5, banned_token_ids=(2,) * (k == 3),
                                  adjust=row_adjust(p, [3, 4], [5], None)
                                  if has_adjustments(p) else None)
                    for k, p in enumerate(params)]
            for greedy in (None, head):
                results = s(logits, reqs, greedy=greedy)
                assert [r.finite for r in results] == [True, False, True, True], (bad, params)
                assert all(0 <= r.token_id < vocab for r in results)
                pending = s.launch(logits, reqs, greedy=greedy)
                assert pending.tokens is not None
                assert all(0 <= t < vocab for t in pending.tokens.tolist())


def test_finite_garbage_bytes_in_an_adapter_error_their_row(llama_dir, llama_adapters,
                                                            tmp_path):
    """4 KB of 0x7e in the adapter's data region decode to 8.4e37 (finite: the load check
    passes); the logits of its requests overflow, and only those requests error."""
    import struct

    bad = tmp_path / "corrupt"
    shutil.copytree(llama_adapters[0], bad)
    file = bad / "adapter_model.safetensors"
    data = bytearray(file.read_bytes())
    start = 8 + struct.unpack("<Q", data[:8])[0] + 2048
    data[start: start + 4096] = b"\x7e" * 4096
    file.write_bytes(bytes(data))
    llm = _llm(llama_dir, "batch_invariant")
    prompts = random_prompts(3, seed=43)
    loras = [None, LoRARequest("corrupt", 5, str(bad)),
             LoRARequest("a1", 2, str(llama_adapters[1]))]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0,
                                                max_tokens=4), loras, use_tqdm=False)
    _assert_error(outs[1], "adapter 'corrupt'")
    alone = llm.generate([prompts[0], prompts[2]], SamplingParams(temperature=0.0, max_tokens=4),
                         [loras[0], loras[2]], use_tqdm=False)
    assert same_outputs(outs[0], alone[0]) and same_outputs(outs[2], alone[1])


@pytest.mark.parametrize("alpha", ["Infinity", "NaN"])
def test_non_finite_alpha_fails_its_request_when_loading(llama_dir, llama_adapters, tmp_path,
                                                         alpha):
    bad = tmp_path / "alpha"
    shutil.copytree(llama_adapters[0], bad)
    text = (bad / "adapter_config.json").read_text()
    cfg = json.loads(text)
    cfg.pop("lora_alpha")
    (bad / "adapter_config.json").write_text(json.dumps(cfg)[:-1] + f', "lora_alpha": {alpha}}}')
    llm = _llm(llama_dir, "fast")
    outs = llm.generate([[3, 4, 5], [6, 7]], SamplingParams(temperature=0.0, max_tokens=2),
                        [LoRARequest("x", 3, str(bad)), None], use_tqdm=False)
    c = outs[0].outputs[0]
    assert c.finish_reason == "error" and "lora_alpha must be a finite positive number" in c.error
    assert outs[1].outputs[0].finish_reason == "length"


def _decode_time_target(prompts, outs, skip=()):
    """(row, token): a row whose second output token appears in no other row's prompt or
    outputs, nor earlier in its own; a NaN embedding of that token then breaks that row alone,
    at the decode step that feeds it."""
    for r, o in enumerate(outs):
        ids = o.outputs[0].token_ids
        if r in skip or len(ids) < 3:
            continue
        t = ids[1]
        others = {x for k, p in enumerate(prompts) if k != r for x in p}
        others |= {x for k, oo in enumerate(outs) if k != r for x in oo.outputs[0].token_ids}
        if t != 0 and t not in others and t not in prompts[r] and t != ids[0]:
            return r, t
    raise AssertionError("no row with a private second token")


@pytest.mark.parametrize("graph_head", [False, True], ids=["eager", "graph_head"])
@pytest.mark.parametrize("run_ahead", [False, True])
def test_a_row_that_turns_non_finite_mid_decode(llama_dir, llama_adapters, graph_head,
                                                run_ahead):
    """A NaN embedding row (set after loading) breaks the one sequence that feeds that token:
    its first tokens are kept, it errors at the next decode step, and the other rows keep
    their bits (batch_invariant: the batch shrinks earlier, nothing else changes); a step
    launched ahead for it is dropped."""
    prompts = random_prompts(6, seed=44)
    params = [_params(k, 8) for k in range(6)]
    loras = [None, LoRARequest("a0", 1, str(llama_adapters[0])), None,
             LoRARequest("a1", 2, str(llama_adapters[1])), None, None]
    llm = _llm(llama_dir, "batch_invariant")
    llm.engine.run_ahead = run_ahead
    if graph_head:
        _emulate_graph_head(llm.engine)
    clean = llm.generate(prompts, params, loras, use_tqdm=False)
    r, token = _decode_time_target(prompts, clean)
    with torch.no_grad():
        llm.engine.model.embed_tokens.weight[token] = float("nan")
    outs = llm.generate(prompts, params, loras, use_tqdm=False)
    c = outs[r].outputs[0]
    assert c.finish_reason == "error" and c.token_ids == clean[r].outputs[0].token_ids[:2]
    assert "when sampling output token 3" in c.error
    who = "the base model" if loras[r] is None else f"adapter {loras[r].name!r}"
    assert who in c.error
    _assert_in_vocab(outs)
    for k in range(6):
        if k != r:
            assert same_outputs(outs[k], clean[k]), k
    if run_ahead:
        assert llm.engine.num_steps_ahead > 0

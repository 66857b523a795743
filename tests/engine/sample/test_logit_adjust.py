"""allowed_token_ids, logit_bias and penalties: the sampler's flat adjustment against the
per-row torch reference (bit for bit), row independence, the engine against Hugging Face's
repetition penalty, and bad values refused."""

import random
import warnings

import pytest
import torch
from tests.helpers.engine_outputs import VOCAB, random_prompts, same_outputs

from detlora.config import SamplingParams
from detlora.engine.sample import logit_adjust
from detlora.engine.sample.logit_adjust import adjust_row_ref, apply_adjustments, row_adjust
from detlora.engine.sample.sampler import (
    Sampler,
    SampleRequest,
    _adjust_tensors,
    _pack_adjustments,
    _Upload,
)
from detlora.entrypoints.llm import LLM
from detlora.ops.reductions import argmax_ref
from detlora.ops.softmax import log_softmax_ref


def _random_params(rng: random.Random, vocab: int) -> SamplingParams:
    return SamplingParams(
        temperature=rng.choice([0.0, 0.9]), seed=rng.randrange(100), logprobs=rng.choice([None, 2]),
        repetition_penalty=rng.choice([1.0, 1.3, 0.7]),
        presence_penalty=rng.choice([0.0, 0.5, -1.0]),
        frequency_penalty=rng.choice([0.0, 0.25, -0.5]),
        logit_bias=rng.choice([None, {rng.randrange(vocab): rng.uniform(-5, 5)
                                      for _ in range(3)}]),
        allowed_token_ids=rng.choice([None, rng.sample(range(vocab), 5)]),
        min_p=rng.choice([0.0, 0.0, 0.1, 0.6]))


@pytest.mark.parametrize("int32_keys", [True, False])
def test_flat_adjustment_is_the_reference_bit_for_bit(int32_keys, monkeypatch):
    if not int32_keys:  # the (row, token) keys of a batch too big for int32
        monkeypatch.setattr(logit_adjust, "INT32_KEYS_UP_TO", 0)
    rng = random.Random(0)
    vocab = 50
    for _ in range(30):
        n = rng.choice([1, 3, 6])
        logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(rng.randrange(99)))
        rows, want = [], []
        for i in range(n):
            params = _random_params(rng, vocab)
            prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 12))]
            out = [rng.randrange(vocab) for _ in range(rng.randrange(0, 12))]
            adjust = row_adjust(params, prompt, out)
            want.append(adjust_row_ref(logits[i], params, prompt, out))
            if adjust is not None:
                rows.append((i, adjust))
            else:
                assert torch.equal(want[-1], logits[i])
        up = _Upload()
        sections = _pack_adjustments(up, rows)
        x = logits.clone()
        if rows:
            apply_adjustments(x, _adjust_tensors(up.send(torch.device("cpu"), None), sections))
        assert torch.equal(x, torch.stack(want))


def test_a_pending_last_token_gives_the_bits_of_a_read_one():
    # A step launched ahead: each row's last output token sits on the device, in the previous
    # step's tokens (here shuffled, as fed rows are). The token is new to the row, already in
    # its outputs or prompt, or a token the logit bias moved, so its count is 1 or one more
    # than the host's.
    rng = random.Random(1)
    vocab = 40
    for trial in range(40):
        n = rng.choice([1, 2, 5])
        logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(trial))
        fed = torch.full((n + 3,), -7, dtype=rng.choice([torch.int64, torch.float64]))
        src = rng.sample(range(n + 3), n)
        rows, want = [], []
        for i in range(n):
            params = _random_params(rng, vocab)
            prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 6))]
            out = [rng.randrange(vocab) for _ in range(rng.randrange(0, 8))]
            last = rng.choice([rng.randrange(vocab), *prompt, *out,
                               *(params.logit_bias or {})])
            fed[src[i]] = last
            want.append(adjust_row_ref(logits[i], params, prompt, [*out, last]))
            adjust = row_adjust(params, prompt, [*out, -1], pending_src=src[i])
            if adjust is not None:
                assert (adjust.pending_src is not None) == (params.repetition_penalty != 1.0
                                                            or params.presence_penalty != 0.0
                                                            or params.frequency_penalty != 0.0)
                rows.append((i, adjust))
        up = _Upload()
        sections = _pack_adjustments(up, rows)
        x = logits.clone()
        if rows:
            apply_adjustments(x, _adjust_tensors(up.send(torch.device("cpu"), None), sections,
                                                 fed))
        assert torch.equal(x, torch.stack(want)), trial


def test_a_pending_token_must_be_the_unread_last_one():
    params = SamplingParams(temperature=0.0, repetition_penalty=1.2)
    with pytest.raises(RuntimeError, match="pending output token"):
        row_adjust(params, [1], [2, 3], pending_src=0)  # the last token is read
    with pytest.raises(RuntimeError, match="on the host"):
        row_adjust(params, [1], [-1, 3])  # an unread token that is not declared pending
    adjust = row_adjust(params, [1], [2, -1], pending_src=4)
    assert adjust.pending_src == 4 and (adjust.prompt_tokens, adjust.output_tokens) == ((1,), (2,))
    assert row_adjust(SamplingParams(temperature=0.0,
                                     logit_bias={1: 1.0}), [1], [-1], 0).pending_src is None
    with pytest.raises(ValueError, match="pass fed"):
        Sampler(argmax_ref, log_softmax_ref).launch(
            torch.zeros(1, 8), [SampleRequest(params, 1, 3, adjust=adjust)])


def test_each_adjustment_does_what_it_says():
    x = torch.tensor([2.0, -2.0, 1.0, 0.5, 3.0])
    allowed = adjust_row_ref(x, SamplingParams(temperature=0.0, allowed_token_ids=[1, 3]), [], [])
    assert allowed.tolist() == [float("-inf"), -2.0, float("-inf"), 0.5, float("-inf")]
    biased = adjust_row_ref(x, SamplingParams(temperature=0.0, logit_bias={2: 500.0}), [], [])
    assert biased[2].item() == 101.0  # clamped to +100
    rep = adjust_row_ref(x, SamplingParams(temperature=0.0, repetition_penalty=2.0), [0], [1])
    assert rep.tolist() == [1.0, -4.0, 1.0, 0.5, 3.0]  # positive halved, negative doubled
    pen = adjust_row_ref(x, SamplingParams(temperature=0.0,
                                           frequency_penalty=0.5, presence_penalty=1.0),
                         [4], [3, 3, 1])
    assert pen.tolist() == [2.0, -3.5, 1.0, -1.5, 3.0]  # prompt token 4 untouched


def test_min_p_keeps_the_tokens_vllm_keeps():
    g = torch.Generator().manual_seed(4)
    for temperature, min_p in ((1.0, 0.1), (0.7, 0.3), (2.0, 0.05), (1.0, 1.0)):
        x = torch.randn(300, generator=g) * 3
        got = adjust_row_ref(x, SamplingParams(temperature=temperature, min_p=min_p), [], [])
        p = torch.softmax(x.double() / temperature, -1)
        ratio = p / p.max()
        clear = (ratio - min_p).abs() > 1e-6  # rounding decides the tokens on the cut
        assert torch.equal(torch.isfinite(got)[clear], (ratio >= min_p)[clear])
        assert torch.equal(got[torch.isfinite(got)], x[torch.isfinite(got)])
    # Greedy rows ignore it, as in vLLM.
    assert row_adjust(SamplingParams(temperature=0.0, min_p=0.5), [1], [2]) is None


def test_sampled_tokens_respect_min_p():
    s = Sampler(argmax_ref, log_softmax_ref)
    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(5)) * 0.5
    params = SamplingParams(temperature=1.0, min_p=0.4)
    p = torch.softmax(logits[0].double(), -1)
    allowed = set(torch.nonzero(p >= 0.4 * p.max())[:, 0].tolist())
    drawn = {s(logits, [SampleRequest(params, seed=k, position=3,
                                      adjust=row_adjust(params, [], []))])[0].token_id
             for k in range(200)}
    assert drawn <= allowed and len(drawn) > 1


def test_a_rows_result_does_not_depend_on_the_others():
    rng = random.Random(3)
    vocab = 40
    s = Sampler(argmax_ref, log_softmax_ref, logits_dtype=torch.bfloat16)
    for _ in range(10):
        n = 5
        logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(
            rng.randrange(99))).bfloat16()
        reqs = []
        for i in range(n):
            params = _random_params(rng, vocab) if i % 2 else SamplingParams(
                temperature=rng.choice([0.0, 0.8]), seed=i, logprobs=1)
            reqs.append(SampleRequest(params, seed=i, position=7, adjust=row_adjust(
                params, [1, 2, 3], [4, 4, 5])))
        together = s(logits, reqs)
        for i in range(n):  # alone: unadjusted rows stay on the 16-bit path
            alone = s(logits[i: i + 1], [reqs[i]])[0]
            assert (alone.token_id, alone.logprobs) == (together[i].token_id,
                                                        together[i].logprobs)
        for r, req in zip(together, reqs, strict=True):
            if req.params.allowed_token_ids:
                assert r.token_id in req.params.allowed_token_ids


def hf_greedy_with_repetition_penalty(model, prompt, n, penalty):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0, eos_token_id=None,
                             repetition_penalty=penalty)
    return out[0, len(prompt):].tolist()


def test_repetition_penalty_matches_hugging_face(llama_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(llama_dir)).eval()
    llm = LLM(str(llama_dir), device="cpu")
    prompts = random_prompts(4, seed=8, lo=3, hi=12)
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, repetition_penalty=1.8)
    ours = llm.generate(prompts, sp, use_tqdm=False)
    plain = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                         use_tqdm=False)
    for p, o in zip(prompts, ours, strict=True):
        assert o.outputs[0].token_ids == hf_greedy_with_repetition_penalty(hf, p, 16, 1.8)
    assert [o.outputs[0].token_ids for o in ours] != [o.outputs[0].token_ids for o in plain]


def test_engine_outputs_are_batch_invariant_and_follow_the_rules(llama_dir):
    llm = LLM(str(llama_dir), device="cpu")
    prompts = random_prompts(6, seed=9)
    params = [SamplingParams(max_tokens=10, ignore_eos=True, logprobs=1, seed=k,
                             temperature=0.9 if k % 2 else 0.0,
                             frequency_penalty=0.8, presence_penalty=0.3,
                             repetition_penalty=1.2) if k % 3 == 0 else
              SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=1,
                             allowed_token_ids=[5, 6, 7]) if k % 3 == 1 else
              SamplingParams(max_tokens=10, ignore_eos=True, logprobs=1,
                             logit_bias={9: 100.0}, temperature=1.0, seed=k)
              for k in range(6)]
    alone = [llm.generate(prompts[k], params[k], use_tqdm=False)[0] for k in range(6)]
    batch = llm.generate(prompts[::-1], params[::-1], use_tqdm=False)[::-1]
    assert all(same_outputs(a, b) for a, b in zip(alone, batch, strict=True))
    assert set(alone[1].outputs[0].token_ids) <= {5, 6, 7}
    assert set(alone[2].outputs[0].token_ids) == {9}
    # Run ahead (the GPU's default) waits for the tokens penalties read: the same bits.
    ahead = LLM(str(llama_dir), device="cpu")
    ahead.engine.run_ahead = True
    outs = ahead.generate(prompts, params, use_tqdm=False)
    assert all(same_outputs(a, b) for a, b in zip(alone, outs, strict=True))


@pytest.mark.parametrize(("kw", "message"), [
    ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
    ({"repetition_penalty": float("nan")}, "repetition_penalty must be a finite number"),
    ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\]"),
    ({"frequency_penalty": "1"}, "frequency_penalty must be a finite number"),
    ({"logit_bias": [1, 2]}, "logit_bias must be a dict"),
    ({"logit_bias": {"a": 1.0}}, "logit_bias token ids must be an int"),
    ({"logit_bias": {1: float("inf")}}, r"logit_bias\[1\] must be a finite number"),
    ({"allowed_token_ids": []}, "allowed_token_ids must be a non-empty sequence"),
    ({"allowed_token_ids": [1, -2]}, "allowed_token_ids entries must be >= 0"),
    ({"min_p": 1.5}, r"min_p must be in \[0, 1\]"),
])
def test_bad_values_are_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kw)


def test_token_ids_outside_the_vocabulary_are_refused(llama_dir):
    llm = LLM(str(llama_dir), device="cpu")
    for kw, name in (({"logit_bias": {VOCAB: 1.0}}, "logit_bias"),
                     ({"allowed_token_ids": [3, VOCAB + 4]}, "allowed_token_ids")):
        with pytest.raises(ValueError, match=f"{name} names token ids outside the vocabulary"):
            llm.generate([5, 6], SamplingParams(**kw), use_tqdm=False)


def test_penalties_without_prompt_or_output_ids_are_the_reference():
    # A row without prompt ids (a pending token only), alone and beside one before its first
    # output token.
    params = SamplingParams(temperature=0.0,
                            repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.25)
    logits = torch.randn(2, 16, generator=torch.Generator().manual_seed(3))
    fed = torch.tensor([0, 9], dtype=torch.int64)
    want = torch.stack([adjust_row_ref(logits[0], params, [], [4, 9, 9]),
                        adjust_row_ref(logits[1], params, [2, 2, 5], [])])
    rows = [(0, row_adjust(params, [], [4, 9, -1], pending_src=1)),
            (1, row_adjust(params, [2, 2, 5], []))]
    for n in (1, 2):
        up = _Upload()
        sections = _pack_adjustments(up, rows[:n])
        x = logits[:n].clone()
        apply_adjustments(x, _adjust_tensors(up.send(torch.device("cpu"), None), sections, fed))
        assert torch.equal(x, want[:n]), n

"""LLMEngine.step reports every request that read a token: CUMULATIVE and DELTA outputs each
step, FINAL_ONLY once; the pieces add up to LLM.generate's output, bit for bit, and text
deltas never split a character."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from tests.helpers.tiny_chat_model import build_tiny_chat_model

from detlora.config import RequestOutputKind, SamplingParams
from detlora.engine.detokenizer import IncrementalDetokenizer
from detlora.entrypoints.llm import LLM


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny_chat"))


@pytest.fixture(scope="module")
def llm(chat_model):
    return LLM(chat_model[0], device="cpu", max_num_seqs=3)


PROMPTS = ['{"name": "東京', "yes no maybe", "the state of the world", "A B C"]


def _run(llm, prompts, params):
    engine = llm.engine
    reports: dict[str, list] = {}
    for k, p in enumerate(prompts):
        engine.add_request(llm.tokenizer.encode(p), params, request_id=str(k), prompt=p)
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            reports.setdefault(out.request_id, []).append(out)
        steps += 1
    return reports, steps


@pytest.mark.parametrize("run_ahead", [False, True])
@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_step_reports_add_up_to_generate(llm, kind, run_ahead):
    llm.engine.run_ahead = run_ahead
    sp = SamplingParams(max_tokens=12, temperature=0.8, seed=3, logprobs=1, ignore_eos=True,
                        stop=["zz"], output_kind=kind)
    offline = llm.generate(PROMPTS, sp, use_tqdm=False)
    reports, _ = _run(llm, PROMPTS, sp)
    assert sorted(reports) == [str(k) for k in range(len(PROMPTS))]
    for k, ref in enumerate(offline):
        outs = reports[str(k)]
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        final, want = outs[-1].outputs[0], ref.outputs[0]
        if kind is RequestOutputKind.FINAL_ONLY:
            assert len(outs) == 1
        else:
            assert len(outs) == len(want.token_ids)  # one report per token read
        if kind is RequestOutputKind.DELTA:
            ids = [t for o in outs for t in o.outputs[0].token_ids]
            lps = [lp for o in outs for lp in o.outputs[0].logprobs]
            text = "".join(o.outputs[0].text for o in outs)
            sent = ""  # every text sent so far is a prefix of the final text: no split char
            for o in outs:
                sent += o.outputs[0].text
                assert want.text.startswith(sent)
            assert all(o.prompt_logprobs is None for o in outs)
        else:
            ids, lps, text = final.token_ids, final.logprobs, final.text
            for a, b in itertools.pairwise(outs):  # cumulative: each extends the last
                assert b.outputs[0].token_ids[: len(a.outputs[0].token_ids)] == \
                    a.outputs[0].token_ids
                assert b.outputs[0].text.startswith(a.outputs[0].text)
        assert ids == want.token_ids and lps == want.logprobs and text == want.text
        assert final.finish_reason == want.finish_reason
        assert final.cumulative_logprob == want.cumulative_logprob
        assert outs[-1].fingerprint == ref.fingerprint


def test_stop_strings_are_never_streamed(llm):
    """A stop string that completes later is held back: the deltas add up to the text that
    ends before it."""
    words = [t for t in range(len(llm.tokenizer.hf))
             if llm.tokenizer.decode([t]).strip().isalpha()]  # clean text to cut a stop from
    base = SamplingParams(max_tokens=16, temperature=0.9, seed=5, ignore_eos=True,
                          allowed_token_ids=words)
    text = llm.generate(PROMPTS[0], base, use_tqdm=False)[0].outputs[0].text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    sp = dataclasses.replace(base, stop=[stop], output_kind=RequestOutputKind.DELTA)
    reports, _ = _run(llm, PROMPTS[:1], sp)
    streamed = "".join(o.outputs[0].text for o in reports["0"])
    ref = llm.generate(PROMPTS[0], sp, use_tqdm=False)[0].outputs[0]
    assert ref.finish_reason == "stop" and ref.stop_reason == stop
    assert streamed == ref.text and stop not in streamed


def test_detokenize_false_gives_ids_only(llm):
    sp = SamplingParams(temperature=0.0, max_tokens=4, detokenize=False)
    out = llm.generate("yes no", sp, use_tqdm=False)[0].outputs[0]
    assert out.text == "" and len(out.token_ids) == 4


def test_incremental_detokenizer_never_splits_a_character(chat_model):
    from detlora.engine.tokenizer import Tokenizer

    tok = Tokenizer(chat_model[0])
    ids = tok.encode('{"city": "東京", "note": "naïve façade"} café')
    detok = IncrementalDetokenizer(tok.decode)
    pieces = [detok.update(ids[: i + 1]) for i in range(len(ids))]
    pieces.append(detok.finish(ids))
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tok.decode(ids)
    assert any(p == "" for p in pieces[:-1])  # a split character waited for its last byte


def test_output_kind_is_checked():
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(temperature=0.0, output_kind=7)
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(temperature=0.0, detokenize="yes")

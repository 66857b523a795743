"""Grammar-constrained decoding (xgrammar) and label logprobs: constrained outputs follow their
grammar, and a constrained row gives the same bits alone and in any batch."""

from __future__ import annotations

import json

import pytest
import torch
from tests.helpers.tiny_chat_model import build_tiny_chat_model

from detlora.config import SamplingParams, StructuredOutputsParams
from detlora.entrypoints.llm import LLM

SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                                            "score": {"type": "integer", "enum": [1, 2, 3]}},
          "required": ["answer", "score"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    model, _ = build_tiny_chat_model(tmp_path_factory.mktemp("tiny_chat"))
    return LLM(model, device="cpu", max_num_seqs=8)


def _sp(**kw):
    return SamplingParams(**{"max_tokens": 24, "temperature": 0.9, "seed": 7, "logprobs": 2,
                             **kw})


def test_bitmask_matches_xgrammar():
    import xgrammar

    from detlora.engine.sample.grammar import apply_token_bitmask

    g = torch.Generator().manual_seed(0)
    vocab = 100
    logits = torch.randn(5, vocab, generator=g)
    mask = torch.randint(-2**31, 2**31 - 1, (5, -(-vocab // 32)), generator=g, dtype=torch.int64)
    mask = mask.to(torch.int32)
    ours = logits.clone()
    apply_token_bitmask(ours, torch.tensor([0, 2, 4]), mask[[0, 2, 4]])
    ref = logits.clone()
    xgrammar.apply_token_bitmask_inplace(ref, mask, indices=[0, 2, 4])
    assert torch.equal(ours, ref)


def test_json_schema_and_choice_are_followed(llm):
    js = StructuredOutputsParams(json=SCHEMA)
    outs = llm.generate(["yes no", "the state of the world", "A B C"],
                        _sp(structured_outputs=js), use_tqdm=False)
    for o in outs:
        assert o.outputs[0].finish_reason == "stop"
        value = json.loads(o.outputs[0].text)
        assert value["answer"] in ("yes", "no") and value["score"] in (1, 2, 3)
    choice = StructuredOutputsParams(choice=["café", "東京", "yes"])
    outs = llm.generate(["A B", "1 2"], _sp(structured_outputs=choice), use_tqdm=False)
    assert all(o.outputs[0].text in ("café", "東京", "yes") for o in outs)
    regex = StructuredOutputsParams(regex="[0-9]{3}")
    out = llm.generate("1 2", _sp(structured_outputs=regex), use_tqdm=False)[0].outputs[0]
    assert len(out.text) == 3 and out.text.isdigit()


def test_constrained_rows_are_batch_invariant(llm):
    """A constrained row alone, then among unconstrained and other constrained rows, in reverse
    order: the same token ids and logprobs, bit for bit."""
    js = _sp(structured_outputs=StructuredOutputsParams(json=SCHEMA))
    obj = _sp(structured_outputs=StructuredOutputsParams(json_object=True), max_tokens=12)
    free = _sp(max_tokens=12, top_p=0.9)
    greedy = SamplingParams(max_tokens=12, logprobs=2, temperature=0.0)
    prompts = ["yes no", "the state of", "A B C D", "1 2 3", "café"]
    params = [js, obj, free, greedy, js]
    alone = [llm.generate(p, sp, use_tqdm=False)[0] for p, sp in zip(prompts, params,
                                                                      strict=True)]
    together = llm.generate(prompts[::-1], params[::-1], use_tqdm=False)[::-1]
    for a, b in zip(alone, together, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


def test_invalid_grammar_is_refused(llm):
    bad = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "nope"}}})
    with pytest.raises(ValueError, match="structured_outputs json"):
        llm.generate("yes", _sp(structured_outputs=bad), use_tqdm=False)
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputsParams(json="{")


def test_label_logprobs_are_raw_and_batch_invariant(llm):
    """The first output position's raw log-softmax at the label ids: the prompt logprob that
    scoring prompt + label gives, alone or beside other requests."""
    tok = llm.tokenizer
    labels = [tok.encode(x)[-1] for x in ("yes", "no")]
    engine = llm.engine
    prompts = [tok.encode_chat([{"role": "user", "content": c}])
               for c in ("Is this comment toxic?", "the state of the world", "A B C")]
    sp = SamplingParams(max_tokens=1, temperature=1.5, top_k=3)  # sampling never changes them

    def read(batch):
        seqs = [engine.add_request(p, sp, label_token_ids=labels) for p in batch]
        while engine.has_unfinished():
            engine.step()
        return [s.label_logprobs for s in seqs]

    alone = [read([p])[0] for p in prompts]
    assert read(prompts[::-1])[::-1] == alone
    for p, got in zip(prompts, alone, strict=True):
        for label in labels:
            scored = llm.generate([[*p, label]], SamplingParams(max_tokens=1, prompt_logprobs=0,
                                                               temperature=0.0),
                                  use_tqdm=False)[0].prompt_logprobs[-1]
            value = scored[label]
            assert getattr(value, "logprob", value) == got[label]

"""Structured outputs and label logprobs on CUDA (bf16, graphs on): a grammar-constrained row,
an unconstrained row beside constrained ones (the sampler then works in fp32 for the whole
call) and a decision's label logprobs give the same bits alone and in a batch."""

from __future__ import annotations

import pytest

from detlora.config import SamplingParams, StructuredOutputsParams
from detlora.entrypoints.llm import LLM

pytestmark = pytest.mark.gpu

SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                                            "score": {"type": "integer"}},
          "required": ["answer", "score"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    pytest.importorskip("xgrammar")
    from tests.helpers.tiny_chat_model import build_tokenizer

    from detlora.entrypoints.demo import TinyModelShape, write_model

    model = tmp_path_factory.mktemp("structured_gpu")
    build_tokenizer(model)
    write_model(model, 512, TinyModelShape(hidden=256, heads=4, kv_heads=2, intermediate=512))
    return LLM(model, device="cuda", dtype="bfloat16", max_num_seqs=16)


def test_constrained_and_free_rows_alone_and_batched(llm):
    js = StructuredOutputsParams(json=SCHEMA)
    params = [
        SamplingParams(max_tokens=24, temperature=0.9, seed=1, logprobs=2, structured_outputs=js),
        SamplingParams(max_tokens=16, temperature=0.0, logprobs=1),
        SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=2, logprobs=0),
        SamplingParams(max_tokens=16, temperature=0.0,
                       structured_outputs=StructuredOutputsParams(json_object=True)),
        SamplingParams(max_tokens=16, temperature=0.7, seed=3,
                       structured_outputs=StructuredOutputsParams(regex="[a-z ]{4,12}")),
    ]
    prompts = ["yes no", "the state of", "A B C D", "1 2 3", "café"]
    alone = [llm.generate(p, sp, use_tqdm=False)[0] for p, sp in zip(prompts, params,
                                                                      strict=True)]
    for reps in (1, 3):  # in a batch with itself repeated and in reverse order
        batch = llm.generate(prompts[::-1] * reps, params[::-1] * reps, use_tqdm=False)
        for k, out in enumerate(batch):
            ref = alone[::-1][k % len(prompts)]
            assert out.outputs[0].token_ids == ref.outputs[0].token_ids
            assert out.outputs[0].logprobs == ref.outputs[0].logprobs


def test_label_logprobs_alone_and_batched(llm):
    tok = llm.tokenizer
    labels = [tok.encode(x)[-1] for x in ("yes", "no")]
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    prompts = [tok.encode_chat([{"role": "user", "content": c}])
               for c in ("Is this comment toxic?", "the state of the world", "A B C")]

    def read(batch):
        seqs = [llm.engine.add_request(p, sp, label_token_ids=labels) for p in batch]
        while llm.engine.has_unfinished():
            llm.engine.step()
        return [s.label_logprobs for s in seqs]

    alone = [read([p])[0] for p in prompts]
    assert read(prompts[::-1] * 4)[::-1][:3] == alone
    q = {"type": "noul", "criteria": "Toxic?"}
    alone_q = llm.decide("the customer is angry", {"q": q}).answers["q"]
    with_r = llm.decide("the customer is angry",
                        {"q": q, "r": {"type": "choice", "criteria": ["A", "B"]}})
    assert with_r.answers["q"] == alone_q

"""LLM.decide: typed questions answered from the first reply token's label logprobs; a question
asked alone or beside others, with or without an adapter, gives the same probabilities."""

from __future__ import annotations

import math

import pytest
from tests.helpers.tiny_chat_model import build_tiny_chat_model

from detlora.decisions import parse_questions, softmax
from detlora.entrypoints.llm import LLM
from detlora.lora.request import LoRARequest

QUESTIONS = {
    "toxic": {"type": "noul", "criteria": "Is this comment toxic?"},
    "side": {"type": "noul", "instructions": "Is it calm?",
             "criteria": {"yes": "no anger", "no": "anger"}},
    "mood": {"type": "choice", "criteria": {"calm": "no anger", "angry": "shouting",
                                            "sad": None}},
    "urgency": {"type": "score", "criteria": ["can wait", "today", "now"]},
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model, adapters = build_tiny_chat_model(tmp_path_factory.mktemp("decide"))
    return LLM(model, device="cpu", enable_lora=True), LoRARequest("a", 1, str(adapters[0]))


def test_answers_are_shaped_and_reproducible(setup):
    llm, lora = setup
    state = {"comment": "the customer is angry"}
    d = llm.decide(state, QUESTIONS, instructions="Judge.", lora_request=lora)
    a = d.answers
    assert 0.0 <= a["toxic"]["noul"] <= 1.0
    assert a["mood"]["choice"] in ("calm", "angry", "sad")
    assert math.isclose(sum(a["mood"]["probabilities"].values()), 1.0)
    assert a["mood"]["confidence"] == max(a["mood"]["probabilities"].values())
    probs = a["urgency"]["probabilities"]
    assert a["urgency"]["score"] == math.fsum(int(k) * p for k, p in probs.items())
    assert a["urgency"]["legend"] == {"1": "can wait", "2": "today", "3": "now"}
    assert d.cached_tokens > 0  # the questions shared the state's pages
    for qid, q in QUESTIONS.items():  # alone, without the others beside it
        assert llm.decide(state, {qid: q}, instructions="Judge.",
                          lora_request=lora).answers[qid] == a[qid]
    assert llm.decide(state, QUESTIONS, instructions="Judge.").fingerprint != d.fingerprint


def test_bad_questions_are_refused(setup):
    llm, _ = setup
    with pytest.raises(ValueError, match="type must be one of"):
        llm.decide("x", {"q": {"type": "maybe"}})
    with pytest.raises(ValueError, match="2 to 26"):
        llm.decide("x", {"q": {"type": "choice", "criteria": ["only"]}})
    with pytest.raises(ValueError, match="not a single token"):
        llm.decide("x", {"q": {"type": "score", "criteria": [str(i) for i in range(10)]}})
    with pytest.raises(ValueError, match="state must be"):
        llm.decide(3, {"q": {"type": "noul"}})
    with pytest.raises(ValueError, match="at most 1 questions"):
        parse_questions(QUESTIONS, max_questions=1)


def test_softmax_is_exact_and_rejects_zero_mass():
    assert softmax([0.0, 0.0]) == [0.5, 0.5]
    with pytest.raises(ValueError):
        softmax([-math.inf, -math.inf])


def test_a_question_whose_adapter_cannot_load_raises_with_the_reason(setup, tmp_path):
    """An adapter refused when its step reads it (here a NaN weight) ends the reads with
    finish_reason "error": decide raises naming the question and the reason, and the engine
    answers the next call."""
    import shutil

    from safetensors.torch import load_file, save_file

    llm, lora = setup
    bad = tmp_path / "nan"
    shutil.copytree(lora.path, bad)
    file = bad / "adapter_model.safetensors"
    tensors = load_file(file)
    tensors[sorted(tensors)[0]][0, 0] = float("nan")
    save_file(tensors, file)
    with pytest.raises(RuntimeError, match=r"question 'toxic' could not be read: .*non-finite"):
        llm.decide("x", {"toxic": QUESTIONS["toxic"]}, lora_request=LoRARequest("nan", 9, str(bad)))
    assert not llm.engine.has_unfinished()
    assert 0.0 <= llm.decide("x", {"toxic": QUESTIONS["toxic"]}).answers["toxic"]["noul"] <= 1.0


def test_many_states_in_one_call_give_each_state_its_answers_alone(setup):
    """A list of states: one Decision each, the bits each state gets alone, with one set of
    questions for all, one per state, and an adapter per state; the instructions' prefix
    pages are shared across states. A bad state is named by its index."""
    llm, lora = setup
    states = ["the customer is angry", {"comment": "thanks, all good"}, ["an", "array"],
              "the order is late again", "calm words"]
    qs = {k: QUESTIONS[k] for k in ("toxic", "mood")}

    def one(state, questions, lora_request):  # an array state alone: a list of one
        if isinstance(state, list):
            return llm.decide([state], questions, instructions="Judge.",
                              lora_request=lora_request, use_tqdm=False)[0]
        return llm.decide(state, questions, instructions="Judge.", lora_request=lora_request)

    alone = [one(s, qs, lora) for s in states]
    bulk = llm.decide(states, qs, instructions="Judge.", lora_request=lora, use_tqdm=False)
    assert [d.answers for d in bulk] == [d.answers for d in alone]
    assert [d.fingerprint for d in bulk] == [d.fingerprint for d in alone]
    assert [d.prompt_tokens for d in bulk] == [d.prompt_tokens for d in alone]
    assert sum(d.cached_tokens for d in bulk[1:]) > 0  # the shared template's pages
    per_state = [qs, {"urgency": QUESTIONS["urgency"]}, qs, qs, {"side": QUESTIONS["side"]}]
    loras = [lora, None, lora, None, lora]
    mixed = llm.decide(states, per_state, instructions="Judge.", lora_request=loras,
                       use_tqdm=False)
    for s, q, lr, d in zip(states, per_state, loras, mixed, strict=True):
        ref = one(s, q, lr)  # cached tokens follow what ran before: not compared
        assert (d.answers, d.fingerprint, d.prompt_tokens) == \
            (ref.answers, ref.fingerprint, ref.prompt_tokens)
    with pytest.raises(ValueError, match=r"states\[1\] must be a string"):
        llm.decide(["ok", 3], qs)
    with pytest.raises(ValueError, match="2 entries but there are 3 states"):
        llm.decide(["a", "b", "c"], [qs, qs])
    with pytest.raises(ValueError, match="empty list of states"):
        llm.decide([], qs)
    assert not llm.engine.has_unfinished()


def test_the_template_split_gives_the_rendered_prompt(setup):
    """The planner's prompt (the template split around the state) is the template's own
    rendering, for states with whitespace, markup and braces; a template that changes the
    content is rendered per state instead."""
    from detlora.decisions import ReadPlanner, decision_messages

    llm, _ = setup
    tok = llm.tokenizer
    questions = parse_questions(QUESTIONS)
    states = ["  padded \n", "<b>{{ x }}</b> &amp;", {"k": [1, 2]}, "plain"]
    planner = ReadPlanner.of(tok, questions, "Judge.")
    for state, reads in zip(states, planner.plan(states), strict=True):
        for r in reads:
            assert r.prompt_token_ids == tok.encode_chat(
                decision_messages(state, r.question, "Judge."))
    assert planner.verbatim is True
    assert ReadPlanner.of(tok, questions, "Judge.") is planner  # kept for the next call
    original = tok.hf.chat_template
    tok.hf.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|> "
                            "{{ m['content'] | replace('probe', 'x') }} {% endfor %}")
    try:
        other = ReadPlanner(tok, questions[:1], None)
        reads = other.plan(["a probe here"])[0]
        assert other.verbatim is False
        assert reads[0].prompt_token_ids == tok.encode_chat(
            decision_messages("a probe here", questions[0]))
    finally:
        tok.hf.chat_template = original

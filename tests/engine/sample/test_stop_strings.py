"""Stop strings: the matcher on a toy decoder, then the engine on the demo model's tokenizer."""

from __future__ import annotations

import pytest

from detlora.config import SamplingParams
from detlora.engine.sample.stop_strings import StopMatch, match_stop_string
from detlora.entrypoints.demo import build_demo_assets
from detlora.entrypoints.llm import LLM

PIECES = ["ab", "c", "de", "f", " ", "gh", "i", "END", "x"]


def decode(ids):
    return "".join(PIECES[i] for i in ids)


def ids_of(*pieces):
    return [PIECES.index(p) for p in pieces]


def test_a_stop_string_completed_by_the_newest_token():
    ids = ids_of("ab", "c", "de", "f")  # "abcdef"
    assert match_stop_string(decode, ids, ["cdef"]) == StopMatch("cdef", 2)
    assert match_stop_string(decode, ids, ["cdef"], include_stop=True) == StopMatch("cdef", 6)
    assert match_stop_string(decode, ids, ["ef", "bcdef", "zz"]) == StopMatch("bcdef", 1)


def test_text_that_was_already_there_does_not_stop():
    ids = ids_of("ab", "c", "de", "f")
    assert match_stop_string(decode, ids, ["abc"]) is None  # ended two tokens ago
    assert match_stop_string(decode, ids, ["zz"]) is None
    assert match_stop_string(decode, ids, []) is None
    assert match_stop_string(decode, [], ["a"]) is None


def test_only_a_short_tail_is_decoded_without_a_match():
    calls = []

    def counting(ids):
        calls.append(len(ids))
        return decode(ids)

    ids = ids_of("x") * 500 + ids_of("gh")
    assert match_stop_string(counting, ids, ["END"]) is None
    assert max(calls) <= len("END") + 4 + 1
    calls.clear()
    assert match_stop_string(counting, ids + ids_of("END"), ["hEND"]) == StopMatch("hEND", 501)
    assert max(calls) == 502  # the whole text, once a tail matched


def test_a_character_completed_by_the_newest_token_counts_as_new():
    # Byte-level tokenizers decode half a character as U+FFFD until its last byte arrives.
    def decode_bytes(ids):
        return bytes(ids).decode("utf-8", errors="replace")

    text = "ok caf\u00e9"
    ids = list(text.encode("utf-8"))  # one token per byte: "é" is two
    assert decode_bytes(ids[:-1]).endswith("\ufffd")
    assert match_stop_string(decode_bytes, ids, ["caf\u00e9"]) == StopMatch("caf\u00e9", 3)
    short = list("ok \u00e9".encode("utf-8"))  # "ok" lies inside the decoded tail
    assert match_stop_string(decode_bytes, short, ["ok"]) is None  # complete long before


@pytest.mark.parametrize(("stop", "message"), [
    ("", "must not be empty"), (["ok", ""], "must not be empty"),
    ([1], "string or a sequence of strings"), (5, "string or a sequence of strings"),
])
def test_bad_stop_parameters(stop, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(temperature=0.0, stop=stop)


def test_stop_parameters_are_normalized():
    with pytest.raises(ValueError, match="include_stop_str_in_output must be a bool"):
        SamplingParams(temperature=0.0, stop="x", include_stop_str_in_output=1)
    assert SamplingParams(temperature=0.0, stop="x").stop == ("x",)
    assert SamplingParams(temperature=0.0, stop=["x", "y"]).stop == ("x", "y")


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    model_dir, _ = build_demo_assets(tmp_path_factory.mktemp("stop"))
    return LLM(str(model_dir), device="cpu", max_model_len=128)


PROMPTS = ["the engine reads the prompt and", "a sum in floating point", "hi"]


def test_generation_stops_at_the_string(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    full = llm.generate(PROMPTS[0], greedy, use_tqdm=False)[0].outputs[0]
    stop = full.text[30:36]
    cut = full.text.index(stop)
    params = SamplingParams(temperature=0.0, max_tokens=24, stop=["never there", stop])
    out = llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0]
    assert out.text == full.text[:cut] and out.finish_reason == "stop"
    assert out.stop_reason == stop
    n = len(out.token_ids)
    assert out.token_ids == full.token_ids[:n] and n < len(full.token_ids)
    # The last kept token completes the string; the one before does not.
    assert stop in llm.get_tokenizer().decode(out.token_ids)
    assert stop not in llm.get_tokenizer().decode(out.token_ids[:-1])
    kept = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=24, stop=stop,
                                                   include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == full.text[: cut + len(stop)] and kept.token_ids == out.token_ids


def test_stop_strings_are_batch_invariant(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    fulls = [o.outputs[0] for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    stops = SamplingParams(temperature=0.0, max_tokens=24, stop=[f.text[25:29] for f in fulls])
    alone = [llm.generate(p, stops, use_tqdm=False)[0].outputs[0] for p in PROMPTS]
    batch = [o.outputs[0] for o in llm.generate(PROMPTS[::-1], stops, use_tqdm=False)][::-1]
    assert [(o.text, o.token_ids, o.stop_reason) for o in alone] == \
        [(o.text, o.token_ids, o.stop_reason) for o in batch]
    assert all(o.finish_reason == "stop" for o in alone)


def test_min_tokens_holds_back_stop_strings(llm):
    full = llm.generate(PROMPTS[1], SamplingParams(temperature=0.0,
                                                   max_tokens=20), use_tqdm=False)[0].outputs[0]
    first_word = full.text.split()[0]
    early = llm.generate(PROMPTS[1], SamplingParams(temperature=0.0,
                                                    max_tokens=20, stop=first_word),
                         use_tqdm=False)[0].outputs[0]
    assert early.finish_reason == "stop" and early.text == full.text[: full.text.index(
        first_word)]
    late = llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=20, stop=first_word,
                                                   min_tokens=len(early.token_ids) + 1),
                        use_tqdm=False)[0].outputs[0]
    assert len(late.token_ids) > len(early.token_ids)


def test_stop_strings_need_a_tokenizer(llama_dir):
    no_tok = LLM(str(llama_dir), device="cpu", max_model_len=64)
    with pytest.raises(ValueError, match="stop strings need the model's tokenizer"):
        no_tok.generate([[3, 4]], SamplingParams(temperature=0.0, stop="x"), use_tqdm=False)
    assert not no_tok.engine.has_unfinished()

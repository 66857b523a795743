"""suites.evals' pieces on the CPU: the generated task is the same on every machine, requests
are split as lm-eval splits them, answers are read as lm-eval reads them, and the headline."""

import json
from pathlib import Path

from benchmarks.harness.headlines import headline
from benchmarks.suites.evals import answer_of, loglikelihood_requests, mc_docs


def test_the_multiple_choice_task_is_fixed_and_sound():
    docs = mc_docs(500)
    assert docs == mc_docs(500) and len(docs) == 500
    assert json.dumps(docs[:2]) == json.dumps(mc_docs(2))
    for d in docs:
        a, b = (int(x) for x in d["question"][len("What is "):-1].split(" + "))
        assert d["choices"][d["answer"]] == str(a + b) and len(set(d["choices"])) == 4
    assert {d["answer"] for d in docs} == {0, 1, 2, 3}


def test_requests_split_context_and_continuation_as_lm_eval(tmp_path: Path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "Question:", "What", "is", "1", "+", "2?",
                                         "Answer:", "3", "4", "5", "6"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    doc = {"question": "What is 1 + 2?", "choices": ["3", "4", "5", "6"], "answer": 0}
    reqs = loglikelihood_requests(fast, [doc])
    assert len(reqs) == 4
    ids, ctx = reqs[0]
    assert ctx == 7 and ids == [1, 2, 3, 4, 5, 6, 7, 8]


def test_answers_are_read_as_lm_eval_reads_them():
    # Echoed prompt of 4 tokens plus one generated; the continuation is the last 2 prompt ones.
    lps = [None, -1.0, -0.5, -0.25, -3.0]
    tops = [None, {"a": -0.1}, {"b": -0.5}, {"c": -0.25}, {"d": -0.2}]
    assert answer_of(lps, tops, 2) == (-0.75, True)
    assert answer_of(lps, tops, 1) == (-1.75, False)


def test_headline_of_an_evals_file():
    rows = [{"model": "m", "task_type": "loglikelihood", "client": "http", "concurrency": c,
             "requests_per_s": r, "vs_offline": v, "samples": 2000, "differing": 0}
            for c, r, v in ((1, 50.0, 0.1), (64, 800.0, 0.9))]
    rows.append({"model": "m", "task_type": "generate_until", "client": "lm-eval",
                 "concurrency": 64, "requests_per_s": 9.0, "vs_offline": None, "samples": 50,
                 "differing": 1})
    got = headline({"meta": {}, "lm_eval": "0.4.13", "rows": rows})
    assert got == {"differing": 1, "lm_eval": "0.4.13", "loglikelihood_per_s_c64": 800.0,
                   "vs_offline": 0.9}

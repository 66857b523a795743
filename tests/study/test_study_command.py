"""``detlora study``: the quick study end to end on the tiny model, a user's model and adapter,
bad input, and the report and figures of a GPU-like result."""

from __future__ import annotations

import json

import pytest

from detlora.entrypoints.cli import main
from detlora.study.report import render, targets
from detlora.study.run import StudyResult

SCHEMA = {
    "replay": {"reduction", "comparisons", "differing"},
    "repeat": {"model", "level", "reduction", "task", "comparisons", "changed",
               "answers_changed"},
    "cross_batch": {"model", "level", "check", "comparisons", "changed"},
    "decisions": {"model", "level", "reduction", "comparisons", "changed", "mean_abs_drift",
                  "max_abs_drift", "flips"},
    "performance": {"model", "level", "reduction", "batch", "tpot_ms", "output_tok_per_s"},
}


def test_quick_study_on_the_tiny_model(tmp_path, capsys):
    out = tmp_path / "study"
    assert main(["study", "tiny", "--quick", "--out", str(out), "--no-progress"]) == 0
    data = json.loads((out / "study.json").read_text())
    assert set(data) == {"meta", *SCHEMA, "trace"}
    meta = data["meta"]
    assert {"model", "adapter", "fingerprint"} <= set(meta) and not meta["errors"]
    label = meta["model"][0]
    assert "rank 16" in meta["adapter"][label]
    assert len(meta["fingerprint"][label]) == 8  # fast, run_to_run x 5, batch_invariant x 2
    for section, keys in SCHEMA.items():
        for row in data[section]:
            assert keys <= set(row), (section, row)
    reductions = {r["reduction"] for r in data["replay"]}
    assert reductions == {"atomic", "unsplit", "ordered", "ordered_bi", "tree", "in_gemm"}
    assert {(r["level"], r["reduction"]) for r in data["repeat"]} == {
        (lv, red) for lv, red in (k.split("/") for k in meta["fingerprint"][label])}
    checks = {r["check"] for r in data["cross_batch"]}
    assert {"batch_3", "batch_6", "batch_6_repeat", "reverse_order", "chunked_prefill",
            "preemption", "prefix_cache_cold", "prefix_cache_warm"} == checks
    assert any(r.get("preemptions") for r in data["cross_batch"])
    assert any(r.get("cached_tokens") for r in data["cross_batch"]
               if r["check"] == "prefix_cache_warm")
    # On the CPU nothing repeats differently, and batch_invariant holds across the batches.
    assert all(r["differing"] == 0 for r in data["replay"])
    assert all(r["bits_changed"] == 0 for r in data["repeat"])
    assert all(r["bits_changed"] == 0 for r in data["cross_batch"]
               if r["level"] == "batch_invariant")
    assert all(r["changed"] == 0 for r in data["decisions"] if r["check"] == "repeat")
    assert data["performance"] == []
    assert data["trace"]["per_model"][0]["found"] is False
    md = (out / "study.md").read_text()
    for heading in ("## 1. Identical-input", "## 2. Repeated generation", "## 3. Batch size",
                    "## 4. Structured decisions", "## 5. Trace", "## 6. Performance"):
        assert heading in md
    assert "97.61%" in md and "CPU run" in md and "no dataset is downloaded" in md
    assert (out / "changes.png").stat().st_size > 1000 and (out / "drift.png").exists()
    assert "wrote" in capsys.readouterr().out
    # The report and figures come back from study.json alone.
    (out / "study.md").unlink()
    (out / "changes.png").unlink()
    assert main(["study", "--render", str(out)]) == 0
    assert (out / "study.md").read_text() == md and (out / "changes.png").exists()
    assert main(["study", "--render", str(out / "nowhere")]) == 2
    assert main(["study", "tiny", "--render", str(out)]) == 2


def test_a_users_model_adapter_and_prompts(tmp_path, llama_dir, llama_adapters):
    from detlora.entrypoints.demo import build_tokenizer

    tok = tmp_path / "tok"
    tok.mkdir()
    build_tokenizer(tok)  # a word-level tokenizer for the tokenizer-less test checkpoint
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "the engine reads the prompt and", "answer": 3}\n'
                       '{"prompt": "a sum in floating point"}\n')
    out = tmp_path / "out"
    argv = ["study", str(llama_dir), "--adapter", str(llama_adapters[0]), "--quick",
            "--tokenizer", str(tok), "--prompts", str(prompts), "--sections", "repeat",
            "--reductions", "ordered", "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    data = json.loads((out / "study.json").read_text())
    assert data["meta"]["adapter"] == {llama_dir.name: llama_adapters[0].name}
    assert {r["task"] for r in data["repeat"]} == {"arithmetic", "text"}
    assert {r["reduction"] for r in data["repeat"]} == {"atomic", "ordered", "in_gemm"}
    assert "from p.jsonl (2 prompts)" in data["meta"]["tasks"]


@pytest.mark.parametrize(("argv", "message"), [
    (["study", "/no/such/model"], "does not exist"),
    (["study", "tiny", "--gpu-memory-utilization", "2"], "gpu_memory_utilization"),
    (["study", "tiny", "--sections", "replay,nope"], "unknown sections"),
    (["study", "tiny", "--reductions", "fastest"], "reduction must be one of"),
    (["study", "tiny", "--prompts", "/no/such.jsonl"], "does not exist"),
    (["study", "tiny", "tiny", "--adapter", "/tmp"], "goes with one MODEL"),
])
def test_bad_input_is_named(tmp_path, capsys, argv, message):
    assert main([*argv, "--quick", "--out", str(tmp_path), "--no-progress"]) == 2
    assert message in capsys.readouterr().err


def _gpu_like() -> dict:
    layers = [{"layer": i, "shrink_max_abs": 1e-8 * (i + 1), "shrink_differing": i,
               "k_max_abs": 0.0 if i == 0 else 1e-3, "k_differing": i * 3,
               "v_max_abs": 0.0 if i == 0 else 2e-3, "v_differing": i * 2} for i in range(3)]
    perf = [{"model": "m", "level": lv, "reduction": red, "batch": b, "tpot_ms": 2.0,
             "output_tok_per_s": 100.0 * b, "e2e_s": e, "e2e_vs_atomic": e,
             "tpot_vs_atomic": 1.0}
            for lv, red, e in (("fast", "atomic", 1.0), ("run_to_run", "ordered", 1.015),
                               ("run_to_run", "unsplit", 1.2)) for b in (1, 16)]
    return {
        "meta": {"command": "detlora study m", "gpu": "NVIDIA H200", "date": "d",
                 "detlora": "0", "commit": "abc", "torch": "t", "triton": "t", "cuda": "13",
                 "quick": False, "tasks": "generated", "sandbox": "s", "model": ["m"],
                 "adapter": {"m": "default"}, "fingerprint": {"m": {"fast/atomic": "f"}},
                 "plan": {"prompts": 2, "repetitions": 2, "max_tokens": 2, "cross_prompts": 2,
                          "cross_tokens": 2, "cross_batches": [2], "comments": 2,
                          "replay_executions": 2, "replay_rows": [1], "trace_runs": 2,
                          "perf_batches": [1, 16], "perf_tokens": 2, "perf_trials": 1},
                 "notes": [], "errors": []},
        "replay": [{"model": "m", "reduction": "atomic", "shape": "qkv", "M": 1,
                    "phase": "decode", "comparisons": 4, "differing": 3,
                    "max_abs_diff": 1e-8}],
        "repeat": [{"model": "m", "level": "fast", "reduction": "atomic", "task": "arithmetic",
                    "comparisons": 4, "changed": 1, "answers_changed": 1, "bits_changed": 2,
                    "correctness_flips": 1}],
        "cross_batch": [{"model": "m", "level": "batch_invariant", "check": "batch_16",
                         "comparisons": 4, "changed": 0, "bits_changed": 0}],
        "decisions": [{"model": "m", "level": "fast", "reduction": "atomic", "check": "repeat",
                       "comparisons": 4, "changed": 3, "mean_abs_drift": 1e-3,
                       "max_abs_drift": 5e-3, "flips": 1, "accuracy": 0.5,
                       "drift_values": [1e-4, 1e-3, 5e-3]}],
        "trace": {"per_model": [{
            "model": "m", "level": "fast", "reduction": "atomic", "found": True,
            "prompt_index": 0, "pair": [0, 3], "first_differing_token": 5, "position": 40,
            "token_a": {"id": 1, "text": "There"}, "token_b": {"id": 2, "text": "Each"},
            "logits_run_a": {"logit_a": 21.75, "logit_b": 21.75, "margin": 0.0},
            "logits_run_b": {"logit_a": 21.625, "logit_b": 21.75, "margin": -0.125},
            "first_shrink_difference": {"step": 0, "layer_name": "model.layers.1.mlp.gate_up",
                                        "position": 7, "value_a": 0.1, "value_b": 0.1000001,
                                        "abs_diff": 1e-7},
            "layers": layers,
            "controlled": {"level": "run_to_run", "reduction": "unsplit", "trials": 2,
                           "token_changed_by_cache": True,
                           "from_cache_a": {"token": {"id": 1, "text": "There"},
                                            "logit_a": 21.75, "logit_b": 21.75,
                                            "repeatable": True, "answer": "7", "correct": True},
                           "from_cache_b": {"token": {"id": 2, "text": "Each"},
                                            "logit_a": 21.625, "logit_b": 21.75,
                                            "repeatable": True, "answer": "8",
                                            "correct": False}}}]},
        "performance": perf,
    }


def test_report_and_figures_of_a_gpu_like_result(tmp_path):
    from detlora.study.report import write_report

    data = _gpu_like()
    result = StudyResult(**{k: data[k] for k in data})
    figures = write_report(result, tmp_path)
    assert figures == ["changes.png", "drift.png", "latency.png", "trace.png"]
    assert all((tmp_path / f).stat().st_size > 1000 for f in figures)
    md = (tmp_path / "study.md").read_text()
    assert "The cache alone changes the token." in md and "'Each'" in md
    assert "3/4 (75.00%)" in md  # the replay row
    goals = dict(targets(data))
    best = goals["the best deterministic reduction within 2% of atomic end to end"]
    assert best.startswith("m: run_to_run/ordered: end-to-end time +1.50%")
    # A second model gets its own best, not the other's.
    faster = [dict(r, model="m2", e2e_vs_atomic=r["e2e_vs_atomic"] - 0.2)
              for r in data["performance"]]
    best2 = dict(targets(dict(data, performance=data["performance"] + faster)))[
        "the best deterministic reduction within 2% of atomic end to end"]
    assert best2.startswith(best.split(" (worst")[0]) and "; m2: run_to_run/ordered: " in best2
    assert "0 of 4 (bits) over 1 checks" in goals[
        "batch_invariant: 0 changes across batch sizes, order, chunking, preemption and cache "
        "state"]
    assert render(data, []).count("## ") == 8  # targets, six sections, no figures

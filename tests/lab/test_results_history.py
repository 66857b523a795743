"""The results harness on the CPU: results files, their history rows, headline figures, the
record command, and the report over the repository's own results."""

import json

import pytest

from benchmarks import record, report
from benchmarks.harness import headlines, history, results


def _engine_result(commit="abc", date="2026-01-01T00:00:00+00:00"):
    return {"meta": {"gpu": "G", "driver": "d", "torch": "t", "triton": "x", "commit": commit,
                     "date": date, "command": "python -m benchmarks.suites.engine"},
            "roofline": {"batch1_tpot_floor_ms": 1.5},
            "throughput": [{"mode": "fast", "batch": 64, "output_tok_per_s": 1000.04,
                            "tpot_ms": 4.0},
                           {"mode": "fast", "batch": 1, "output_tok_per_s": 300.0,
                            "tpot_ms": 2.5}],
            "determinism": [{"mode": "fast", "check": "repeat", "comparisons": 4,
                             "differing": 1},
                            {"mode": "fast", "check": "cross_batch", "comparisons": 2,
                             "differing": 0}]}


def test_engine_headline_is_tok_per_s_at_64_and_tpot_at_1():
    h = headlines.headline(_engine_result())
    assert h == {"tok_per_s_b64": {"fast": 1000.0}, "tpot_ms_b1": {"fast": 2.5},
                 "differing_outputs": {"fast": "1/6"}, "batch1_tpot_floor_ms": 1.5}


def test_unknown_layout_has_no_headline():
    assert headlines.headline({"meta": {}, "rows": [{"us": 1.0}]}) == {}


def test_write_results_appends_one_history_row_beside_the_file(tmp_path):
    out = tmp_path / "engine.json"
    results.write_results(out, _engine_result())
    results.write_results(out, _engine_result(), history=False)  # a partial save: no row
    assert json.loads(out.read_text())["meta"]["commit"] == "abc"
    rows = history.read_history(tmp_path / "history.jsonl")
    assert [(r["study"], r["commit"], r["file"]) for r in rows] == [("engine", "abc",
                                                                      "engine.json")]
    assert rows[0]["headline"]["tok_per_s_b64"] == {"fast": 1000.0}
    assert rows[0]["command"] == "python -m benchmarks.suites.engine"


def test_a_row_needs_meta():
    with pytest.raises(ValueError, match="meta"):
        history.history_row("x", {"rows": []}, "x.json")


def test_record_copies_the_current_file_and_adds_its_row_once(tmp_path):
    run_dir, results_dir = tmp_path / "out", tmp_path / "results"
    run_dir.mkdir()
    results_dir.mkdir()
    src = run_dir / "engine.json"
    src.write_text(json.dumps(_engine_result("c1")))
    assert "history row added" in record.record(src, results_dir=results_dir)
    assert "already there" in record.record(src, results_dir=results_dir)
    src.write_text(json.dumps(_engine_result("c2", "2026-01-02T00:00:00+00:00")))
    record.record(src, label="side", history_only=True, results_dir=results_dir)
    assert json.loads((results_dir / "engine.json").read_text())["meta"]["commit"] == "c1"
    rows = history.read_history(results_dir / "history.jsonl")
    assert [(r["commit"], r["label"]) for r in rows] == [("c1", ""), ("c2", "side")]


def test_record_names_a_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.json"):
        record.record(tmp_path / "nope.json", results_dir=tmp_path)


def test_repository_results_have_no_snapshots_and_a_history_row_each():
    names = {p.stem for p in history.RESULTS_DIR.glob("*.json")}
    rows = history.read_history()
    assert names <= {r["file"].removesuffix(".json") for r in rows}
    for name in names:
        assert not any(len(part) == 7 and all(c in "0123456789abcdef" for c in part)
                       and any(c.isdigit() for c in part) for part in name.split("_")), name


def test_report_renders_every_current_file():
    text = report.render()
    for path in history.RESULTS_DIR.glob("*.json"):
        assert f"results/{path.name}" in text


def test_docs_results_is_up_to_date():
    assert report.DOC.read_text() == report.render(), "run python -m benchmarks.report"


def test_meta_names_the_host_and_history_rows_keep_it():
    from benchmarks.harness import results_meta

    meta = results_meta("python -m x")
    assert " CPUs" in meta["host"] and meta["command"] == "python -m x"
    result = _engine_result()
    assert "host" not in history.history_row("engine", result, "engine.json")  # older files
    result["meta"]["host"] = meta["host"]
    assert history.history_row("engine", result, "engine.json")["host"] == meta["host"]
    assert f"host {meta['host']}" in report._meta_line(result["meta"])


def test_a_tree_that_differs_from_head_is_filed_as_dirty(tmp_path):
    """Results made from files that are not HEAD's (uncommitted edits, or a copy whose .git is
    older than its files) carry ``-dirty``, and the report keeps the mark."""
    import subprocess

    from benchmarks.harness.meta import git_commit

    def git(*args):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
                              cwd=tmp_path, check=True, capture_output=True, text=True).stdout
    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("commit", "-qm", "a")
    head = git("rev-parse", "HEAD").strip()
    (tmp_path / "untracked.txt").write_text("not part of any commit\n")
    assert git_commit(tmp_path) == head
    (tmp_path / "a.py").write_text("x = 2\n")
    assert git_commit(tmp_path) == head + "-dirty"
    assert git_commit(tmp_path / "untracked.txt") == "unknown"  # not a directory: no git
    assert f"commit `{head[:10]}-dirty`" in report._meta_line(
        _engine_result(commit=head + "-dirty")["meta"])

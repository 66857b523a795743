"""``detlora study --merge``: two quick runs of the tiny model with disjoint sections merge into
the study one run of both sections gives; runs that do not compare, a model in two runs with
the same sections and bad input are refused by name."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from detlora.entrypoints.cli import main
from detlora.study.merge import merge_results, merge_studies
from detlora.study.run import load_study

# One worker runs the quick studies the tests share (a module fixture), not one per worker.
pytestmark = pytest.mark.xdist_group("study_merge")

# Fields that measure time, not bits: they differ from run to run.
TIMINGS = {"tpot_ms", "output_tok_per_s", "e2e_s", "e2e_vs_atomic", "tpot_vs_atomic"}
QUICK = ["--quick", "--reductions", "ordered", "--no-progress"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Study directories of the tiny model: 'a' (repeat), 'b' (decisions, trace) and 'both'
    (the three sections in one run)."""
    root = tmp_path_factory.mktemp("merge")
    out = {}
    for name, sections in (("a", "repeat"), ("b", "decisions,trace"),
                           ("both", "repeat,decisions,trace")):
        out[name] = root / name
        assert main(["study", "tiny", *QUICK, "--sections", sections,
                     "--out", str(out[name])]) == 0
    return out


def _rows(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMINGS} for r in rows]


def test_disjoint_sections_merge_into_the_study_of_both(runs, tmp_path):
    merged = merge_studies([runs["a"], runs["b"] / "study.json"], out=tmp_path / "m")
    data = json.loads((tmp_path / "m" / "study.json").read_text())
    assert data == json.loads(json.dumps(merged.as_json()))
    both = json.loads((runs["both"] / "study.json").read_text())
    a, b = (json.loads((runs[k] / "study.json").read_text())["meta"] for k in ("a", "b"))
    for section in ("replay", "repeat", "cross_batch", "decisions", "performance"):
        assert _rows(data[section]) == _rows(both[section]), section
    assert data["repeat"] and data["decisions"] and not data["replay"]
    # The trace ran without the repeat section: it cannot say how many prompts changed there.
    entries = data["trace"]["per_model"]
    assert [e["prompts_changed_in_repeat"] for e in entries] == [None]
    assert [{**e, "prompts_changed_in_repeat": 0} for e in entries] == \
        both["trace"]["per_model"]
    meta, ref = data["meta"], both["meta"]
    for key in ("model", "adapter", "fingerprint", "models", "plan", "quick", "torch", "tasks",
                "device", "commit", "notes", "errors"):
        assert meta[key] == ref[key], key
    label = ref["model"][0]
    assert meta["sections"] == ["repeat", "decisions", "trace"]
    assert meta["sections_by_model"] == {label: ["repeat", "decisions", "trace"]}
    assert set(meta["timing"][label]) == {"repeat", "decisions", "trace"}
    assert meta["merged_from"] == [{"command": m["command"], "date": m["date"],
                                    "seconds": m["seconds"]} for m in (a, b)]
    assert meta["date"] == max(a["date"], b["date"])
    assert meta["seconds"] == round(a["seconds"] + b["seconds"], 1)
    assert "--merge" in meta["command"] and a["command"] in meta["command"] \
        and b["command"] in meta["command"] and "--sections repeat" in a["command"]
    md = (tmp_path / "m" / "study.md").read_text()
    assert "Merged from 2 runs" in md and f"`{a['command']}`" in md
    assert "| repeat, decisions, trace |" in md
    for heading in ("## 2. Repeated generation", "## 4. Structured decisions", "## 5. Trace"):
        assert heading in md
    assert main(["study", "--render", str(tmp_path / "m")]) == 0


def _relabel(study, label: str):
    """``study`` as if its one model were called ``label``."""
    old = study.meta["model"][0]
    text = json.dumps(study.as_json()).replace(json.dumps(old), json.dumps(label))
    return type(study)(**json.loads(text))


def test_a_merged_study_merges_again_with_another_model(runs):
    first = merge_results([load_study(runs["a"]), load_study(runs["b"])])
    other = _relabel(load_study(runs["both"]), "other")
    merged = merge_results([other, first])
    label = first.meta["model"][0]
    assert merged.meta["model"] == ["other", label]
    assert [r["command"] for r in merged.meta["merged_from"]] == [
        other.meta["command"], *(r["command"] for r in first.meta["merged_from"])]
    assert merged.meta["sections_by_model"] == {
        "other": ["repeat", "decisions", "trace"], label: ["repeat", "decisions", "trace"]}
    assert [r["model"] for r in merged.repeat] == (
        ["other"] * len(other.repeat) + [label] * len(first.repeat))
    assert [e["model"] for e in merged.trace["per_model"]] == ["other", label]
    with pytest.raises(ValueError, match="same sections"):
        merge_results([first, load_study(runs["a"])])


def test_runs_that_do_not_compare_are_refused(runs, tmp_path):
    data = json.loads((runs["b"] / "study.json").read_text())
    data["meta"]["torch"] = "0.0-elsewhere"
    other = tmp_path / "other.json"
    other.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"differ in torch: '.+' in .+, '0.0-elsewhere' in"):
        merge_studies([runs["a"], other], out=tmp_path / "m")
    data["meta"]["torch"] = load_study(runs["a"]).meta["torch"]
    data["meta"]["plan"]["prompts"] += 1
    other.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="differ in plan"):
        merge_studies([runs["a"], other], out=tmp_path / "m")
    assert not (tmp_path / "m").exists()


def test_a_model_in_two_runs_with_the_same_sections_is_refused(runs, tmp_path):
    label = load_study(runs["a"]).meta["model"][0]
    named = rf"model '{re.escape(label)}' is in .+ with the same sections \['repeat'\]"
    with pytest.raises(ValueError, match=named):
        merge_studies([runs["a"], runs["both"]], out=tmp_path / "m")
    copy = tmp_path / "copy"
    shutil.copytree(runs["b"], copy)
    with pytest.raises(ValueError, match=r"same sections \['decisions', 'trace'\]"):
        merge_studies([runs["b"], copy], out=tmp_path / "m")
    b = load_study(runs["b"])
    b.meta["adapter"][label] = "another adapter"
    with pytest.raises(ValueError, match="different adapters"):
        merge_results([load_study(runs["a"]), b])


def test_differing_fingerprints_are_kept_with_their_sections(runs):
    a, b = load_study(runs["a"]), load_study(runs["b"])
    label = a.meta["model"][0]
    fp = b.meta["fingerprint"][label]
    setup = next(iter(fp))
    fp[setup] = "0123456789abcdef"
    merged = merge_results([a, b])
    assert merged.meta["fingerprint"][label][setup] == (
        f"{a.meta['fingerprint'][label][setup]} (repeat) | 0123456789abcdef (decisions, trace)")
    assert any("different fingerprints" in n for n in merged.meta["notes"])


def test_an_unfinished_run_is_refused(runs):
    a, b = load_study(runs["a"]), load_study(runs["b"])
    del b.meta["seconds"]  # study.json as a run killed midway leaves it
    with pytest.raises(ValueError, match="did not finish"):
        merge_results([a, b], names=["a", "b"])


def test_merge_on_the_command_line(runs, tmp_path, capsys):
    out = tmp_path / "m"
    assert main(["study", "--merge", str(runs["a"]), str(runs["b"]), "--out", str(out)]) == 0
    assert "merged 2 studies" in capsys.readouterr().out
    meta = json.loads((out / "study.json").read_text())["meta"]
    assert meta["command"].startswith(f"detlora study --merge {runs['a']} {runs['b']} --out")
    assert (out / "study.md").exists()


@pytest.mark.parametrize(("extra", "message"), [
    (["/no/such/study.json"], "/no/such/study.json does not exist"),
    ([], "two or more studies"),
    (["--render", "x"], "--merge takes no MODEL and no --render"),
])
def test_bad_merge_input_is_one_line(runs, tmp_path, capsys, extra, message):
    argv = ["study", "--merge", str(runs["a"]), *extra, "--out", str(tmp_path / "m")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_out_may_not_be_an_input(runs, tmp_path, capsys):
    assert main(["study", "--merge", str(runs["a"]), str(runs["b"]), "--out",
                 str(runs["b"])]) == 2
    assert "would overwrite it" in capsys.readouterr().err

"""``detlora study --merge``: separate runs of the study as one study.

A GPU job with a time limit may not hold the whole study, and models may run on separate
machines of one kind; each run writes its own study.json, and

    merge_studies(["run-a", "run-b/study.json"], out="study-out")

combines them into one ``StudyResult`` and writes study.json, study.md and figures into
``out``, running nothing. The rules keep the merged report truthful:

- The runs must share what makes their numbers comparable (``COMPARABLE``): the device, GPU,
  driver, CUDA, torch, Triton, detlora version and commit, ``quick``, the plan and the tasks.
  The plan and the tasks must be equal too, not recorded per model: the report states one
  plan and one task source, and a model's rates under another plan (prompts, repetitions,
  tokens, seed) are another measurement. Runs that differ are separate studies; the merge
  refuses them with a ValueError naming the field and both values.
- A model (by label) may be in several runs only with disjoint sections (one run did replay
  and repeat of a model, another decisions, trace and performance); otherwise the merge
  refuses, naming the model and the sections both runs hold. Its adapter and shape must be
  the same in every run (else they are two models under one label).
- A run that did not finish (a study.json without ``meta.seconds``, written while the run
  was going) is refused: it names sections it may not hold.
- Rows are merged as their runs wrote them. A trace run without the repeat section records
  ``prompts_changed_in_repeat`` as None (it has no repeat runs to count), not 0.

The merged meta keeps each run's per-model data: the models in order of first appearance,
their adapters, fingerprints (a configuration whose fingerprint differs between the runs of
one model keeps both, each with the sections it ran, and a note says so), shapes (the
largest ``max_model_len`` and ``longest_prompt``), timings (summed per section), errors,
notes (once each) and ``sections_by_model``: the sections each model holds. ``sections`` is
their union. ``command`` says the study was merged and lists the runs' commands;
``merged_from`` keeps each run's command, date and seconds (a merged input contributes its
own runs); ``date`` is the latest run's, ``seconds`` their sum. Rows and trace entries are
grouped by model in that order, each model's in the order of its run.
"""

from __future__ import annotations

import datetime
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from detlora.study.plan import SECTIONS
from detlora.study.run import StudyResult, _write_json, load_study

# What makes the numbers of two runs comparable: they must be equal to merge.
COMPARABLE = ("device", "gpu", "driver", "cuda", "torch", "triton", "detlora", "commit",
              "quick", "plan", "tasks")
# A model's shape in meta.models: equal in every run of one label (else two models).
_SHAPE = ("architecture", "hidden", "layers", "vocab", "adapters", "max_rank", "chat_template")
_ROWS = ("replay", "repeat", "cross_batch", "decisions", "performance")


def model_sections(meta: dict, label: str) -> list[str]:
    """The sections a study holds for one model (a single run: the run's sections)."""
    by_model = meta.get("sections_by_model") or {}
    return list(by_model.get(label, meta.get("sections", SECTIONS)))


def merge_studies(inputs: Sequence[str | Path], *, out: str | Path,
                  argv: Sequence[str] | None = None) -> StudyResult:
    """Read each input's study.json (a directory means DIR/study.json), merge them
    (``merge_results``) and write study.json, study.md and figures into ``out``."""
    from detlora.study.report import write_report

    if len(inputs) < 2:
        raise ValueError(f"--merge takes two or more studies, got {len(inputs)}")
    paths = [Path(p) / "study.json" if Path(p).is_dir() else Path(p) for p in inputs]
    out = Path(out)
    target = (out / "study.json").resolve()
    for p in paths:
        if p.resolve() == target:
            raise ValueError(f"--out {out} is where the input {p} is: the merged study would "
                             "overwrite it (write it elsewhere)")
    studies = [load_study(p) for p in paths]
    command = " ".join(["detlora", "study", *argv] if argv is not None else [
        "detlora", "study", "--merge", *(shlex.quote(str(p)) for p in inputs), "--out",
        shlex.quote(str(out))])
    result = merge_results(studies, names=[str(p) for p in paths], command=command)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out, result)
    write_report(result, out)
    return result


def merge_results(studies: Sequence[StudyResult], *, names: Sequence[str] | None = None,
                  command: str = "detlora study --merge") -> StudyResult:
    """One study of ``studies`` (see the module's rules); ``names`` name them in errors."""
    names = list(names) if names is not None else [f"input {i + 1}" for i in range(len(studies))]
    metas = [s.meta for s in studies]
    for name, meta in zip(names, metas, strict=True):
        if meta.get("seconds") is None:
            raise ValueError(f"{name} is from a run that did not finish (its meta has no "
                             "seconds): its sections may be incomplete; run them again")
    first = metas[0]
    for name, meta in zip(names[1:], metas[1:], strict=True):
        for field in COMPARABLE:
            if meta.get(field) != first.get(field):
                raise ValueError(f"the runs differ in {field}: {first.get(field)!r} in "
                                 f"{names[0]}, {meta.get(field)!r} in {name}; only runs "
                                 "that share it merge into one study")

    labels: list[str] = []
    sections: dict[str, list[str]] = {}  # label -> sections, in SECTIONS order
    where: dict[str, str] = {}  # label -> the first input that holds it
    adapter: dict[str, str] = {}
    info: dict[str, dict] = {}
    # label -> setup -> [(fingerprint, the sections of the runs that had it)]
    seen: dict[str, dict[str, list[tuple[str, list[str]]]]] = {}
    timing: dict[str, dict[str, float]] = {}
    notes: list[str] = []
    errors: list[dict] = []
    for name, meta in zip(names, metas, strict=True):
        infos = {m["label"]: m for m in meta.get("models", [])}
        for label in meta.get("model", []):
            mine = model_sections(meta, label)
            if label in sections:
                both = [s for s in mine if s in sections[label]]
                if both:
                    raise ValueError(f"model {label!r} is in {where[label]} and {name} with "
                                     f"the same sections {both}: a model may be in several "
                                     "runs only with disjoint --sections")
                theirs = meta.get("adapter", {}).get(label)
                if theirs != adapter[label]:
                    raise ValueError(f"model {label!r} has adapter {adapter[label]!r} in "
                                     f"{where[label]} and {theirs!r} in {name}: the runs "
                                     "studied different adapters")
                _merge_info(info[label], infos.get(label, {}), label, where[label], name)
                sections[label] = [s for s in SECTIONS if s in sections[label] or s in mine]
            else:
                labels.append(label)
                where[label] = name
                sections[label] = [s for s in SECTIONS if s in mine]
                adapter[label] = meta.get("adapter", {}).get(label)
                info[label] = dict(infos.get(label, {"label": label}))
                seen[label] = {}
            for setup, fp in meta.get("fingerprint", {}).get(label, {}).items():
                fps = seen[label].setdefault(setup, [])
                same = next((secs for f, secs in fps if f == fp), None)
                if same is None:
                    fps.append((fp, list(mine)))
                else:
                    same += mine
            for section, seconds in meta.get("timing", {}).get(label, {}).items():
                t = timing.setdefault(label, {})
                t[section] = round(t.get(section, 0.0) + seconds, 2)
        notes += [n for n in meta.get("notes", []) if n not in notes]
        errors += meta.get("errors", [])

    fingerprint = {label: _fingerprints(seen[label], label, notes) for label in labels}
    runs = [run for meta in metas for run in meta.get("merged_from") or [
        {"command": meta.get("command"), "date": meta.get("date"),
         "seconds": meta.get("seconds")}]]
    sandboxes = list(dict.fromkeys(m.get("sandbox") for m in metas))
    merged = {
        "study": first.get("study", "detlora study"),
        "command": f"{command} (merged from: {'; '.join(str(r['command']) for r in runs)})",
        "date": _latest([r["date"] for r in runs]),
        **{field: first.get(field) for field in COMPARABLE if field not in ("plan", "tasks")},
        "plan": first.get("plan"),
        "sections": [s for s in SECTIONS if any(s in v for v in sections.values())],
        "sections_by_model": sections,
        "model": labels, "adapter": adapter, "fingerprint": fingerprint,
        "models": [info[label] for label in labels], "tasks": first.get("tasks"),
        "sandbox": sandboxes[0] if len(sandboxes) == 1 else "; ".join(
            f"run {i + 1}: {m.get('sandbox')}" for i, m in enumerate(metas)),
        "timing": timing, "errors": errors, "notes": notes, "merged_from": runs,
        "seconds": round(sum(r.get("seconds") or 0.0 for r in runs), 1),
    }
    order = {label: i for i, label in enumerate(labels)}

    def by_model(rows: list[dict]) -> list[dict]:
        return sorted(rows, key=lambda r: order.get(r.get("model"), len(order)))

    trace: dict[str, Any] = {}
    for s in studies:
        for key, value in s.trace.items():
            if isinstance(value, list):
                trace.setdefault(key, []).extend(value)
            else:
                trace.setdefault(key, value)
    if isinstance(trace.get("per_model"), list):
        trace["per_model"] = by_model(trace["per_model"])
    rows = {section: by_model([r for s in studies for r in getattr(s, section)])
            for section in _ROWS}
    return StudyResult(meta=merged, trace=trace, **rows)


def _merge_info(mine: dict, other: dict, label: str, a: str, b: str) -> None:
    for key in _SHAPE:
        if key in mine and key in other and mine[key] != other[key]:
            raise ValueError(f"model {label!r} has {key} {mine[key]!r} in {a} and "
                             f"{other[key]!r} in {b}: two models under one label")
    for key in ("max_model_len", "longest_prompt"):  # they follow the sections run
        if key in other:
            mine[key] = max(mine.get(key, other[key]), other[key])


def _fingerprints(seen: dict[str, list[tuple[str, list[str]]]], label: str,
                  notes: list[str]) -> dict[str, str]:
    """Each configuration's fingerprint; where the runs' engines for it differ, both, each
    with the sections it ran (and a note says so)."""
    out = {}
    for setup, fps in seen.items():
        if len(fps) == 1:
            out[setup] = fps[0][0]
            continue
        out[setup] = " | ".join(f"{fp} ({', '.join(secs)})" for fp, secs in fps)
        note = (f"{label}: the runs' engines had different fingerprints (what decides the "
                "bits) for some configurations: each section's rows come from the run that "
                "made them, so comparisons within a section hold, not across runs")
        if note not in notes:
            notes.append(note)
    return out


def _latest(dates: list[Any]) -> Any:
    known = [d for d in dates if isinstance(d, str)]
    if not known:
        return None
    try:
        return max(known, key=datetime.datetime.fromisoformat)
    except (ValueError, TypeError):  # not ISO dates, or naive against aware ones
        return max(known)

"""The results history: ``benchmarks/results/history.jsonl``, one JSON object a line, one line
per run of a study, appended and never rewritten.

A row: ``study`` (the results file's name without ``.json``), ``label`` (which variant of the
study, "" for the plain one), ``commit``, ``date``, ``gpu``, ``driver``, ``torch``, ``triton``,
``command`` (from the file's meta), ``file`` (the results file's name) and ``headline`` (a few
figures, see :mod:`benchmarks.harness.headlines`). Rows back-filled from files since deleted
add ``file_at``: a commit that holds the file (``git show <file_at>:benchmarks/results/<file>``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.harness.headlines import headline
from benchmarks.harness.meta import REPO_ROOT

RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
HISTORY_NAME = "history.jsonl"
META_KEYS = ("commit", "date", "gpu", "driver", "torch", "triton", "command")


def history_row(study: str, result: dict, file: str, label: str = "",
                file_at: str | None = None) -> dict[str, Any]:
    """The history row of one results dict (its ``meta`` must name commit, date, command)."""
    meta = result.get("meta")
    if not isinstance(meta, dict) or not {"commit", "date", "command"} <= set(meta):
        raise ValueError(f"{file}: a results file needs a meta block with commit, date and "
                         "command")
    row: dict[str, Any] = {"study": study, "label": label or meta.get("label", "")}
    row.update({k: meta.get(k) for k in META_KEYS})
    if meta.get("host"):
        row["host"] = meta["host"]
    row["file"] = file
    if file_at:
        row["file_at"] = file_at
    row["headline"] = headline(result)
    return row


def read_history(path: str | Path = RESULTS_DIR / HISTORY_NAME) -> list[dict[str, Any]]:
    """Every row, oldest line first ([] when there is no history yet)."""
    path = Path(path)
    if not path.exists():
        return []
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e})") from None
    return rows


def append_history(row: dict[str, Any], path: str | Path = RESULTS_DIR / HISTORY_NAME) -> bool:
    """Append ``row`` unless a row of the same study, label, commit and date is there; say if
    it was appended."""
    path = Path(path)
    key = (row["study"], row["label"], row["commit"], row["date"])
    if any((r["study"], r["label"], r["commit"], r["date"]) == key for r in read_history(path)):
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")
    return True

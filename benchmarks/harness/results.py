"""Results files: one JSON file per study, written whole, and a history row beside it."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.harness.history import HISTORY_NAME, append_history, history_row


def write_results(out: str | Path, result: dict, *, history: bool = True) -> None:
    """Write a results file (its folder made if needed), say where, and append its row to the
    ``history.jsonl`` of the same folder (``history=False`` for partial saves of a run)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    if history and isinstance(result.get("meta"), dict):
        append_history(history_row(out.stem, result, out.name), out.parent / HISTORY_NAME)

"""Results files: one JSON file per study, written whole."""

from __future__ import annotations

import json
from pathlib import Path


def write_results(out: str | Path, result: dict) -> None:
    """Write a results file (its folder made if needed) and say where."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")

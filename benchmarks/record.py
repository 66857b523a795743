"""Take results files from a GPU run into the repository: each becomes its study's current file
``benchmarks/results/<study>.json`` (replacing the previous one) and gets its row in
``benchmarks/results/history.jsonl`` (once: a row already there is not added again).

    python -m benchmarks.record out/engine.json out/lora_kernels.json
    python -m benchmarks.record out/bi_ops_rowwise.json --study batch_invariant_ops_rowwise
    python -m benchmarks.record out/engine.json --label no_pdl --history-only

``--history-only`` appends the row and leaves the current file alone: for a run that answers a
side question (a variant, an A/B half) and should not replace the study's current file.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from benchmarks.harness.history import HISTORY_NAME, RESULTS_DIR, append_history, history_row


def record(path: Path, study: str | None = None, label: str = "", history_only: bool = False,
           results_dir: Path = RESULTS_DIR) -> str:
    """Record one results file; returns what was done, in words."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such results file")
    try:
        result = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(result, dict):
        raise ValueError(f"{path}: a results file holds a JSON object")
    study = study or path.stem
    target = results_dir / f"{study}.json"
    done = []
    if not history_only:
        if path.resolve() != target.resolve():
            shutil.copyfile(path, target)
        done.append(f"current file {target.name}")
    added = append_history(history_row(study, result, target.name, label=label),
                           results_dir / HISTORY_NAME)
    done.append("history row added" if added else "history row already there")
    return f"{path}: " + ", ".join(done)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--study", help="the study's name (default: each file's name)")
    parser.add_argument("--label", default="", help="which variant of the study this run is")
    parser.add_argument("--history-only", action="store_true",
                        help="append the history row only; keep the current file")
    args = parser.parse_args(argv)
    if args.study and len(args.files) > 1:
        parser.error("--study names one file's study; give one file")
    try:
        for path in args.files:
            print(record(path, args.study, args.label, args.history_only))
    except (FileNotFoundError, ValueError) as e:
        print(f"benchmarks.record: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

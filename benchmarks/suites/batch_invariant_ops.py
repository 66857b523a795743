"""Batch-invariant ops study (GPU): invariance and latency of every op of the forward pass.

Runs the row-wise ops, matmul (+ the torch.library mode and the cuBLAS workspace check) and
paged attention benchmarks, and writes one results file::

    python -m benchmarks.suites.batch_invariant_ops --out out/batch_invariant_ops.json

A part that fails is recorded under "errors" (with its traceback) so that one broken part
does not throw away the GPU time the others spent.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import traceback
from pathlib import Path

PARTS = {  # cheapest first: a part cut short by a time limit loses only itself
    "rowwise": "benchmarks.suites.rowwise",
    "attention": "benchmarks.suites.attention",
    "matmul": "benchmarks.suites.matmul",
}


def run(parts: list[str], log=print, part_dir: Path | None = None) -> dict:
    result: dict = {"invariance": [], "latency": [], "cublas_workspace_invariant": {},
                    "errors": {}}
    for name in parts:
        log(f"=== {name}")
        try:
            part = importlib.import_module(PARTS[name]).run(log=log)
        except Exception:  # keep the other parts' measurements
            result["errors"][name] = traceback.format_exc()
            log(result["errors"][name])
            continue
        if part_dir is not None:  # survives a later part running out of time
            (part_dir / f"bi_ops_{name}.json").write_text(json.dumps(part, indent=1) + "\n")
        result["invariance"] += part.get("invariance", [])
        result["latency"] += part.get("latency", [])
        result["cublas_workspace_invariant"].update(part.get("cublas_workspace_invariant", {}))
        for key, value in part.items():
            if key not in ("invariance", "latency", "cublas_workspace_invariant"):
                result.setdefault(name, {})[key] = value
    return result


def main(argv: list[str] | None = None) -> int:
    from benchmarks.harness import results_meta, write_results

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="benchmarks/results/batch_invariant_ops.json")
    parser.add_argument("--parts", nargs="*", default=list(PARTS), choices=list(PARTS))
    args = parser.parse_args(argv)
    command = " ".join(["python -m benchmarks.suites.batch_invariant_ops",
                        *(sys.argv[1:] if argv is None else argv)])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    result = {"meta": results_meta(command), **run(args.parts, part_dir=Path(args.out).parent)}
    write_results(args.out, result)
    print(f"errors in: {sorted(result['errors']) or 'none'}")
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())

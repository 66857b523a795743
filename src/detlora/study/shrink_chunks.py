"""run_to_run's ordered LoRA shrink: how large a K chunk to give each CTA when it runs beside
its base GEMM (the engine's side stream), measured end to end.

Alone, the shrink is fastest with many small chunks (``lora_sweep.json``); beside a cuBLAS
GEMM every extra CTA delays the GEMM. For each chunk size (rows <= 64, the decode batches;
larger batches keep their table rows) this builds a ``run_to_run`` engine on the model of
``bench_engine`` and times batch 1 and 64 like it does, with ``fast`` before and after as the
reference of the same run:

    [{"mode", "chunk", "batch", "output_tok_per_s", "tpot_ms", "prefill_tok_per_s"}]

    python -m detlora.study.shrink_chunks --out benchmarks/results/r2r_shrink_chunks.json
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path
from typing import Any

from detlora.ops import lora_configs
from detlora.study import bench_engine as be

CHUNKS = (256, 768, 1536)


def _table(chunk: int, base: tuple[tuple[int, int, int, int, int], ...]) -> tuple:
    return tuple((m, chunk if m <= 64 else c, bm, bk, w) for m, c, bm, bk, w in base)


def run(chunks: tuple[int, ...] = CHUNKS) -> list[dict[str, Any]]:
    from detlora.lora.request import LoRARequest

    plan = dataclasses.replace(be.BenchPlan(), throughput_batches=(1, 64))
    base = lora_configs._ORDERED_TABLE
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="detlora-shrink-chunks-") as tmp:
        root = Path(tmp)
        be.write_model(root / "model", plan.shape)
        be.write_adapter(root / "adapter0", plan.shape, seed=10)
        w = be._Workload(plan, [LoRARequest("a0", 1, str(root / "adapter0"))])
        runs = [("fast", None), *(("run_to_run", c) for c in chunks), ("fast", None)]
        try:
            for mode, chunk in runs:
                # Read when the decode graphs are captured, so it holds for this engine.
                lora_configs._ORDERED_TABLE = base if chunk is None else _table(chunk, base)
                llm = be._engine(root / "model", mode, plan)
                for row in be._throughput(llm, f"{mode}:{chunk}", w, print):
                    rows.append({**row, "mode": mode, "chunk": chunk})
                del llm
                be._free_gpu()
        finally:
            lora_configs._ORDERED_TABLE = base
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results/r2r_shrink_chunks.json")
    parser.add_argument("--chunks", default=",".join(map(str, CHUNKS)),
                        help="hidden elements per chunk, comma-separated (>= K: one chunk, "
                             "no split)")
    args = parser.parse_args(argv)
    from detlora.cli import results_meta, write_results

    command = " ".join(["python -m detlora.study.shrink_chunks", *(argv or sys.argv[1:])])
    try:
        chunks = tuple(int(c) for c in args.chunks.split(","))
    except ValueError:
        parser.error(f"--chunks must be comma-separated integers, got {args.chunks!r}")
    if min(chunks) < 1:
        parser.error(f"--chunks must be positive, got {args.chunks!r}")
    write_results(args.out, {"meta": results_meta(command), "rows": run(chunks)})
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""run_to_run's ordered LoRA shrink: how large a K chunk to give each CTA when it runs beside
its base GEMM (the engine's side stream), measured end to end.

Alone, the shrink is fastest with many small chunks (``lora_sweep.json``); beside a cuBLAS
GEMM every extra CTA delays the GEMM. For each chunk size (rows <= 64, the decode batches;
larger batches keep their table rows) this builds a ``run_to_run`` engine on the model of
``suites.engine`` and times batch 1 and 64 like it does, with ``fast`` before and after as the
reference of the same run:

    [{"mode", "chunk", "batch", "output_tok_per_s", "tpot_ms", "prefill_tok_per_s"}]

    python -m benchmarks.suites.shrink_chunks --out benchmarks/results/r2r_shrink_chunks.json
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from typing import Any

from benchmarks.suites.engine_variants import time_variants
from detlora.ops import lora_configs

CHUNKS = (256, 768, 1536)


def _table(chunk: int, base: tuple[tuple[int, int, int, int, int], ...]) -> tuple:
    return tuple((m, chunk if m <= 64 else c, bm, bk, w) for m, c, bm, bk, w in base)


def run(chunks: tuple[int, ...] = CHUNKS) -> list[dict[str, Any]]:
    base = lora_configs._ORDERED_TABLE

    @contextlib.contextmanager
    def table(chunk: int | None) -> Iterator[None]:
        # Read when the decode graphs are captured, so it holds for this engine.
        lora_configs._ORDERED_TABLE = base if chunk is None else _table(chunk, base)
        try:
            yield
        finally:
            lora_configs._ORDERED_TABLE = base

    runs = [("fast", None), *(("run_to_run", c) for c in chunks), ("fast", None)]
    return time_variants([(mode, c, lambda c=c: table(c)) for mode, c in runs], (1, 64),
                         "chunk")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results/r2r_shrink_chunks.json")
    parser.add_argument("--chunks", default=",".join(map(str, CHUNKS)),
                        help="hidden elements per chunk, comma-separated (>= K: one chunk, "
                             "no split)")
    args = parser.parse_args(argv)
    from benchmarks.harness import results_meta, write_results

    command = " ".join(["python -m benchmarks.suites.shrink_chunks", *(argv or sys.argv[1:])])
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

"""One-off GPU check: why the ops benchmark's "copy" reference (``suites.rowwise.time_copy``)
read 21.98 us for the bytes of rms_norm at H 3072, M 4096 (batch_invariant_ops.json) while
rms_norm_persistent.json timed torch ``copy_`` of the same bytes at 14.47 us.

Times, for those bytes (and for M 1024): the benchmark's own function; the same 1-D copy with
its tensors made directly in bf16; and the 2-D [M, H] copy of the persistent experiment; each
twice, to see run-order effects. Then a sweep of byte counts around 24 MiB, to find which
sizes take the slow path.

    PYTHONPATH=src python -m benchmarks.experiments.copy_reference OUT.json
"""

import sys

import torch

from benchmarks.harness import results_meta, write_results
from benchmarks.harness.timing import input_sets_for, time_graph_us
from benchmarks.suites.rowwise import DTYPE, time_copy

VARIANT_SHAPES = ((4096, 3072), (1024, 3072))


def _time_sets(make, bytes_moved: int) -> float:
    sets = [make() for _ in range(input_sets_for(bytes_moved))]
    return time_graph_us([(lambda s=s: s[1].copy_(s[0])) for s in sets])


def _variants(m: int, h: int) -> tuple[int, dict]:
    moved = 2 * m * h * 2 + h * 2  # rms_norm: read x, write y, read the weight
    n = moved // 4
    return moved, {
        "bench_time_copy": lambda: time_copy(moved),
        "1d_made_in_bf16": lambda: _time_sets(
            lambda: (torch.empty(n, dtype=DTYPE, device="cuda").normal_(),
                     torch.empty(n, dtype=DTYPE, device="cuda")), moved),
        "1d_from_fp32": lambda: _time_sets(
            lambda: (torch.randn(n, device="cuda").to(DTYPE),
                     torch.empty(n, dtype=DTYPE, device="cuda")), moved),
        "1d_rows_only": lambda: _time_sets(  # M x H elements, without the weight's H
            lambda: (torch.randn(m * h, device="cuda").to(DTYPE),
                     torch.empty(m * h, dtype=DTYPE, device="cuda")), moved),
        "2d_rows": lambda: _time_sets(
            lambda: (torch.randn(m, h, device="cuda").to(DTYPE),
                     torch.empty(m, h, dtype=DTYPE, device="cuda")), moved),
    }


def main(out_path: str) -> None:
    rows = []
    for m, h in VARIANT_SHAPES:
        moved, variants = _variants(m, h)
        for rep in range(2):
            for name, run in variants.items():
                us = run()
                rows.append({"M": m, "H": h, "bytes": moved, "variant": name, "rep": rep,
                             "us": round(us, 3), "TBps": round(moved / us / 1e6, 3)})
                print(rows[-1], flush=True)
                torch.cuda.empty_cache()
    # Which byte counts take the slow path: bf16 copies of 3 x 2^22 elements plus delta.
    base = 3 << 22
    for delta in (0, 64, 512, 1024, 1536, 4096, 1 << 16, 1 << 20, -1536, -(1 << 16)):
        n = base + delta
        us = _time_sets(lambda n=n: (torch.empty(n, dtype=DTYPE, device="cuda").normal_(),
                                     torch.empty(n, dtype=DTYPE, device="cuda")), 4 * n)
        rows.append({"variant": "granule", "elements": n, "delta": delta, "bytes": 4 * n,
                     "us": round(us, 3), "TBps": round(4 * n / us / 1e6, 3)})
        print(rows[-1], flush=True)
        torch.cuda.empty_cache()
    meta = results_meta("python -m benchmarks.experiments.copy_reference OUT.json")
    write_results(out_path, {"meta": meta, "rows": rows})


if __name__ == "__main__":
    main(sys.argv[1])

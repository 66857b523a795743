"""LoRA expand tiles at decode sizes: which (BLOCK_M, BLOCK_N, warps) adds the update fastest,
alone and in the engine.

The expand is 112 launches of a decode step (4 per layer) and sits on the critical path. Its
tiles never change a row's bits (BLOCK_R is fixed by the rank; tests/gpu proves rows equal at
every M), so they are free to tune.

* ``kernel``: the four projections of the Llama-3.2-3B shape (q|k|v, o, gate|up, down), rank
  16, two adapter slots, every row on slot 0, fed the way the engine feeds them (``in_gemm``:
  bf16 x A^T columns after x W^T in one output); M in ``--ms``; every tile in the grid below;
  CUDA-graph replay (``benchmarks.harness.timing``).
* ``engine``: ``fast``, then ``run_to_run`` with the default tiles and with the tiles that
  were fastest summed over the four projections at each M (rows up to 16 and up to 64 take
  their M's winner), batch 64, timed like ``suites.engine``.

    {"meta", "kernel": [{"layer", "M", "block_m", "block_n", "num_warps", "us"}],
     "best": {M: {...}}, "engine": [{"mode", "tiles", "batch", "output_tok_per_s", ...}]}

    python -m benchmarks.suites.expand_configs --out benchmarks/results/expand_configs.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

from benchmarks.suites.engine_variants import time_variants
from detlora.ops import lora_expand as expand_mod
from detlora.ops.lora_configs import ExpandConfig

# (name, slice widths, input width): the Llama-3.2-3B projections.
LAYERS = (("qkv", (3072, 1024, 1024)), ("o", (3072,)), ("gate_up", (8192, 8192)),
          ("down", (3072,)))
RANK, SLOTS = 16, 2
GRID = list(itertools.product((16, 32, 64), (32, 64, 128, 256), (2, 4)))


def _case(widths: tuple[int, ...], m: int,
          sets: int) -> Callable[[ExpandConfig], list[Callable[[], Any]]]:
    """``make(config)``: the calls of one graph, ``sets`` rotating input sets."""
    from detlora.ops.adapter_groups import group_tokens
    from detlora.ops.lora_partials import ShrinkPartials

    s, n = len(widths), sum(widths)
    offsets = [0, *itertools.accumulate(widths)]
    g = torch.Generator(device="cuda").manual_seed(m + n)
    groups = group_tokens(torch.zeros(m, dtype=torch.int32, device="cuda"), SLOTS)
    scale = torch.full((SLOTS,), 2.0, device="cuda")
    calls = []
    for _ in range(sets):
        y_cat = torch.randn(m, n + SLOTS * s * RANK, device="cuda", generator=g).bfloat16()
        b = (torch.randn(SLOTS, n, RANK, device="cuda", generator=g) / 4).bfloat16()
        h = ShrinkPartials(y_cat[:, n:].unsqueeze(0), s, RANK, 1, scale, adapter_stride=s * RANK)
        calls.append((y_cat[:, :n], h, b))

    def make(cfg: ExpandConfig) -> list[Callable[[], Any]]:
        return [lambda y=y, h=h, b=b: expand_mod.lora_expand(y, h, b, groups, offsets,
                                                             config=cfg)
                for y, h, b in calls]

    return make


def kernel_rows(ms: tuple[int, ...], log: Callable[[str], None]) -> list[dict[str, Any]]:
    from benchmarks.harness.timing import time_graph_us

    rows = []
    for m in ms:
        for name, widths in LAYERS:
            make = _case(widths, m, sets=8)
            for bm, bn, w in GRID:
                cfg = ExpandConfig(block_m=bm, block_n=bn, block_r=RANK, num_warps=w)
                us = time_graph_us(make(cfg) * 4)
                rows.append({"layer": name, "M": m, "block_m": bm, "block_n": bn,
                             "num_warps": w, "us": round(us, 3)})
            default = expand_mod.expand_config(m, RANK, max(widths))
            log(f"M {m} {name}: default ({default.block_m}, {default.block_n}, "
                f"{default.num_warps}); best {min(r['us'] for r in rows[-len(GRID):]):.2f} us")
    return rows


def best_tiles(rows: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Per M, the tile with the lowest latency summed over the four projections."""
    best: dict[int, dict[str, Any]] = {}
    for m in sorted({r["M"] for r in rows}):
        total: dict[tuple[int, int, int], float] = {}
        for r in rows:
            if r["M"] == m:
                key = (r["block_m"], r["block_n"], r["num_warps"])
                total[key] = total.get(key, 0.0) + r["us"]
        (bm, bn, w), us = min(total.items(), key=lambda kv: kv[1])
        default = [expand_mod.expand_config(m, RANK, max(ws)) for _, ws in LAYERS]
        default_us = sum(r["us"] for r in rows if r["M"] == m and any(
            (r["block_m"], r["block_n"], r["num_warps"]) == (d.block_m, d.block_n, d.num_warps)
            and r["layer"] == name for d, (name, _) in zip(default, LAYERS, strict=True)))
        best[m] = {"block_m": bm, "block_n": bn, "num_warps": w, "sum_us": round(us, 3),
                   "default_sum_us": round(default_us, 3)}
    return best


def _tuned(best: dict[int, dict[str, Any]]) -> Callable[[int, int, int], ExpandConfig]:
    original = expand_mod.expand_config
    bounds = sorted(best)

    def config(num_rows: int, rank: int, max_width: int) -> ExpandConfig:
        base = original(num_rows, rank, max_width)
        m = next((b for b in bounds if num_rows <= b), None)
        if m is None:
            return base
        t = best[m]
        return dataclasses.replace(base, block_m=t["block_m"], block_n=t["block_n"],
                                   num_warps=t["num_warps"])

    return config


def engine_rows(best: dict[int, dict[str, Any]],
                log: Callable[[str], None]) -> list[dict[str, Any]]:
    original = expand_mod.expand_config

    @contextlib.contextmanager
    def tiles(kind: str) -> Iterator[None]:
        # Read when the decode graphs are captured, so it holds for this engine.
        expand_mod.expand_config = original if kind == "default" else _tuned(best)
        try:
            yield
        finally:
            expand_mod.expand_config = original

    runs = [("fast", "default"), ("run_to_run", "default"), ("run_to_run", "tuned"),
            ("fast", "tuned")]
    return time_variants([(mode, k, lambda k=k: tiles(k)) for mode, k in runs], (64,),
                         "tiles", log)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results/expand_configs.json")
    parser.add_argument("--ms", default="16,64", help="rows per call, comma-separated")
    parser.add_argument("--no-engine", action="store_true", help="the kernel sweep only")
    args = parser.parse_args(argv)
    from benchmarks.harness import results_meta, write_results

    try:
        ms = tuple(int(m) for m in args.ms.split(","))
    except ValueError:
        parser.error(f"--ms must be comma-separated integers, got {args.ms!r}")
    if not ms or min(ms) < 1:
        parser.error(f"--ms must be positive, got {args.ms!r}")
    command = " ".join(["python -m benchmarks.suites.expand_configs", *(argv or sys.argv[1:])])
    kernel = kernel_rows(ms, print)
    best = best_tiles(kernel)
    print(f"best: {best}")
    body: dict[str, Any] = {"meta": results_meta(command), "kernel": kernel, "best": best}
    if not args.no_engine:
        body["engine"] = engine_rows(best, print)
    write_results(args.out, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())

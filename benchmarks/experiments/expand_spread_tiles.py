"""Which expand tiles serve a decode batch spread over many adapters?

At batch 64 on the Llama-3.2-3B shape, spreading the rows over 32 adapters instead of one took
the decode step from 3.24 to 4.55 ms (``gpu.sh profile-adapters``); the expands grew most
(gate|up with silu_and_mul 138 -> 820 us a step, the plain expand 165 -> 393), about an eighth
of HBM bandwidth: every (group, column tile) program reads a rank x 64 slice of B for two rows.
This times the decode expands (``expand_group_cap``'s Llama-3.1-8B layers, rank 16, M = 64,
rows spread over 1, 8 and 32 slots) with the tiles ``expand_config`` picked before (32 x 64),
its tiles now (16 x 128, ``{}``) and others, and checks each variant's outputs against the
first's bit for bit (the tile sizes never enter a row's sums: the rank is one dot).

``--rows 64,96,128`` times other batch sizes too: above 64 rows ``expand_config`` takes
64-row tiles, so a step of ~90 rows spread over 32 adapters (the traffic suite's working set
at max_loras 32) fills 3 rows of each group's tile; the 16-row variants say what smaller
tiles would give there, and what they cost one adapter.

    PYTHONPATH=src python -m benchmarks.experiments.expand_spread_tiles OUT.json [--rows 64]
"""

from __future__ import annotations

import dataclasses
import itertools
import sys

import torch

from benchmarks.experiments.expand_group_cap import OPS, make_layers
from benchmarks.harness import results_meta, write_results
from benchmarks.harness.timing import time_graph_us
from detlora.ops.adapter_groups import group_tokens, row_tile_table
from detlora.ops.lora_configs import expand_config
from detlora.ops.lora_expand import lora_expand
from detlora.ops.lora_expand_silu_and_mul import lora_expand_silu_and_mul

R = 16
VARIANTS = [dict(block_m=32, block_n=64), dict(), dict(block_n=256), dict(block_m=32),
            dict(group_cap=32), dict(block_n=256, num_warps=8), dict(block_m=16, block_n=128),
            dict(block_m=16, block_n=128, group_cap=32)]


def config(m: int, offsets: list[int], **change):
    width = max(b - a for a, b in itertools.pairwise(offsets))
    return dataclasses.replace(expand_config(m, R, width), **change)


def measure(slots: int, m: int) -> list[dict]:
    ids = torch.arange(m, dtype=torch.int32) % slots
    groups = group_tokens(ids.cuda(), slots)
    ops = {op: make_layers(m, slots, OPS[op], seed=slots * 7 + k)
           for k, op in enumerate(("o", "gate_up"))}

    def groups_for(change):  # the row tiles built beforehand, as the engine stages them
        bm = config(m, OPS["o"], **change).block_m
        if bm == groups.row_block:
            return groups
        return dataclasses.replace(groups, row_block=bm,
                                   row_tiles=row_tile_table(groups.group_size, m, bm))

    def plain(layer, change):
        g = groups_for(change)
        return lambda: lora_expand(layer.y, layer.h, layer.b, g, OPS["o"],
                                   config=config(m, OPS["o"], **change))

    def silu(layer, change):
        cfg, g = config(m, OPS["gate_up"], **change), groups_for(change)
        return lambda: lora_expand_silu_and_mul(layer.y, layer.h, layer.b, g, config=cfg)

    def outputs(change):
        o, gu = ops["o"][0], ops["gate_up"][0]
        y = o.y.clone()
        lora_expand(y, o.h, o.b, groups_for(change), OPS["o"],
                    config=config(m, OPS["o"], **change))
        return [silu(gu, change)(), y]

    # Every variant's outputs before any timing: the timed calls add into the layers' y.
    got = [outputs(change) for change in VARIANTS]
    rows = []
    for change, out in zip(VARIANTS, got, strict=True):
        same = all(torch.equal(a, b) for a, b in zip(out, got[0], strict=True))
        row = {"M": m, "max_loras": slots, "spread": slots, "config": change or "default",
               "bits_equal": same,
               "o_us": round(time_graph_us([plain(x, change) for x in ops["o"]]), 2),
               "gate_up_silu_us": round(time_graph_us([silu(x, change)
                                                       for x in ops["gate_up"]]), 2)}
        rows.append(row)
        print(row, flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    batches = [64]
    if "--rows" in argv:
        batches = [int(x) for x in argv[argv.index("--rows") + 1].split(",")]
    rows = []
    for m, slots in itertools.product(batches, (1, 8, 32)):
        rows += measure(slots, m)
        torch.cuda.empty_cache()
    write_results(argv[0], {"meta": results_meta(
        "python -m benchmarks.experiments.expand_spread_tiles " + " ".join(argv[1:])),
        "rows": rows})


if __name__ == "__main__":
    main()

"""Does the LoRA expand's row-tile launch (``ExpandConfig.group_cap``) remove the decode cost of
unused adapter slots, and what does its cap cost when every row has its own adapter?

The expands launch one program per row tile the batch can have: ceil(M / BLOCK_M) tiles plus
one per adapter group that could have rows, min(M, max_loras + 1) - 1; programs past the
batch's real row tiles exit at once but are launched. With a cap, at most ceil(M / BLOCK_M) +
cap programs loop over the tiles, so the launch stops growing with the slots. (Before the
row-tile axis, the grid was m tiles x groups: with one adapter at M = 64, 4 x 64 programs
per column tile at 64 slots against 4 x 2 at one.)

Llama-3.1-8B shapes (32 layers; q|k|v 4096|1024|1024, o 4096, gate|up 2 x 14336, down 4096),
rank 16, bf16, in_gemm partials (the batch_invariant engine's expand input: x A^T of every
slot after the base columns), each layer its own B and y, as in a decode step. For M = 1 and
64, max_loras 1, 8, 32, 64, rows on one adapter ("one") or spread over every slot, row i on
slot i % max_loras ("spread"), cap None (every row tile its program) against 4, 8, 16, 32:

* ``step``: one graph of the 32 layers' four expands (q|k|v, o, gate|up, down: the plain
  ``lora_expand``, as the engine launches them), microseconds per step;
* per op: 32 back-to-back calls, one per layer, microseconds per call; also the fused
  ``lora_expand_silu_and_mul`` (gate|up) and ``lora_expand_rotary_write_kv`` (q|k|v);
* ``ctas``: programs launched (per step, or per call).

Bits: each variant's outputs are compared with cap None (``bits_equal``; the tests prove it
in the interpreter, this checks it on the GPU at the real shapes).

    PYTHONPATH=src python -m benchmarks.experiments.expand_group_cap OUT.json [--quick]
"""

from __future__ import annotations

import dataclasses
import itertools
import sys

import torch

from benchmarks.harness import results_meta, write_results
from benchmarks.harness.timing import time_graph_us
from detlora.ops._runtime import cdiv
from detlora.ops.adapter_groups import group_tokens, row_tile_programs
from detlora.ops.lora_configs import expand_config
from detlora.ops.lora_expand import lora_expand
from detlora.ops.lora_expand_rotary_write_kv import lora_expand_rotary_write_kv
from detlora.ops.lora_expand_silu_and_mul import lora_expand_silu_and_mul
from detlora.ops.lora_partials import ShrinkPartials
from detlora.ops.rotary import rope_cos_sin_cache

DEV, R, LAYERS, HQ, HK, D, PAGE = "cuda", 16, 32, 32, 8, 128, 16
HIDDEN, INTER = 4096, 14336
QKV = [0, HQ * D, (HQ + HK) * D, (HQ + 2 * HK) * D]
# op -> column offsets of its slices
OPS = {"qkv": QKV, "o": [0, HIDDEN], "gate_up": [0, INTER, 2 * INTER], "down": [0, HIDDEN]}
CAPS = (None, 4, 8, 16, 32)
ROWS = (1, 64)
MAX_LORAS = (1, 8, 32, 64)


@dataclasses.dataclass
class Layer:
    """One layer's expand operands for one op: y (a view of y_cat), partials, B."""

    y: torch.Tensor
    h: ShrinkPartials
    b: torch.Tensor


def make_layers(m: int, slots: int, offsets: list[int], seed: int) -> list[Layer]:
    n, s = offsets[-1], len(offsets) - 1
    g = torch.Generator(device=DEV).manual_seed(seed)
    scale = torch.full((slots,), 2.0, device=DEV)
    layers = []
    for _ in range(LAYERS):
        y_cat = torch.randn(m, n + slots * s * R, device=DEV, generator=g).to(torch.bfloat16)
        b = (torch.randn(slots, n, R, device=DEV, generator=g) / 16).to(torch.bfloat16)
        h = ShrinkPartials(y_cat[:, n:].unsqueeze(0), s, R, tail_group=1, scale=scale,
                           adapter_stride=s * R)
        layers.append(Layer(y_cat[:, :n], h, b))
    return layers


def config(m: int, offsets: list[int], cap: int | None):
    width = max(b - a for a, b in itertools.pairwise(offsets))
    return dataclasses.replace(expand_config(m, R, width), group_cap=cap)


def row_programs(m: int, offsets: list[int], num_groups: int, cap: int | None) -> int:
    return row_tile_programs(m, config(m, offsets, cap).block_m, num_groups, cap)[0]


def expand_ctas(m: int, offsets: list[int], num_groups: int, cap: int | None) -> int:
    cfg = config(m, offsets, cap)
    width = max(b - a for a, b in itertools.pairwise(offsets))
    return (cdiv(width, cfg.block_n) * (len(offsets) - 1)
            * row_programs(m, offsets, num_groups, cap))


def measure(m: int, slots: int, spread: bool) -> list[dict]:
    ids = (torch.arange(m, dtype=torch.int32) % slots) if spread \
        else torch.zeros(m, dtype=torch.int32)
    groups = group_tokens(ids.to(DEV), slots)
    ops = {op: make_layers(m, slots, offsets, seed=m * 131 + slots * 7 + k)
           for k, (op, offsets) in enumerate(OPS.items())}
    cos_sin = rope_cos_sin_cache(D, 8192, 500000.0).to(DEV)
    g = torch.Generator(device=DEV).manual_seed(m)
    pos = torch.randint(0, 8192, (m,), device=DEV, generator=g)
    pages = m // PAGE + 1
    slot_map = torch.randperm(pages * PAGE, device=DEV, generator=g)[:m]
    caches = [(torch.zeros(pages, PAGE, HK, D, device=DEV, dtype=torch.bfloat16),
               torch.zeros(pages, PAGE, HK, D, device=DEV, dtype=torch.bfloat16))
              for _ in range(LAYERS)]
    key = {"M": m, "max_loras": slots, "adapters": "spread" if spread else "one",
           "groups_with_rows": int((groups.group_size > 0).sum()),
           "num_groups": groups.num_groups}

    def plain(op, layer, cap):
        return lambda: lora_expand(layer.y, layer.h, layer.b, groups, OPS[op],
                                   config=config(m, OPS[op], cap))

    def silu(layer, cap):
        cfg = config(m, OPS["gate_up"], cap)
        return lambda: lora_expand_silu_and_mul(layer.y, layer.h, layer.b, groups, config=cfg)

    def rotary(layer, cache, cap):
        cfg = config(m, QKV, cap)
        return lambda: lora_expand_rotary_write_kv(layer.y, layer.h, layer.b, groups, QKV, pos,
                                                   cos_sin, *cache, slot_map, config=cfg,
                                                   validate=False)

    def outputs(cap):  # the first layer's outputs (q, caches and the plain expand on copies)
        lay, qkv = ops["gate_up"][0], ops["qkv"][0]
        kc, vc = caches[0][0].clone(), caches[0][1].clone()
        q = rotary(qkv, (kc, vc), cap)()
        return [silu(lay, cap)(), q, kc, vc,
                lora_expand(lay.y.clone(), lay.h, lay.b, groups, OPS["gate_up"],
                            config=config(m, OPS["gate_up"], cap))]

    ref = outputs(None)
    bits = {cap: all(torch.equal(a, b) for a, b in zip(outputs(cap), ref, strict=True))
            for cap in CAPS}
    rows = []
    for cap in CAPS:
        step_calls = [plain(op, ops[op][i], cap) for i in range(LAYERS) for op in OPS]
        step_us = time_graph_us(step_calls) * len(step_calls)
        rows.append({**key, "cap": cap, "op": "step", "us": round(step_us, 1),
                     "ctas": LAYERS * sum(expand_ctas(m, OPS[op], groups.num_groups, cap)
                                          for op in OPS),
                     "bits_equal": bits[cap]})
        for op in OPS:
            us = time_graph_us([plain(op, layer, cap) for layer in ops[op]])
            rows.append({**key, "cap": cap, "op": op, "us": round(us, 2),
                         "ctas": expand_ctas(m, OPS[op], groups.num_groups, cap)})
        us = time_graph_us([silu(layer, cap) for layer in ops["gate_up"]])
        cfg = config(m, OPS["gate_up"], cap)
        rows.append({**key, "cap": cap, "op": "gate_up+silu_and_mul (fused)", "us": round(us, 2),
                     "ctas": cdiv(INTER, cfg.block_n)
                     * row_programs(m, OPS["gate_up"], groups.num_groups, cap)})
        us = time_graph_us([rotary(layer, cache, cap)
                            for layer, cache in zip(ops["qkv"], caches, strict=True)])
        rows.append({**key, "cap": cap, "op": "qkv+rotary_write_kv (fused)", "us": round(us, 2),
                     "ctas": (HQ + 2 * HK) * row_programs(m, QKV, groups.num_groups, cap)})
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Per (M, adapters, cap): the step's expand time at each max_loras, its growth from the
    fewest slots to the most, and its change against cap None at the same slots."""
    step = {(r["M"], r["adapters"], r["max_loras"], r["cap"]): r["us"]
            for r in rows if r["op"] == "step"}
    out = []
    for m, adapters, cap in sorted({(k[0], k[1], k[3]) for k in step},
                                   key=lambda k: (k[0], k[1], k[2] or 0)):
        us = dict(sorted((k[2], v) for k, v in step.items()
                         if k[:2] == (m, adapters) and k[3] == cap))
        lo, hi = min(us), max(us)
        out.append({"M": m, "adapters": adapters, "cap": cap, "step_us": us,
                    "growth_us": round(us[hi] - us[lo], 1),
                    "vs_uncapped_us": {s: round(us[s] - step[(m, adapters, s, None)], 1)
                                       for s in us}})
    return out


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    out_path, quick = argv[0], "--quick" in argv[1:]
    rows = []
    for m, slots in itertools.product(ROWS, (1, 32) if quick else MAX_LORAS):
        for spread in (False, True):
            if spread and (m == 1 or slots == 1):
                continue  # the same rows as "one"
            part = measure(m, slots, spread)
            torch.cuda.empty_cache()  # the layers' operands: up to ~3 GB
            for r in part:
                if r["op"] == "step":
                    print({k: r[k] for k in ("M", "max_loras", "adapters", "cap", "us", "ctas",
                                             "bits_equal")}, flush=True)
            rows += part
    summary = summarize(rows)
    for s in summary:
        print(s, flush=True)
    meta = results_meta("python -m benchmarks.experiments.expand_group_cap")
    write_results(out_path, {"meta": meta, "summary": summary, "rows": rows})


if __name__ == "__main__":
    main()

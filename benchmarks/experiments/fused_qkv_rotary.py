"""Timing of attention's input ops, Llama-3.2-3B shapes (24 q / 8 kv heads of 128), in_gemm
partials of rank 16, one adapter on every row, bf16, pages of 16 in shuffled order: the q|k|v
expand + rotary + write_kv (three launches) against expand + rotary_write_kv (two) and
lora_expand_rotary_write_kv (one). Each graph holds 30 back-to-back calls, so a decode-size
figure includes the gaps between launches, as in the engine's decode graph (median per call).

    PYTHONPATH=src python -m benchmarks.experiments.fused_qkv_rotary OUT.json
"""

import itertools
import sys

import torch

from benchmarks.harness import results_meta, write_results
from benchmarks.harness.timing import time_graph_us
from detlora.ops.adapter_groups import group_tokens
from detlora.ops.lora_expand import lora_expand
from detlora.ops.lora_expand_rotary_write_kv import lora_expand_rotary_write_kv
from detlora.ops.lora_partials import ShrinkPartials
from detlora.ops.paged_attention import write_kv
from detlora.ops.rotary import rope_cos_sin_cache, rotary
from detlora.ops.rotary_write_kv import rotary_write_kv

DEV, R, SLOTS, HQ, HK, D, PAGE, CALLS = "cuda", 16, 4, 24, 8, 128, 16, 30
OFFSETS = [0, HQ * D, (HQ + HK) * D, (HQ + 2 * HK) * D]


def measure(m: int) -> dict:
    n = OFFSETS[-1]
    g = torch.Generator(device=DEV).manual_seed(m)
    y_cat = torch.randn(m, n + SLOTS * 3 * R, device=DEV, generator=g).to(torch.bfloat16)
    y = y_cat[:, :n]
    b = (torch.randn(SLOTS, n, R, device=DEV, generator=g) / 4).to(torch.bfloat16)
    h = ShrinkPartials(y_cat[:, n:].unsqueeze(0), 3, R, tail_group=1,
                       scale=torch.ones(SLOTS, device=DEV), adapter_stride=3 * R)
    groups = group_tokens(torch.zeros(m, dtype=torch.int32, device=DEV), SLOTS)
    cos_sin = rope_cos_sin_cache(D, 8192, 500000.0).to(DEV)
    pos = torch.randint(0, 8192, (m,), device=DEV, generator=g)
    pages = m // PAGE + 1
    slots = torch.randperm(pages * PAGE, device=DEV, generator=g)[:m]
    kc = torch.zeros(pages, PAGE, HK, D, device=DEV, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)

    def views(t):
        return (t[:, lo:hi].view(m, -1, D) for lo, hi in itertools.pairwise(OFFSETS))

    def three():
        q, k, v = views(lora_expand(y, h, b, groups, OFFSETS))
        q, k = rotary(q, k, pos, cos_sin, validate=False)
        write_kv(k, v, kc, vc, slots)

    def two():
        q, k, v = views(lora_expand(y, h, b, groups, OFFSETS))
        rotary_write_kv(q, k, v, pos, cos_sin, kc, vc, slots, validate=False)

    def one():
        lora_expand_rotary_write_kv(y, h, b, groups, OFFSETS, pos, cos_sin, kc, vc, slots,
                                    validate=False)

    return {"M": m, **{name: round(time_graph_us([fn] * CALLS), 2)
                       for name, fn in (("expand+rotary+write_kv", three),
                                        ("expand+rotary_write_kv", two),
                                        ("lora_expand_rotary_write_kv", one))}}


def main(out_path: str) -> None:
    rows = []
    for m in (1, 16, 64, 256, 6400):
        rows.append(measure(m))
        print(rows[-1], flush=True)
    meta = results_meta("python -m benchmarks.experiments.fused_qkv_rotary")
    write_results(out_path, {"meta": meta, "rows": rows})


if __name__ == "__main__":
    main(sys.argv[1])

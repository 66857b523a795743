"""Decode-size timing of the fused LoRA expand ops against the unfused pair (graph replay,
median): o/down's expand + fused_add_rms_norm vs lora_expand_add_rms_norm (H 3072), and
gate|up's expand + silu_and_mul vs lora_expand_silu_and_mul (I 8192). in_gemm input, rank 16,
one adapter on every row, bf16.

    PYTHONPATH=src python -m benchmarks.experiments.fused_lora_norm OUT.json
"""

import sys

import torch

from benchmarks.harness import results_meta, write_results
from benchmarks.harness.timing import time_graph_us
from detlora.ops.adapter_groups import group_tokens
from detlora.ops.lora_expand import lora_expand
from detlora.ops.lora_expand_add_rms_norm import lora_expand_add_rms_norm
from detlora.ops.lora_expand_silu_and_mul import lora_expand_silu_and_mul
from detlora.ops.lora_partials import ShrinkPartials
from detlora.ops.rms_norm import fused_add_rms_norm
from detlora.ops.silu_and_mul import silu_and_mul

DEV, R, SLOTS = "cuda", 16, 4


def case(m, n, slices):
    g = torch.Generator(device=DEV).manual_seed(m + n)
    y_cat = torch.randn(m, n + SLOTS * slices * R, device=DEV, generator=g).to(torch.bfloat16)
    b = (torch.randn(SLOTS, n, R, device=DEV, generator=g) / 4).to(torch.bfloat16)
    scale = torch.ones(SLOTS, device=DEV)
    h = ShrinkPartials(y_cat[:, n:].unsqueeze(0), slices, R, tail_group=1, scale=scale,
                       adapter_stride=slices * R)
    groups = group_tokens(torch.zeros(m, dtype=torch.int32, device=DEV), SLOTS)
    return y_cat[:, :n], h, b, groups


def measure(m: int) -> list[dict]:
    x, h, b, groups = case(m, 3072, 1)
    res = torch.randn(m, 3072, device=DEV).to(torch.bfloat16)
    w = torch.ones(3072, device=DEV, dtype=torch.bfloat16)
    norm = {"unfused": time_graph_us([lambda: fused_add_rms_norm(
                lora_expand(x, h, b, groups), res, w, 1e-5)]),
            "fused": time_graph_us([lambda: lora_expand_add_rms_norm(x, res, w, 1e-5, h, b,
                                                                     groups)])}
    y, h2, b2, groups2 = case(m, 16384, 2)
    silu = {"unfused": time_graph_us([lambda: silu_and_mul(lora_expand(y, h2, b2, groups2))]),
            "fused": time_graph_us([lambda: lora_expand_silu_and_mul(y, h2, b2, groups2)])}
    return [{"op": "expand+add_rms_norm", "M": m, "H": 3072, **norm},
            {"op": "expand+silu_and_mul", "M": m, "I": 8192, **silu}]


def main(out_path: str) -> None:
    rows = []
    for m in (1, 16, 64, 256, 6400):
        rows += measure(m)
        print(rows[-2], rows[-1], flush=True)
    meta = results_meta("python -m benchmarks.experiments.fused_lora_norm")
    write_results(out_path, {"meta": meta, "rows": rows})


if __name__ == "__main__":
    main(sys.argv[1])

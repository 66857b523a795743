"""When should the batch-invariant decode attention split the KV axis over CTAs, now that the
unsplit kernel runs one flattened block loop per CTA? Decode latency with the default grid
(split when query tiles x KV heads are few) against one CTA per tile (no split), Llama-3.2-3B
heads; plus the bandwidth ceiling of the rms_norm benchmark's largest point: a plain Triton
row copy and torch's copy_ of the same bytes (H 3072, M 4096, bf16), CUDA-graph replays.

    PYTHONPATH=src python benchmarks/experiments/attention_split_threshold.py OUT.json
"""

import json
import sys

import torch
import triton
import triton.language as tl

from benchmarks.harness import results_meta
from benchmarks.harness.timing import input_sets_for, time_graph_us
from detlora.ops import paged_attention as pa
from detlora.study import bench_attention as ba

hq, hk, d = ba.MODELS["llama3b"]
device = torch.device("cuda")
rows = []
saved = pa._SPLIT_BELOW  # (at c136a5f the split test read _TARGET_CTAS)
for b in (4, 8, 16, 32):
    for ctx in (1024, 8192, 32768):
        for grid, target in (("default", saved), ("unsplit", 0)):
            pa._SPLIT_BELOW = target
            try:
                calls = ba._decode_calls("detlora", b, ctx, hq, hk, d, device)
                us = time_graph_us(calls, replays=10)
            finally:
                pa._SPLIT_BELOW = saved
            del calls
            torch.cuda.empty_cache()
            rows.append({"part": "attention", "b": b, "ctx": ctx, "grid": grid,
                         "us": round(us, 2)})
            print(rows[-1], flush=True)


@triton.jit
def _copy_rows(x_ptr, y_ptr, H: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    o = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * H + o, mask=o < H, eviction_policy="evict_first")
    tl.store(y_ptr + row * H + o, x, mask=o < H, eviction_policy="evict_first")


m, h = 4096, 3072
moved = 2 * m * h * 2
sets = [(torch.randn(m, h, device=device).bfloat16(), torch.empty(m, h, device=device,
         dtype=torch.bfloat16)) for _ in range(input_sets_for(moved))]
for warps in (4, 8):
    us = time_graph_us([lambda s=s, w=warps: _copy_rows[(m,)](s[0], s[1], H=h, BLOCK=4096,
                                                              num_warps=w) for s in sets])
    rows.append({"part": "copy_ceiling", "impl": f"triton_rows_{warps}w", "H": h, "M": m,
                 "us": round(us, 3), "floor_us": round(moved / 4.3e12 * 1e6, 3)})
    print(rows[-1], flush=True)
us = time_graph_us([lambda s=s: s[1].copy_(s[0]) for s in sets])
rows.append({"part": "copy_ceiling", "impl": "torch_copy_", "H": h, "M": m, "us": round(us, 3),
             "floor_us": round(moved / 4.3e12 * 1e6, 3)})
print(rows[-1], flush=True)
meta = results_meta("python benchmarks/experiments/attention_split_threshold.py")
with open(sys.argv[1], "w") as f:
    json.dump({"meta": meta, "rows": rows}, f, indent=1)

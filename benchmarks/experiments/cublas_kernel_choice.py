"""Which kernels cuBLAS runs at the mid-M points where the batch-invariant matmul misses 0.9x
(batch_invariant_ops.json), and whether its choice changes with M.

For each layer shape and M, ``torch.mm(x, w.t())`` (suites.matmul's cuBLAS call) runs under
torch.profiler; every CUDA kernel of one call is recorded with its grid and block. A choice
that splits K (a reduce kernel, or split-K in the name), or whose K split changes with M, sums
a row's products in an order that depends on M: what the batch-invariant kernel may not do.
The detlora kernel's launch (grid) is recorded beside. Rows at M = 1 (decode) and 4096 (where
we match cuBLAS) are there for contrast.

    PYTHONPATH=src python -m benchmarks.experiments.cublas_kernel_choice OUT.json

Outcome at 2a58952 (benchmarks/results/cublas_kernel_choice.json): at every point cuBLAS runs
one nvjet kernel (no reduce kernel, no split-K) on 128-132 CTAs. Its tile's column side is
often not a power of two (in the name, N x M of the output tile: 80x128 for llama q|k|v at
M = 256, 96x64 for llama o and down at 256, 96x128 for qwen gate|up at 256, 192x128 and
320x128 at 1024), which Triton blocks cannot be; we run 80-128 CTAs of 128x128 or 64x128
there. The gap is the tile and its pipeline, not a reduction order invariance forbids.
"""

import json
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.harness import results_meta, write_results
from benchmarks.suites.matmul import LAYERS
from detlora.ops.matmul import linear

POINTS = {
    "llama_qkv": (1, 256, 1024, 4096), "llama_o": (256, 1024), "llama_down": (256, 1024),
    "llama_gate_up": (256,), "qwen_gate_up": (256, 1024), "qwen_lm_head": (256,),
    "qwen_down": (1024,), "qwen_o": (1024,),
}


def kernels_of(fn) -> list[dict]:
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    prof.export_chrome_trace("/tmp/_cublas_trace.json")
    with open("/tmp/_cublas_trace.json") as f:
        trace = json.load(f)["traceEvents"]
    rows = []
    for e in trace:
        if e.get("cat") != "kernel":
            continue
        args = e.get("args", {})
        rows.append({"kernel": e["name"], "us": e.get("dur"), "grid": args.get("grid"),
                     "block": args.get("block"), "regs": args.get("registers per thread"),
                     "smem": args.get("shared memory")})
    return rows


def main(out_path: str) -> None:
    torch.manual_seed(0)
    rows = []
    for layer, ms in POINTS.items():
        n, k = LAYERS[layer]
        w = (torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16)
        for m in ms:
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            calls = {"cublas": lambda x=x, w=w, out=out: torch.mm(x, w.t(), out=out),
                     "detlora": lambda x=x, w=w: linear(x, w)}
            for impl, fn in calls.items():
                ks = kernels_of(fn)
                rows.append({"layer": layer, "N": n, "K": k, "M": m, "impl": impl,
                             "kernels": ks})
                print(layer, m, impl, [(r["kernel"][:90], r["grid"], r["us"]) for r in ks],
                      flush=True)
    meta = results_meta("python -m benchmarks.experiments.cublas_kernel_choice OUT.json")
    write_results(out_path, {"meta": meta, "rows": rows})


if __name__ == "__main__":
    main(sys.argv[1])

"""Which kernels cuBLAS runs at the mid-M points where the batch-invariant matmul misses 0.9x
(batch_invariant_ops.json), and whether its choice changes with M.

For each layer shape and M, ``torch.mm(x, w.t())`` (bench_matmul's cuBLAS call) runs under
torch.profiler; every CUDA kernel of one call is recorded with its grid and block. cuBLAS
names encode the tile (``tilesize128x128x64``), the cluster, and reductions across CTAs
(``splitK``, ``stream_k``, a separate reduce kernel). A choice that splits K, or whose tile or
K split changes with M, sums a row's products in an order that depends on M: exactly what
the batch-invariant kernel may not do. The detlora kernel's launch (grid) is recorded beside.
Rows at M = 1 (decode) and 4096 (where we match cuBLAS) are there for contrast.

    PYTHONPATH=src python benchmarks/experiments/cublas_kernel_choice.py OUT.json
"""

import json
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from detlora.cli import results_meta
from detlora.ops.matmul import linear
from detlora.study.bench_matmul import LAYERS

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
    meta = results_meta("python benchmarks/experiments/cublas_kernel_choice.py OUT.json")
    with open(out_path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])

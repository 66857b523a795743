"""cuBLAS decode GEMMs of the benchmark model in other layouts and libraries: the engine's
``F.linear(x, W)`` (W [N, K], "TN") against ``x @ W_kn`` with the weight stored [K, N]
("NN"), each through cuBLASLt and cuBLAS (torch.backends.cuda.preferred_blas_library).
Llama-3.2-3B layers with the in_gemm LoRA columns (rank 16: +48 for q|k|v, +16 for o and
down, +32 for gate|up), bf16, M in 1, 16, 64, 256; 30 back-to-back calls per CUDA graph,
median per call. Reports each case's effective weight bandwidth.

    PYTHONPATH=src python -m benchmarks.experiments.vendor_gemm_layouts OUT.json
"""

import sys

import torch
import torch.nn.functional as F

from benchmarks.harness import results_meta, write_results
from benchmarks.harness.timing import time_graph_us

DEV, CALLS = "cuda", 30
SHAPES = {"qkv": (5120 + 48, 3072), "o": (3072 + 16, 3072), "gate_up": (16384 + 32, 3072),
          "down": (3072 + 16, 8192), "lm_head": (128256, 3072)}


def measure() -> list[dict]:
    rows = []
    for lib in ("cublaslt", "cublas"):
        torch.backends.cuda.preferred_blas_library(lib)
        for name, (n, k) in SHAPES.items():
            w = (torch.randn(n, k, device=DEV) / k**0.5).to(torch.bfloat16)
            w_kn = w.t().contiguous()
            for m in (1, 16, 64, 256):
                x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
                for layout, fn in (("TN F.linear(x, W)", lambda x=x, w=w: F.linear(x, w)),
                                   ("NN x @ W_kn", lambda x=x, w_kn=w_kn: x @ w_kn)):
                    us = time_graph_us([fn] * CALLS)
                    rows.append({"lib": lib, "layer": name, "N": n, "K": k, "M": m,
                                 "layout": layout, "us": round(us, 2),
                                 "TBps": round(n * k * 2 / us / 1e6, 2)})
                    print(rows[-1], flush=True)
    torch.backends.cuda.preferred_blas_library("default")
    return rows


def main(out_path: str) -> None:
    rows = measure()
    meta = results_meta("python -m benchmarks.experiments.vendor_gemm_layouts")
    write_results(out_path, {"meta": meta, "rows": rows})


if __name__ == "__main__":
    main(sys.argv[1])

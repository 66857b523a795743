"""How fast SMs can read from L2 (and from HBM), to explain the batch-invariant matmul at a few
hundred rows, where every tiling that keeps K in one chunk re-reads operands from L2.

A Triton kernel with one CTA per SM (or two) streams a buffer ``passes`` times with 16-byte
loads and keeps a checksum, so nothing is optimised away. A buffer that fits in L2 (50 MB on
the H200, two halves) is served from L2 after the first pass; a 2 GB one from HBM. Timed with
CUDA-graph replays, median.

Then, for the Llama-3.2-3B layers at M = 256 (and 1024), the L2 traffic that the default
tiling must move: every output tile reads its A rows and B columns over the whole K, i.e.
tiles x (BLOCK_M + BLOCK_N + BLOCK_N2) x K x 2 bytes, over the latency measured in
batch_invariant_ops.json; and what cuBLAS's time would imply for the same traffic.

    PYTHONPATH=src python -m benchmarks.experiments.l2_read_bandwidth OUT.json
"""

import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton import cdiv

from benchmarks.harness import results_meta, write_results
from benchmarks.harness.timing import time_graph_us
from benchmarks.suites.matmul import LAYERS
from detlora.ops.matmul import matmul_config


@triton.jit
def _stream_kernel(x_ptr, out_ptr, n_chunks, passes, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    offs = tl.arange(0, BLOCK)
    for _ in range(passes):
        for c in range(pid, n_chunks, programs):
            acc ^= tl.load(x_ptr + c * BLOCK + offs)  # < 2**31 words
    tl.store(out_ptr + pid * BLOCK + offs, acc)


def read_tbps(mbytes: int, passes: int, ctas_per_sm: int, block: int = 4096) -> float:
    """TB/s of reading an ``mbytes`` MB buffer ``passes`` times (int32 words)."""
    words = mbytes * (1 << 20) // 4 // block * block
    x = torch.randint(0, 1 << 30, (words,), device="cuda", dtype=torch.int32)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    grid = sms * ctas_per_sm
    out = torch.empty(grid * block, device="cuda", dtype=torch.int32)
    n_chunks = words // block
    us = time_graph_us([lambda: _stream_kernel[(grid,)](x, out, n_chunks, passes, BLOCK=block,
                                                        num_warps=8)])
    return words * 4 * passes / (us * 1e-6) / 1e12


def _traffic(name: str, m: int) -> float:
    """Bytes the default tiling reads from L2 (or HBM) for an M-row call on this layer."""
    n, k = LAYERS[name]
    cfg = matmul_config(m, n, k)
    width = cfg.block_n + cfg.block_n2
    tiles = cdiv(m, cfg.block_m) * cdiv(n, width)
    return tiles * (cfg.block_m + width) * k * 2


def main(out_path: str) -> None:
    rows = []
    for mbytes, passes in ((16, 40), (32, 20), (2048, 1)):
        for per_sm in (1, 2):
            tbps = read_tbps(mbytes, passes, per_sm)
            rows.append({"buffer_MB": mbytes, "passes": passes, "ctas_per_sm": per_sm,
                         "read_TBps": round(tbps, 2)})
            print(rows[-1], flush=True)
    lat = {}
    ops = Path(__file__).resolve().parents[1] / "results" / "batch_invariant_ops.json"
    for r in json.loads(ops.read_text())["latency"]:
        if r["op"] == "linear":
            lat[(r["shape"].split(":")[0], r["M"], r["impl"])] = r["us"]
    traffic = []
    for name in ("llama_qkv", "llama_o", "llama_gate_up", "llama_down"):
        for m in (256, 1024):
            cfg = matmul_config(m, *LAYERS[name])
            byts = _traffic(name, m)
            det, cub = lat[(name, m, "detlora")], lat[(name, m, "cublas")]
            traffic.append({"layer": name, "M": m,
                            "tile": f"{cfg.block_m}x{cfg.block_n}+{cfg.block_n2}",
                            "persistent": not cfg.split_ctas, "l2_read_MB": round(byts / 1e6, 1),
                            "detlora_us": det, "implied_TBps": round(byts / det / 1e6, 2),
                            "cublas_us": cub, "same_bytes_at_cublas_time_TBps":
                                round(byts / cub / 1e6, 2)})
            print(traffic[-1], flush=True)
    meta = results_meta("python -m benchmarks.experiments.l2_read_bandwidth OUT.json")
    write_results(out_path, {"meta": meta, "read": rows, "matmul_traffic": traffic})


if __name__ == "__main__":
    main(sys.argv[1])

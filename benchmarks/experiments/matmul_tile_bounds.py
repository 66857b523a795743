"""One-off GPU experiment: what bounds the batch-invariant matmul's one-CTA-per-tile runs at the
mid-M points that miss 0.9x cuBLAS (M = 256: llama qkv, o, down)?

A probe kernel walks the tiles of the default tiling (128x128 tiles, BLOCK_K 64, 8 warps, 4
stages, TMA loads, one CTA per tile) in three modes:
    full    the matmul's K loop: load A and B blocks, tl.dot (should time like the matmul)
    loads   the same loads, each block summed instead of multiplied (no MMA)
    mma     one A and one B block loaded once, then the same number of tl.dot steps (no loads)
If ``loads`` takes about as long as ``full`` and ``mma`` much less, the tile is bound by how
fast an SM pulls its operands from L2, not by the MMA rate; with 128x128 tiles each SM moves
32 KB per 2 MFLOP. ``loads`` is also run with the tiles spread over 40 to 264 CTAs, to see
whether the pull rate is a per-SM limit (constant GB/s per CTA) or a shared one.

    PYTHONPATH=src python -m benchmarks.experiments.matmul_tile_bounds OUT.json

Outcome at c0a5bdb (benchmarks/results/matmul_tile_bounds.json): the MMA chain bounds it.
``mma`` alone took 19.2 us for llama qkv (the matmul 21.8, cuBLAS 14.9), 18.8 for o and 41.9
for down: one CTA issues MMAs at ~5.2 TFLOP/s, ~70% of an SM's peak, so 80 tiles on 132 SMs
cannot go below ~19 us (0.78x cuBLAS) with any loads. The ``loads`` mode does not measure
loads: summing each 128x64 register tile costs far more than the MMA (196-524 us).
"""

import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from benchmarks.harness import results_meta, write_results
from benchmarks.harness.timing import time_graph_us
from benchmarks.suites.matmul import LAYERS, layer_inputs, time_cublas, time_detlora

BM, BN, BK, WARPS, STAGES = 128, 128, 64, 8, 4
FULL, LOADS, MMA = 0, 1, 2


@triton.jit
def _probe(a, b, out, M, N, K, num_tiles, MODE: tl.constexpr, BLOCK_M: tl.constexpr,
           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BLOCK_N)
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # A CTA takes tiles pid, pid + grid, ... (one each when the grid is the tile count).
    for t in range(pid, num_tiles, tl.num_programs(0)):
        off_m = (t // n_tiles) * BLOCK_M
        off_n = (t % n_tiles) * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if MODE == 2:
            a_blk = a.load([off_m, 0])
            b_blk = b.load([off_n, 0]).T
            for _ in range(0, tl.cdiv(K, BLOCK_K)):
                acc = tl.dot(a_blk, b_blk, acc)
        else:
            for kb in range(0, tl.cdiv(K, BLOCK_K)):
                a_blk = a.load([off_m, kb * BLOCK_K])
                b_blk = b.load([off_n, kb * BLOCK_K]).T
                if MODE == 0:
                    acc = tl.dot(a_blk, b_blk, acc)
                else:
                    acc += (tl.sum(a_blk.to(tl.float32), axis=1)[:, None]
                            + tl.sum(b_blk.to(tl.float32), axis=0)[None, :])
        total += acc
    offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    tl.store(out + pid * BLOCK_M * BLOCK_N + offs, total)


def _probe_call(x, w, scratch, mode: int, ctas: int | None = None):
    m, k = x.shape
    n = w.shape[0]
    tiles = triton.cdiv(m, BM) * triton.cdiv(n, BN)
    grid = ctas or tiles
    a = TensorDescriptor(x, list(x.shape), [x.stride(0), 1], [BM, BK])
    b = TensorDescriptor(w, list(w.shape), [w.stride(0), 1], [BN, BK])
    _probe[(grid,)](a, b, scratch, m, n, k, tiles, MODE=mode, BLOCK_M=BM, BLOCK_N=BN,
                    BLOCK_K=BK, num_warps=WARPS, num_stages=STAGES)


def main(out_path: str) -> None:
    meta = results_meta("python -m benchmarks.experiments.matmul_tile_bounds OUT.json")
    rows = []
    scratch = torch.empty(264 * BM * BN, dtype=torch.float32, device="cuda")
    for layer in ("llama_qkv", "llama_o", "llama_down"):
        n, k = LAYERS[layer]
        m = 256
        sets = layer_inputs(n, k, m)
        tiles = triton.cdiv(m, BM) * triton.cdiv(n, BN)
        base = {"layer": layer, "N": n, "K": k, "M": m, "tiles": tiles,
                "bytes_per_tile": (BM + BN) * k * 2}
        us = {"matmul_default": time_detlora(sets), "cublas": time_cublas(sets),
              "matmul_128x128": time_detlora(sets, _cfg_128(m, n, k))}
        for name, mode in (("full", FULL), ("loads", LOADS), ("mma", MMA)):
            us[name] = time_graph_us([lambda s=s, mode=mode: _probe_call(s[0], s[1], scratch, mode)
                                      for s in sets])
        for name, t in us.items():
            rows.append({**base, "variant": name, "ctas": tiles, "us": round(t, 3)})
            print(rows[-1], flush=True)
        # How the pull rate scales with concurrent CTAs: the loads of M = 1024 (4x the tiles)
        # spread over 40 to 264 CTAs.
        big = layer_inputs(n, k, 1024, max_sets=8)
        big_tiles = 4 * tiles
        for ctas in (40, 80, 132, 264):
            t = time_graph_us([lambda s=s, c=ctas: _probe_call(s[0], s[1], scratch, LOADS, c)
                               for s in big])
            moved = big_tiles * base["bytes_per_tile"]
            rows.append({**base, "M": 1024, "tiles": big_tiles, "variant": "loads",
                         "ctas": ctas, "us": round(t, 3),
                         "GBps_per_cta": round(moved / ctas / t / 1e3, 1),
                         "TBps_total": round(moved / t / 1e6, 2)})
            print(rows[-1], flush=True)
        del big
        write_results(out_path, {"meta": meta, "rows": rows}, history=False)  # partial
    write_results(out_path, {"meta": meta, "rows": rows})


def _cfg_128(m: int, n: int, k: int):
    from dataclasses import replace

    from detlora.ops.matmul import matmul_config
    return replace(matmul_config(m, n, k), block_m=BM, block_n=BN, num_warps=WARPS,
                   num_stages=STAGES, split_ctas=True, load_k=BK)


if __name__ == "__main__":
    main(sys.argv[1])

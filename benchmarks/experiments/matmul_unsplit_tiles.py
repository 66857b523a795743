"""Tiles for the unsplit (S = 1) batch-invariant matmul at many rows, and the default config
at every M, beside cuBLAS, on the Llama-3.2-3B and Qwen3-0.6B layer shapes.

With S = 1 any tile, path and load width gives the same bits, so choosing the tiling at
M > 64 is plain GEMM tuning: persistent CTAs (1 or 2 per SM) or one CTA per tile, tiles from
64x32 to 256x128. CUDA-graph replays over rotating input sets (as suites.matmul), median per
call.

    PYTHONPATH=src python -m benchmarks.experiments.matmul_unsplit_tiles OUT.json
"""

import sys

from benchmarks.harness import results_meta, write_results
from benchmarks.suites.matmul import LAYERS, layer_inputs, time_cublas, time_detlora
from detlora.ops.matmul import MatmulConfig, k_split, matmul_config

MS = (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096)
# (BLOCK_M, BLOCK_N, warps, stages, persistent, CTAs per SM, load_k)
TILES = ((128, 256, 8, 3, True, 1, 64), (128, 128, 8, 4, True, 1, 64),
         (128, 128, 8, 3, True, 2, 64), (64, 128, 4, 4, True, 2, 64),
         (64, 256, 4, 3, True, 1, 64), (256, 128, 8, 3, True, 1, 64),
         (128, 128, 8, 4, False, 1, 64), (64, 128, 4, 4, False, 1, 64),
         (64, 64, 4, 4, False, 1, 128), (64, 32, 4, 4, False, 1, 256),
         (128, 64, 4, 4, False, 1, 128))
ROWS: list[dict] = []


def _row(name, n, k, m, cfg, us, cublas, default):
    ROWS.append({"layer": name, "N": n, "K": k, "M": m, "default": default,
                 "block_m": cfg.block_m, "block_n": cfg.block_n, "load_k": cfg.block_k,
                 "warps": cfg.num_warps, "stages": cfg.num_stages,
                 "persistent": not cfg.split_ctas, "per_sm": cfg.programs_per_sm,
                 "us": us and round(us, 3), "cublas_us": round(cublas, 3)})
    print(ROWS[-1], flush=True)


def measure(name: str) -> None:
    n, k = LAYERS[name]
    ks = k_split(n, k)
    for m in MS:
        sets = layer_inputs(n, k, m, max_sets=64)
        cublas = time_cublas(sets)
        default = matmul_config(m, n, k)
        _row(name, n, k, m, default, time_detlora(sets), cublas, True)
        if m >= 128 and ks.num_chunks == 1:
            for bm, bn, warps, stages, persistent, per_sm, load_k in TILES:
                cfg = MatmulConfig(ks, bm, bn, warps, stages, split_ctas=not persistent,
                                   programs_per_sm=per_sm, load_k=load_k)
                try:
                    us = time_detlora(sets, cfg)
                except Exception as exc:  # a tiling that does not compile is data too
                    us = None
                    print(f"{name} M={m} {cfg} failed: {exc!r}"[:300], flush=True)
                _row(name, n, k, m, cfg, us, cublas, False)
        del sets


def save(path: str, history: bool = False) -> None:
    meta = results_meta("python -m benchmarks.experiments.matmul_unsplit_tiles OUT.json")
    write_results(path, {"meta": meta, "rows": ROWS}, history=history)


def main(out_path: str) -> None:
    for layer in LAYERS:
        measure(layer)
        save(out_path)  # partial results survive a timeout
    save(out_path, history=True)


if __name__ == "__main__":
    main(sys.argv[1])

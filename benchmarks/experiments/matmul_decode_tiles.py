"""Decode tiles for the unsplit batch-invariant matmul on the engine's batch_invariant GEMMs
(Llama-3.2-3B with the in_gemm LoRA columns of a rank-16 adapter: q|k|v +48, o +16,
gate|up +32, down +16; and the LM head), M = 1, 16, 64, beside cuBLAS and the default config.

With S = 1 the tile, load width and stages never change bits (test_matmul_gpu.py proves the
tiles and load widths used here), so this is plain speed tuning of ``matmul_config``'s decode
branch. CUDA-graph replays over rotating input sets (as bench_matmul), median per call.

    PYTHONPATH=src python benchmarks/experiments/matmul_decode_tiles.py OUT.json
"""

import itertools
import json
import sys

from benchmarks.harness import results_meta
from detlora.ops.matmul import MatmulConfig, _load_fits, k_split, matmul_config
from detlora.study.bench_matmul import _inputs, time_cublas, time_detlora

SHAPES = {"qkv": (5120 + 48, 3072), "o": (3072 + 16, 3072), "gate_up": (16384 + 32, 3072),
          "down": (3072 + 16, 8192), "lm_head": (128256, 3072)}
ROWS: list[dict] = []


def measure(name: str, n: int, k: int) -> None:
    ks = k_split(n, k)
    for m in (1, 16, 64):
        sets = _inputs(n, k, m, max_sets=64)
        cublas = time_cublas(sets)
        default = matmul_config(m, n, k)
        bm = default.block_m
        cands = [default]
        for bn, load_k, stages in itertools.product((16, 32, 64, 128), (128, 256), (3, 4, 5, 6)):
            if _load_fits(ks, k, load_k):
                cands.append(MatmulConfig(ks, bm, bn, 4, stages, split_ctas=True,
                                          load_k=load_k))
        for cfg in cands:
            try:
                us = time_detlora(sets, cfg)
            except Exception as exc:  # a tiling that does not fit is data too
                us = None
                print(f"{name} M={m} {cfg} failed: {exc!r}"[:200], flush=True)
            ROWS.append({"layer": name, "N": n, "K": k, "M": m, "default": cfg is default,
                         "block_m": cfg.block_m, "block_n": cfg.block_n,
                         "load_k": cfg.block_k, "stages": cfg.num_stages,
                         "us": us and round(us, 3), "cublas_us": round(cublas, 3)})
        del sets
        best = min((r for r in ROWS[-len(cands):] if r["us"]), key=lambda r: r["us"])
        dflt = next(r for r in ROWS[-len(cands):] if r["default"])
        print(f"{name} M={m}: cublas {cublas:.2f} default {dflt['us']} best {best['us']} "
              f"(bn {best['block_n']} load_k {best['load_k']} stages {best['stages']})",
              flush=True)


def save(path: str) -> None:
    meta = results_meta("python benchmarks/experiments/matmul_decode_tiles.py")
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": ROWS}, f, indent=1)


if __name__ == "__main__":
    for layer, (n, k) in SHAPES.items():
        measure(layer, n, k)
        save(sys.argv[1])  # partial results survive a timeout

"""How few K chunks can the batch-invariant matmul afford? Wide BLOCK_K loads and narrow
BLOCK_N tiles at decode, against what fewer chunks buy at many rows.

Two questions, for the layers whose split count (S > 1) costs most at M >= 64:
1. Bits: is a chunk summed with BLOCK_K 128 or 256 loads bit-identical to the same chunk
   summed with BLOCK_K 64 (the MMA chain runs the same k16 steps in the same order)? Checked
   with torch.equal on the fp32 sums at M = 1, 64 (split path) and 300 (persistent path).
2. Speed: each split count S in {1, 2, 3, 4, the default} at M = 1 and 64 over decode tiles
   (BLOCK_N 16/32/64, BLOCK_K 64/128/256, stages) and at M = 256, 1024, 4096 over the
   persistent tiles, beside cuBLAS; CUDA-graph replays over rotating input sets (as
   suites.matmul), median per call.

    PYTHONPATH=src python -m benchmarks.experiments.matmul_split_counts OUT.json
"""

import sys

import torch

from benchmarks.harness import results_meta, write_results
from benchmarks.suites.matmul import LAYERS, layer_inputs, time_cublas, time_detlora
from detlora.ops.matmul import KSplit, MatmulConfig, k_split, linear, matmul_config

LAYER_NAMES = ("llama_o", "llama_down", "llama_qkv", "qwen_down", "qwen_o")
DECODE_M = (1, 64)
MANY_M = (256, 1024, 4096)
DECODE_TILES = ((16, 64, 6), (16, 128, 6), (16, 256, 4), (16, 256, 6), (32, 64, 6),
                (32, 128, 6), (32, 256, 4), (64, 64, 4), (64, 128, 4))
ROWS: list[dict] = []


def _split(k: int, bk: int, chunks: int) -> KSplit | None:
    """S chunks of K whose bounds are multiples of 256 elements, loaded in BLOCK_K bk."""
    units = -(-k // 256)
    per = -(-units // max(1, min(chunks, units)))
    ks = KSplit(bk, per * 256 // bk, -(-units // per))
    return ks if ks.fits(k) else None


def _fp32(x, w, cfg):
    out = torch.empty(x.shape[0], w.shape[0], device="cuda")
    return linear(x, w, out=out, config=cfg)


def bits(name: str) -> None:
    n, k = LAYERS[name]
    w = (torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16)
    for s in sorted({1, 2, k_split(n, k).num_chunks}):
        base = _split(k, 64, s)
        for m, bm, bn, split in ((1, 16, 16, True), (64, 64, 32, True), (300, 128, 128, False)):
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            ref = _fp32(x, w, MatmulConfig(base, bm, 64, 4, 4, split_ctas=split))
            for bk in (128, 256):
                ks = _split(k, bk, s)
                cfg = MatmulConfig(ks, bm, bn, 8 if bm == 128 else 4, 3, split_ctas=split,
                                   flatten=s == 1)
                same = torch.equal(ref, _fp32(x, w, cfg))
                ROWS.append({"part": "bits", "layer": name, "S": s, "M": m, "block_k": bk,
                             "equal_to_block_k_64": same})
                print(ROWS[-1], flush=True)


def speed(name: str) -> None:
    n, k = LAYERS[name]
    splits = sorted({1, 2, 3, 4, k_split(n, k).num_chunks})
    for m in (*DECODE_M, *MANY_M):
        sets = layer_inputs(n, k, m, max_sets=64)
        cublas = time_cublas(sets)
        us = time_detlora(sets)
        ROWS.append({"part": "speed", "layer": name, "N": n, "K": k, "M": m, "default": True,
                     "config": str(matmul_config(m, n, k)), "us": round(us, 3),
                     "cublas_us": round(cublas, 3)})
        print(ROWS[-1], flush=True)
        for s in splits:
            cands = []
            if m <= 64:
                bm = 16 if m == 1 else 64
                for bn, bk, stages in DECODE_TILES:
                    ks = _split(k, bk, s)
                    if ks is not None:
                        cands.append(MatmulConfig(ks, bm, bn, 4, stages, split_ctas=True))
            else:
                ks = _split(k, 64, s)
                if s == 1:
                    cands.append(MatmulConfig(ks, 128, 256, 8, 3, split_ctas=False))
                cands += [MatmulConfig(ks, 128, 128, 8, 4, split_ctas=False, flatten=s == 1),
                          MatmulConfig(_split(k, 128, s) or ks, 128, 128, 8, 3,
                                       split_ctas=False, flatten=s == 1),
                          MatmulConfig(ks, 64, 128, 4, 4, split_ctas=False, flatten=s == 1,
                                       programs_per_sm=2)]
                if m == 256 and s > 1:
                    cands.append(MatmulConfig(ks, 64, 128, 4, 4, split_ctas=True))
            for cfg in cands:
                try:
                    us = time_detlora(sets, cfg)
                except Exception as exc:  # a tiling that does not compile is data too
                    us = None
                    print(f"{name} M={m} {cfg} failed: {exc!r}"[:300], flush=True)
                ROWS.append({"part": "speed", "layer": name, "N": n, "K": k, "M": m, "S": s,
                             "block_m": cfg.block_m, "block_n": cfg.block_n,
                             "block_k": cfg.k_split.block_k, "stages": cfg.num_stages,
                             "split_ctas": cfg.split_ctas, "us": us and round(us, 3),
                             "cublas_us": round(cublas, 3)})
                print(ROWS[-1], flush=True)
        del sets


def save(path: str, history: bool = False) -> None:
    meta = results_meta("python -m benchmarks.experiments.matmul_split_counts OUT.json")
    write_results(path, {"meta": meta, "rows": ROWS}, history=history)


def main(out_path: str) -> None:
    for layer in LAYER_NAMES:
        bits(layer)
    save(out_path)
    for layer in LAYER_NAMES:
        speed(layer)
        save(out_path)  # partial results survive a timeout
    save(out_path, history=True)


if __name__ == "__main__":
    main(sys.argv[1])

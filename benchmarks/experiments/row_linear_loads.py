"""Row-parallel layers (o_proj, down_proj) at decode sizes on Qwen2.5-7B's widths, beside
Mistral-7B's and Llama-3.2-3B's, against cuBLAS; with tilings that keep the bits.

A row-parallel layer sums ``k_groups(K)`` = 8 group chains in order (one CTA walks them).
Each K load must divide a group: K / 8 is 7 x 64 for Qwen2.5-7B's o_proj (3,584) and 37 x 64
for its down_proj (18,944), so both load 64 K elements at a time where Mistral's and Llama's
load 256 (`matmul_config`); Qwen2.5-7B's `batch_invariant` decode was 1.32x `fast` on the
H200 against Mistral's 1.06x (architectures.json). This times the default tiling and, at the
same split (so the same bits: the check below compares each variant's output with the
default's), narrower column tiles (more CTAs) and deeper pipelines, at M = 1, 16 and 64.
CUDA-graph replays over rotating input sets (as suites.matmul), median per call.

    PYTHONPATH=src python -m benchmarks.experiments.row_linear_loads OUT.json
"""

from __future__ import annotations

import dataclasses
import sys

import torch

from benchmarks.harness import results_meta, write_results
from benchmarks.harness.timing import time_graph_us
from benchmarks.suites.matmul import layer_inputs, time_cublas
from detlora.ops.grouped_linear import k_groups
from detlora.ops.matmul import KSplit, MatmulConfig, linear, matmul_config

# name -> (N, K) as nn.Linear stores the weight.
LAYERS = {"qwen2.5-7b_o": (3584, 3584), "qwen2.5-7b_down": (3584, 18944),
          "mistral-7b_o": (4096, 4096), "mistral-7b_down": (4096, 14336),
          "llama-3b_o": (3072, 3072), "llama-3b_down": (3072, 8192)}
MS = (1, 16, 64)
VARIANTS = ((16, 6), (16, 8), (32, 8), (32, 10), (64, 8))  # (BLOCK_N, stages)
ROWS: list[dict] = []


def _time(sets, split: KSplit, cfg: MatmulConfig | None) -> float:
    return time_graph_us([lambda s=s: linear(s[0], s[1], out=s[2], split=split, config=cfg)
                          for s in sets])


def measure(name: str) -> None:
    n, k = LAYERS[name]
    split = KSplit.equal_groups(k, k_groups(k))
    assert split is not None, name
    for m in MS:
        sets = layer_inputs(n, k, m, max_sets=64)
        x, w, _ = sets[0]
        cublas = time_cublas(sets)
        default = matmul_config(m, n, k, split=split)
        want = linear(x, w, split=split)
        configs = [(True, default)] + [
            (False, dataclasses.replace(default, block_n=bn, num_stages=stages))
            for bn, stages in VARIANTS
            if (bn, stages) != (default.block_n, default.num_stages)]
        for is_default, cfg in configs:
            try:
                same = torch.equal(linear(x, w, split=split, config=cfg), want)
                us = _time(sets, split, None if is_default else cfg)
            except Exception as exc:  # a tiling that does not compile is data too
                same, us = None, None
                print(f"{name} M={m} {cfg} failed: {exc!r}"[:300], flush=True)
            ROWS.append({"layer": name, "N": n, "K": k, "M": m, "default": is_default,
                         "block_n": cfg.block_n, "stages": cfg.num_stages,
                         "load_k": cfg.block_k, "chunks": cfg.k_split.num_chunks,
                         "same_bits": same, "us": us and round(us, 3),
                         "cublas_us": round(cublas, 3),
                         "vs_cublas": us and round(cublas / us, 3)})
            print(ROWS[-1], flush=True)
        del sets


def save(path: str, history: bool = False) -> None:
    meta = results_meta("python -m benchmarks.experiments.row_linear_loads OUT.json")
    write_results(path, {"meta": meta, "rows": ROWS}, history=history)


def main(out_path: str) -> None:
    if not torch.cuda.is_available():
        raise SystemExit("row_linear_loads times CUDA kernels: run it on the GPU machine")
    for layer in LAYERS:
        measure(layer)
        save(out_path)  # partial results survive a timeout
    save(out_path, history=True)


if __name__ == "__main__":
    main(sys.argv[1])

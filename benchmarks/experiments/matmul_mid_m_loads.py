"""One-off GPU experiment: wider K loads (and fewer stages) for the batch-invariant matmul's
M = 256 and 1024 tiles, the points that miss 0.9x cuBLAS.

matmul_tile_bounds.json showed the default 128x128 tile at M = 256 bound by its own MMA
chain: the MMAs alone (operands loaded once) take 19.2 of the 21.8 us of llama qkv. A dot of
128 or 256 K elements per load issues the same 16-deep MMA steps in the same order (so the
bits cannot change; test_matmul_gpu.py proves load widths equal) in fewer, longer groups, with
fewer loop iterations and waits. Each point runs its default config with
(load_k, stages) in (64, default), (128, 3), (128, 2), (256, 2), beside cuBLAS, and checks the
output against the default's with ``torch.equal``. A config that does not fit (shared memory)
is recorded with its error.

    PYTHONPATH=src python benchmarks/experiments/matmul_mid_m_loads.py OUT.json

Outcome at 3bb145f (benchmarks/results/matmul_mid_m_loads.json): no variant was faster than
the default at any of the 14 points (e.g. llama qkv M = 256: 22.1 us default against 22.6,
37.3 and 48.4); all 56 gave the default's bits. Not adopted.
"""

import dataclasses
import json
import sys

import torch

from benchmarks.harness import results_meta
from detlora.ops.matmul import _load_fits, linear, matmul_config
from detlora.study.bench_matmul import LAYERS, _inputs, time_cublas, time_detlora

POINTS = [(layer, m) for layer in ("llama_qkv", "llama_o", "llama_down", "llama_gate_up",
                                   "qwen_gate_up", "qwen_down", "qwen_o")
          for m in (256, 1024)]
VARIANTS = ((128, 3), (128, 2), (256, 2))
ROWS: list[dict] = []


def measure(layer: str, m: int) -> None:
    n, k = LAYERS[layer]
    sets = _inputs(n, k, m, max_sets=64)
    default = matmul_config(m, n, k)
    x, w, _ = sets[0]
    ref = linear(x, w, config=default)
    base = {"layer": layer, "N": n, "K": k, "M": m, "block_m": default.block_m,
            "block_n": default.block_n, "split_ctas": default.split_ctas,
            "cublas_us": round(time_cublas(sets), 3)}
    ROWS.append({**base, "load_k": default.block_k, "stages": default.num_stages,
                 "default": True, "us": round(time_detlora(sets, default), 3),
                 "equal_to_default": True})
    print(ROWS[-1], flush=True)
    for load_k, stages in VARIANTS:
        if not _load_fits(default.k_split, k, load_k):
            continue
        cfg = dataclasses.replace(default, load_k=load_k, num_stages=stages)
        row = {**base, "load_k": load_k, "stages": stages, "default": False}
        try:
            row["equal_to_default"] = torch.equal(linear(x, w, config=cfg), ref)
            row["us"] = round(time_detlora(sets, cfg), 3)
        except Exception as exc:  # shared memory exceeded: data too
            row["error"] = repr(exc)[:200]
        ROWS.append(row)
        print(row, flush=True)
    del sets


def save(path: str) -> None:
    with open(path, "w") as f:
        json.dump({"meta": results_meta(" ".join(["python", *sys.argv])), "rows": ROWS}, f,
                  indent=1)


if __name__ == "__main__":
    for layer, m in POINTS:
        measure(layer, m)
        save(sys.argv[1])  # partial results survive a timeout

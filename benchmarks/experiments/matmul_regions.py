"""Unsplit (S = 1) batch-invariant matmul at a few hundred to a thousand rows in two launches:
the first columns in big tiles (whole waves of the GPU), the rest in small tiles, instead of one
tiling whose last wave leaves SMs idle. With S = 1 every tiling gives the same bits, so the
split only moves work. Each plan: linear(x, W[:c]) into out[:, :c] with config A, then
linear(x, W[c:]) into out[:, c:] with config B, both with the full weight's k_split.
CUDA-graph replays over rotating input sets (as suites.matmul), median per call; bits: each
plan's output against the default single launch (``torch.equal``).

    PYTHONPATH=src python -m benchmarks.experiments.matmul_regions OUT.json
"""

import sys

import torch

from benchmarks.harness import results_meta, write_results
from benchmarks.harness.timing import time_graph_us
from benchmarks.suites.matmul import LAYERS, layer_inputs, time_cublas, time_detlora
from detlora.ops.matmul import MatmulConfig, k_split, linear, matmul_config

POINTS = (("llama_qkv", 256), ("llama_qkv", 1024), ("llama_o", 256), ("llama_o", 1024),
          ("llama_down", 256), ("llama_down", 1024), ("llama_gate_up", 256),
          ("qwen_gate_up", 256), ("qwen_down", 1024), ("qwen_o", 1024))
SMS = 132
# name: (BLOCK_M, BLOCK_N, warps, stages, persistent, CTAs per SM, load_k)
BIG = {"p128x256": (128, 256, 8, 3, True, 1, 64), "p128x128": (128, 128, 8, 4, True, 1, 64),
       "g128x128": (128, 128, 8, 4, False, 1, 64)}
SMALL = {"g64x128": (64, 128, 4, 4, False, 1, 64), "g128x64": (128, 64, 4, 4, False, 1, 128),
         "p64x128x2": (64, 128, 4, 4, True, 2, 64), "g64x64": (64, 64, 4, 4, False, 1, 128)}


def config(ks, t):
    bm, bn, warps, stages, persistent, per_sm, load_k = t
    return MatmulConfig(ks, bm, bn, warps, stages, split_ctas=not persistent,
                        programs_per_sm=per_sm, load_k=load_k)


def main(out_path: str) -> None:
    rows = []
    for name, m in POINTS:
        n, k = LAYERS[name]
        ks = k_split(n, k)
        sets = layer_inputs(n, k, m, max_sets=32)
        base = {"layer": name, "N": n, "K": k, "M": m}
        cublas = time_cublas(sets)
        default = time_detlora(sets)
        x0, w0, o0 = sets[0]
        linear(x0, w0, out=o0)
        want = o0.clone()
        rows.append({**base, "plan": "default", "us": round(default, 3),
                     "cublas_us": round(cublas, 3), "config": repr(matmul_config(m, n, k))})
        print(rows[-1], flush=True)
        for big_name, big in BIG.items():
            m_tiles = -(-m // big[0])
            for waves in (1, 2):
                c = big[1] * (waves * SMS // m_tiles)
                if not 0 < c < n:
                    continue
                for small_name, small in SMALL.items():
                    ca, cb = config(ks, big), config(ks, small)

                    def call(s, c=c, ca=ca, cb=cb):
                        linear(s[0], s[1][:c], out=s[2][:, :c], config=ca)
                        linear(s[0], s[1][c:], out=s[2][:, c:], config=cb)

                    try:
                        o0.zero_()
                        call(sets[0])
                        equal = bool(torch.equal(o0, want))
                        us, err = time_graph_us([lambda s=s: call(s) for s in sets]), None
                    except Exception as exc:
                        equal, us, err = None, None, repr(exc)[:200]
                    rows.append({**base, "plan": f"{big_name}[:{c}]+{small_name}",
                                 "us": us and round(us, 3), "cublas_us": round(cublas, 3),
                                 "equal_to_default": equal, "error": err})
                    print(rows[-1], flush=True)
        del sets
        torch.cuda.empty_cache()
    meta = results_meta("python -m benchmarks.experiments.matmul_regions OUT.json")
    write_results(out_path, {"meta": meta, "rows": rows})


if __name__ == "__main__":
    main(sys.argv[1])

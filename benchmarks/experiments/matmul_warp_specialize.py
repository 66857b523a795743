"""One-off GPU experiment: Triton's Hopper warp specialization (``tl.range(...,
warp_specialize=True)``: producer warps issue the TMA loads, consumer warpgroups the wgmma)
on the batch-invariant matmul at the M >= 256 points that miss 0.9x cuBLAS.

Each variant is compiled from a patched copy of src/detlora/ops/matmul.py:
    ws_k      the K loop of both kernels (split and persistent) warp-specialized
    ws_tiles  the persistent kernel's tile loop warp-specialized instead (as Triton's
              persistent-matmul tutorial does on Blackwell)
Every call runs the default ``matmul_config`` of the shape (with 4 warps for the variants:
Triton 3.6 applies its Hopper warp specialization only at num_warps=4, compiled for sm_90 on
the CPU: no setmaxnreg in the PTX at 8 warps, 8 of them at 4; it then adds its own producer and
consumer warps; and in the persistent kernel only with its tile loop not flattened). The
output is compared with the unpatched kernel's (``torch.equal``): warp specialization moves
loads, not the MMA chain, so the bits should not change. A variant that fails to compile is
recorded with its error.

    PYTHONPATH=src python benchmarks/experiments/matmul_warp_specialize.py OUT.json

Outcome at 7ed3600 (``benchmarks/gpu.sh matmul-ws``, H200): no point finished in 380 s and no
row was written (rows are saved after each point), so the run stopped inside the first point
(llama qkv at M = 256: cuBLAS, the default kernel, then ws_k on the split path, 128x128 tile).
A warp-specialized kernel that never returns is the likely cause; not established, and not
pursued further (the session's device time was spent). No result file.
"""

import dataclasses
import importlib.util
import json
import sys

import torch

from benchmarks.harness import results_meta
from benchmarks.harness.timing import time_graph_us
from detlora.ops import matmul as mm
from detlora.study.bench_matmul import LAYERS, _inputs, time_cublas

SRC_PATH = mm.__file__
with open(SRC_PATH) as f:
    SRC = f.read()
SPLIT_K_LOOP = "    for kb in range(lo, hi):\n"
PERSISTENT_K_LOOP = "        for kb in range(0, k_blocks):\n"
TILE_LOOP = ("    for tile in tl.range(pid, batch_count * tiles_per_batch, num_programs, "
             "flatten=FLATTEN):\n")
assert SPLIT_K_LOOP in SRC and PERSISTENT_K_LOOP in SRC and TILE_LOOP in SRC

PATCHES = {
    "ws_k": ((SPLIT_K_LOOP, "    for kb in tl.range(lo, hi, warp_specialize=True):\n"),
             (PERSISTENT_K_LOOP,
              "        for kb in tl.range(0, k_blocks, warp_specialize=True):\n")),
    "ws_tiles": ((TILE_LOOP, TILE_LOOP.replace("flatten=FLATTEN)",
                                               "flatten=FLATTEN, warp_specialize=True)")),),
}
POINTS = [(layer, m) for layer in ("llama_qkv", "llama_o", "llama_down", "llama_gate_up",
                                   "qwen_gate_up", "qwen_down", "qwen_o")
          for m in (256, 1024)] + [("llama_qkv", 4096), ("llama_o", 4096)]


def load(name: str, patches) -> object:
    src = SRC
    for old, new in patches:
        src = src.replace(old, new)
    path = f"/tmp/{name}.py"
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location(f"detlora_ops_matmul_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def main(path: str) -> None:
    variants = {"default": mm} | {name: load(name, p) for name, p in PATCHES.items()}
    rows = []
    for layer, m in POINTS:
        n, k = LAYERS[layer]
        cfg = mm.matmul_config(m, n, k)
        sets = _inputs(n, k, m, max_sets=64)
        x, w, _ = sets[0]
        ref = mm.linear(x, w, config=cfg)
        row = {"layer": layer, "N": n, "K": k, "M": m, "cublas_us": round(time_cublas(sets), 3),
               "config": {"block_m": cfg.block_m, "block_n": cfg.block_n,
                          "warps": cfg.num_warps, "stages": cfg.num_stages,
                          "persistent": not cfg.split_ctas, "flatten": cfg.flatten}}
        for name, mod in variants.items():
            mcfg = mod.matmul_config(m, n, k)  # the same tiling, as the module's own class
            if mod is not mm:  # Triton 3.6 warp-specializes on sm_90 only at num_warps=4
                mcfg = dataclasses.replace(mcfg, num_warps=4, flatten=False)
            try:
                same = torch.equal(mod.linear(x, w, config=mcfg), ref)
                us = time_graph_us([lambda s=s, mod=mod, mcfg=mcfg: mod.linear(
                    s[0], s[1], out=s[2], config=mcfg) for s in sets])
                row[name] = {"us": round(us, 3), "vs_cublas": round(row["cublas_us"] / us, 3),
                             "bits_equal_default": same}
            except Exception as exc:  # a variant that does not compile is data too
                row[name] = {"error": repr(exc)[:400]}
        print(row, flush=True)
        rows.append(row)
        del sets
        torch.cuda.empty_cache()
        meta = results_meta("python benchmarks/experiments/matmul_warp_specialize.py")
        with open(path, "w") as f:  # partial results survive a timeout
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])

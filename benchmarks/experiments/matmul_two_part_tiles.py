"""Two-part tiles (BLOCK_N + BLOCK_N2 columns, two dots side by side) for the unsplit (S = 1)
batch-invariant matmul at a few hundred to a few thousand rows, beside the default config and
cuBLAS, on the Llama-3.2-3B and Qwen3-0.6B layer shapes.

Why: with power-of-two tiles, M x N often cuts into a tile count that fills 60-75% of the
H200's 132 SMs for one wave (llama down at M = 1024: 96 tiles of 128x256), and the bits forbid
splitting K further. A 128x192 tile (128 + 64) makes 128 tiles there. Every tiling gives the
same bits (each output element is one chain of 16-deep MMAs); this script checks it again with
torch.equal on the fp32 sums of every candidate against the default config.

    PYTHONPATH=src python -m benchmarks.experiments.matmul_two_part_tiles OUT.json
    PYTHONPATH=src python -m benchmarks.experiments.matmul_two_part_tiles OUT.json --rule

``--rule`` checks ``matmul_config``'s choice instead: at every M (a multiple of 64 up to 4096)
where it picks a two-part tile, that tile against what it picks without two-part tiles.
"""

import sys
from unittest import mock

import torch
from triton import cdiv

from benchmarks.harness import results_meta, write_results
from benchmarks.suites.matmul import LAYERS, layer_inputs, time_cublas, time_detlora
from detlora.ops import matmul as mm
from detlora.ops.matmul import MatmulConfig, k_split, linear, matmul_config

MS = (256, 512, 1024, 2048)
NAMES = ("llama_qkv", "llama_o", "llama_gate_up", "llama_down", "qwen_q", "qwen_kv",
         "qwen_qkv", "qwen_o", "qwen_gate_up", "qwen_down")
# (BLOCK_M, BLOCK_N, BLOCK_N2, warps, stages, load_k)
TILES = ((128, 128, 64, 8, 4, 64), (128, 128, 64, 8, 3, 64), (128, 128, 32, 8, 4, 64),
         (128, 64, 32, 8, 4, 64), (128, 64, 32, 4, 4, 64), (128, 64, 16, 4, 4, 64),
         (64, 128, 64, 4, 4, 64), (64, 128, 32, 4, 4, 64), (64, 64, 32, 4, 4, 128),
         (128, 256, 64, 8, 3, 64))
ROWS: list[dict] = []


def _sum32(x: torch.Tensor, w: torch.Tensor, cfg: MatmulConfig | None) -> torch.Tensor:
    out = torch.empty(x.shape[0], w.shape[0], device=x.device)
    return linear(x, w, out=out, config=cfg)


def _row(name, n, k, m, cfg, us, cublas, default, same_bits):
    tiles = cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n + cfg.block_n2)
    ROWS.append({"layer": name, "N": n, "K": k, "M": m, "default": default,
                 "block_m": cfg.block_m, "block_n": cfg.block_n, "block_n2": cfg.block_n2,
                 "load_k": cfg.block_k, "warps": cfg.num_warps, "stages": cfg.num_stages,
                 "persistent": not cfg.split_ctas, "tiles": tiles,
                 "us": us and round(us, 3), "cublas_us": round(cublas, 3),
                 "vs_cublas": us and round(cublas / us, 3), "same_bits": same_bits})
    print(ROWS[-1], flush=True)


def measure(name: str) -> None:
    n, k = LAYERS[name]
    ks = k_split(n, k)
    assert ks.num_chunks == 1, name
    for m in MS:
        sets = layer_inputs(n, k, m, max_sets=64)
        cublas = time_cublas(sets)
        default = matmul_config(m, n, k)
        x, w = sets[0][0], sets[0][1]
        ref = _sum32(x, w, default)
        _row(name, n, k, m, default, time_detlora(sets), cublas, True, True)
        for bm, bn, bn2, warps, stages, load_k in TILES:
            cfg = MatmulConfig(ks, bm, bn, warps, stages, split_ctas=True, load_k=load_k,
                               block_n2=bn2)
            try:
                same = bool(torch.equal(_sum32(x, w, cfg), ref))
                us = time_detlora(sets, cfg)
            except Exception as exc:  # a tiling that does not compile is data too
                same, us = None, None
                print(f"{name} M={m} {cfg} failed: {exc!r}"[:300], flush=True)
            _row(name, n, k, m, cfg, us, cublas, False, same)
        del sets, ref


def check_rule(name: str) -> None:
    n, k = LAYERS[name]
    for m in range(128, 4097, 64):
        new = matmul_config(m, n, k)
        if not new.block_n2:
            continue
        with mock.patch.object(mm, "_TWO_PART_TILES", ()):
            old = matmul_config(m, n, k)
        sets = layer_inputs(n, k, m, max_sets=64)
        cublas = time_cublas(sets)
        x, w = sets[0][0], sets[0][1]
        same = bool(torch.equal(_sum32(x, w, new), _sum32(x, w, old)))
        _row(name, n, k, m, old, time_detlora(sets, old), cublas, False, same)
        _row(name, n, k, m, new, time_detlora(sets, new), cublas, True, same)
        del sets


def save(path: str, command: str, history: bool = False) -> None:
    write_results(path, {"meta": results_meta(command), "rows": ROWS}, history=history)


def main(out_path: str, rule: bool = False) -> None:
    cmd = "python -m benchmarks.experiments.matmul_two_part_tiles OUT.json" + " --rule" * rule
    for layer in NAMES:
        (check_rule if rule else measure)(layer)
        save(out_path, cmd)  # partial results survive a timeout
    save(out_path, cmd, history=True)


if __name__ == "__main__":
    main(sys.argv[1], rule="--rule" in sys.argv[2:])

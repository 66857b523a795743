"""Batch-invariant matmul study (GPU): row invariance, a Hugging Face Llama forward under
``detlora.batch_invariant()``, latency against cuBLAS on Llama-3.2-3B and Qwen3-0.6B layer
shapes, cuBLAS's own batch invariance, and a config sweep for tuning ``matmul_config``.

    python -m benchmarks.suites.matmul --out out/matmul.json            # run(): ~3-5 min
    python -m benchmarks.suites.matmul --sweep --out out/matmul_sweep.json

Latency is measured as in suites.lora_kernels: CUDA-graph replays over rotating input sets that
together exceed L2, median per call, detlora and cuBLAS (``torch.mm(x, W.T)``, what nn.Linear
runs) side by side in one process.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from collections.abc import Callable, Iterable
from dataclasses import asdict

import torch

from benchmarks.harness.timing import input_sets_for, time_graph_us
from detlora.ops.matmul import (
    KSplit,
    MatmulConfig,
    _load_fits,
    k_split,
    linear,
    matmul,
    matmul_config,
)

# Layer name -> weight shape (N, K) as nn.Linear stores it.
LAYERS: dict[str, tuple[int, int]] = {
    "llama_qkv": (5120, 3072), "llama_o": (3072, 3072), "llama_gate_up": (16384, 3072),
    "llama_down": (3072, 8192), "llama_lm_head": (128256, 3072),
    "qwen_q": (2048, 1024), "qwen_kv": (1024, 1024), "qwen_qkv": (4096, 1024),
    "qwen_o": (1024, 2048), "qwen_gate_up": (6144, 1024), "qwen_down": (1024, 3072),
    "qwen_lm_head": (151936, 1024),
}
INVARIANCE_M = (2, 3, 7, 16, 64, 128, 257, 1024, 4096)
LATENCY_M = (1, 4, 16, 64, 256, 1024, 4096)
SWEEP_LAYERS = ("llama_o", "llama_qkv", "llama_down", "llama_gate_up", "qwen_o", "qwen_down")
SWEEP_M = (1, 16, 64, 256, 1024, 4096)
DTYPE = torch.bfloat16


def shape_of(name: str) -> str:
    n, k = LAYERS[name]
    return f"{name}:{n}x{k}"


# ----------------------------------------------------------------------------- invariance


def invariance_rows(
    layers: Iterable[str] = LAYERS, m_values: Iterable[int] = INVARIANCE_M, rows: int = 8,
    log: Callable[[str], None] = print,
) -> list[dict]:
    """Row i computed alone (M = 1) against row i inside M rows, torch.equal, for linear (the
    weight as stored) and matmul (a [K, N] copy of it), plus every tiling path at M = 1, 64,
    300 against the default one (the fp32 sums, unrounded)."""
    m_values = list(m_values)
    out = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name in layers:
        n, k = LAYERS[name]
        w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(DTYPE)
        x = torch.randn(max(m_values), k, device="cuda", generator=gen).to(DTYPE)
        wt = w.t().contiguous()
        ops = {"linear": lambda xs, w=w: linear(xs, w),
               "matmul": lambda xs, wt=wt: matmul(xs, wt)}
        for op, fn in ops.items():
            alone = [fn(x[i:i + 1]) for i in range(rows)]
            cases = mismatches = 0
            for m in m_values:
                batch = fn(x[:m])
                for i in range(min(m, rows)):
                    cases += 1
                    mismatches += not torch.equal(batch[i], alone[i][0])
            out.append({"op": op, "shape": shape_of(name), "check": "row_alone_vs_in_batch",
                        "cases": cases, "mismatches": mismatches})
            log(f"invariance {op:6s} {shape_of(name):26s} cases {cases:3d} mismatches "
                f"{mismatches}")
        cases = mismatches = 0
        for m in (1, 64, 300):
            ref = _linear32(x[:m], w, None)
            for cfg in path_variants(n, k):
                cases += 1
                mismatches += not torch.equal(_linear32(x[:m], w, cfg), ref)
        out.append({"op": "linear", "shape": shape_of(name), "check": "paths_tiles_tma_fp32",
                    "cases": cases, "mismatches": mismatches})
        log(f"invariance paths  {shape_of(name):26s} cases {cases:3d} mismatches {mismatches}")
        del w, wt, x
    return out


def _linear32(x: torch.Tensor, w: torch.Tensor, cfg: MatmulConfig | None) -> torch.Tensor:
    out = torch.empty(x.shape[0], w.shape[0], device=x.device)
    return linear(x, w, out=out, config=cfg)


def path_variants(n: int, k: int) -> list[MatmulConfig]:
    """Every way the kernels can be asked to build the default split sum of an [N, K] weight:
    split over CTAs or persistent, several tiles (two-part ones too), load widths, warps and
    stages, TMA or pointer loads, flattened or nested loops. All must give the same bits
    (tests/gpu proves it too)."""
    ks = k_split(n, k, DTYPE)
    wide = [w for w in (128, 256) if _load_fits(ks, k, w)]
    out = []
    for bm, bn, warps, stages in ((16, 32, 4, 5), (16, 64, 4, 4), (32, 64, 4, 3),
                                  (64, 64, 4, 5), (64, 128, 4, 4), (128, 128, 8, 3)):
        for tma in (True, False):
            out.append(MatmulConfig(ks, bm, bn, warps, stages, split_ctas=True, tma=tma))
    for bm, bn, load_k in itertools.product((16, 64, 128), (16, 32, 64), wide):
        out.append(MatmulConfig(ks, bm, bn, 4, 4, split_ctas=True, load_k=load_k))
    tiles = [(64, 128, 4, 4, 0), (128, 128, 8, 4, 0), (128, 128, 8, 3, 0)]
    tiles += [(128, 128, 8, 3, 128)] if 128 in wide else []
    if ks.num_chunks == 1:
        tiles.append((128, 256, 8, 3, 0))
        # Two-part tiles (block_n + block_n2 columns), split path, one chunk.
        for bm, bn, bn2, warps, stages in ((128, 128, 64, 8, 4), (128, 256, 64, 8, 3),
                                           (64, 64, 32, 4, 4), (16, 32, 16, 4, 4)):
            for tma in (True, False):
                out.append(MatmulConfig(ks, bm, bn, warps, stages, split_ctas=True, tma=tma,
                                        block_n2=bn2))
    for bm, bn, warps, stages, load_k in tiles:
        for tma, flatten in ((True, True), (True, False), (False, False)):
            out.append(MatmulConfig(ks, bm, bn, warps, stages, split_ctas=False, tma=tma,
                                    flatten=flatten, load_k=load_k))
    return out


def hf_llama_invariance(
    batch: int = 32, seq: int = 16, prompts_checked: int = 4, seed: int = 0,
    mode: bool = True, device: str = "cuda", dtype: torch.dtype = DTYPE,
) -> dict:
    """A small random Llama (bf16, eager attention) on prompts of one length (no padding):
    logits of each checked prompt alone against the same prompt inside a batch of ``batch``
    others, torch.equal per position, under ``detlora.batch_invariant()`` (or without it)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from detlora.batch_invariant import batch_invariant

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=688,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=False)
    config._attn_implementation = "eager"  # attention as matmul/softmax: bmm is routed
    model = LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    ids = torch.randint(0, config.vocab_size, (batch + 1, seq), device=device, generator=gen)
    cases = mismatches = 0
    with torch.no_grad(), batch_invariant(mode, device_type=device):
        together = model(input_ids=ids).logits
        for p in range(min(prompts_checked, batch + 1)):
            alone = model(input_ids=ids[p:p + 1]).logits[0]
            for t in range(seq):
                cases += 1
                mismatches += not torch.equal(alone[t], together[p, t])
    return {"op": "hf_llama", "shape": f"llama_tiny:h{config.hidden_size}xL"
            f"{config.num_hidden_layers}", "check": f"hf_llama_batch_{batch}",
            "cases": cases, "mismatches": mismatches}


# ----------------------------------------------------------------------------- latency


def layer_inputs(n: int, k: int, m: int, max_sets: int = 256) -> list[tuple[torch.Tensor, ...]]:
    sets = input_sets_for((m * k + n * k + m * n) * 2, max_sets=max_sets)
    gen = torch.Generator(device="cuda").manual_seed(m * 31 + n + k)
    out = []
    for _ in range(sets):
        x = torch.randn(m, k, device="cuda", generator=gen).to(DTYPE)
        w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(DTYPE)
        out.append((x, w, torch.empty(m, n, device="cuda", dtype=DTYPE)))
    return out


def time_detlora(sets, config: MatmulConfig | None = None) -> float:
    return time_graph_us([lambda s=s: linear(s[0], s[1], out=s[2], config=config)
                          for s in sets])


def time_cublas(sets) -> float:
    return time_graph_us([lambda s=s: torch.mm(s[0], s[1].t(), out=s[2]) for s in sets])


def latency_rows(
    layers: Iterable[str] = LAYERS, ms: Iterable[int] = LATENCY_M,
    log: Callable[[str], None] = print,
) -> list[dict]:
    rows = []
    for name in layers:
        n, k = LAYERS[name]
        for m in ms:
            sets = layer_inputs(n, k, m)
            us = {"detlora": time_detlora(sets), "cublas": time_cublas(sets)}
            for impl, t in us.items():
                rows.append({"op": "linear", "shape": shape_of(name), "M": m, "impl": impl,
                             "us": round(t, 3)})
            cfg = matmul_config(m, n, k, DTYPE)
            log(f"latency {shape_of(name):26s} M={m:5d} detlora {us['detlora']:9.2f}us "
                f"cublas {us['cublas']:9.2f}us ratio {us['cublas'] / us['detlora']:.2f} "
                f"({cfg.block_m}x{cfg.block_n} S={cfg.k_split.num_chunks} "
                f"{'split' if cfg.split_ctas else 'persistent'})")
            del sets
    return rows


def summarize(latency: list[dict]) -> dict:
    """Throughput relative to cuBLAS (cublas_us / detlora_us; > 1 is faster) by M range."""
    pairs: dict[tuple[str, int], dict[str, float]] = {}
    for row in latency:
        pairs.setdefault((row["shape"], row["M"]), {})[row["impl"]] = row["us"]
    ratio = {key: v["cublas"] / v["detlora"] for key, v in pairs.items()}
    small = {key: r for key, r in ratio.items() if key[1] <= 64}
    large = {key: r for key, r in ratio.items() if key[1] >= 256}

    def stats(group: dict) -> dict:
        if not group:
            return {}
        worst = min(group, key=group.get)
        return {"median": round(statistics.median(group.values()), 3),
                "min": round(group[worst], 3), "min_at": {"shape": worst[0], "M": worst[1]},
                "points": len(group)}

    return {"throughput_vs_cublas_M_le_64": stats(small),
            "throughput_vs_cublas_M_ge_256": stats(large),
            "targets": {"M_le_64": 0.75, "M_ge_256": 0.9}}


# ----------------------------------------------------------------------------- sweep


def sweep_candidates(m: int, n: int, k: int) -> list[MatmulConfig]:
    """Tilings to time for one shape: each split count worth considering (the default one
    and 1), and for each, the tiles and paths that suit M."""
    default = k_split(n, k, DTYPE)
    bk = default.block_k
    # The default split, no split, and a split sized for decode (about two CTAs per SM at
    # BLOCK_N 64) whether or not the default rule splits this N: the data that decides
    # k_split's threshold.
    decode = min(-(-264 // -(-n // 64)), -(-k // bk) // 4, 16)
    splits = {default, KSplit.for_chunks(k, bk, 1), KSplit.for_chunks(k, bk, max(2, decode))}
    out = []
    for ks in sorted(splits, key=lambda s: s.num_chunks):
        if m <= 64:
            bm = 16 if m <= 16 else 32 if m <= 32 else 64
            for bn, stages in itertools.product((32, 64, 128), (4, 6)):
                out.append(MatmulConfig(ks, bm, bn, 4, stages, split_ctas=True))
            # One CTA per narrow tile walking every chunk itself: no scratch traffic, many
            # CTAs from a narrow BLOCK_N instead of from the split.
            for bn, stages in itertools.product((16, 32), (4, 6, 8)):
                out.append(MatmulConfig(ks, bm, bn, 4, stages, split_ctas=False,
                                        flatten=False, programs_per_sm=8))
            continue
        # (BLOCK_M, BLOCK_N, warps, stages, CTAs per SM, flatten)
        tiles = [(128, 128, 8, 4, 1, True), (128, 128, 8, 4, 1, False),
                 (128, 128, 8, 3, 1, True), (64, 128, 4, 4, 2, True)]
        if ks.num_chunks == 1:
            tiles += [(128, 256, 8, 3, 1, True), (128, 256, 8, 3, 1, False),
                      (256, 128, 8, 3, 1, True)]
        for bm, bn, warps, stages, per_sm, flatten in tiles:
            out.append(MatmulConfig(ks, bm, bn, warps, stages, split_ctas=False,
                                    flatten=flatten, programs_per_sm=per_sm))
        if ks.num_chunks > 1 and m <= 1024:
            out += [MatmulConfig(ks, 64, 128, 4, 4, split_ctas=True),
                    MatmulConfig(ks, 128, 128, 8, 3, split_ctas=True)]
    return out


def sweep(
    layers: Iterable[str] = SWEEP_LAYERS, ms: Iterable[int] = SWEEP_M,
    log: Callable[[str], None] = print, paths: tuple[str, ...] = ("split", "persistent"),
) -> list[dict]:
    """Time every candidate of ``sweep_candidates`` on the given ``paths`` (tuning data for
    ``matmul_config``); the default config is always timed.

    Each row: layer, M, the config, its time, cuBLAS's time and whether it is the default
    config. Configs with a different split count give different bits: they are timed only.
    """
    rows = []
    for name in layers:
        n, k = LAYERS[name]
        for m in ms:
            sets = layer_inputs(n, k, m, max_sets=64)
            cublas = time_cublas(sets)
            default = matmul_config(m, n, k, DTYPE)
            best: dict[int, tuple[float, MatmulConfig]] = {}
            candidates = [c for c in sweep_candidates(m, n, k)
                          if ("split" if c.split_ctas else "persistent") in paths]
            for cfg in [*candidates, default]:
                try:
                    us = time_detlora(sets, cfg)
                except Exception as exc:  # a candidate that fails to compile is data
                    log(f"sweep {name} M={m} {cfg} failed: {exc!r}"[:400])
                    continue
                rows.append({"layer": name, "shape": shape_of(name), "M": m,
                             "config": asdict(cfg), "us": round(us, 3),
                             "cublas_us": round(cublas, 3), "default": cfg == default})
                s = cfg.k_split.num_chunks
                if s not in best or us < best[s][0]:
                    best[s] = (us, cfg)
            dflt = next(r["us"] for r in reversed(rows) if r["default"] and r["M"] == m
                        and r["layer"] == name)
            log(f"sweep {shape_of(name):26s} M={m:5d} cublas {cublas:8.2f}us default "
                f"{dflt:8.2f}us")
            for s, (us, cfg) in sorted(best.items()):
                log(f"    best S={s:2d}: {us:8.2f}us ({cublas / us:.2f}x cublas) "
                    f"{cfg.block_m}x{cfg.block_n} w{cfg.num_warps} st{cfg.num_stages} "
                    f"{'split' if cfg.split_ctas else 'persistent'} flatten={cfg.flatten} "
                    f"per_sm={cfg.programs_per_sm}")
            del sets
    return rows


# ----------------------------------------------------------------------------- entry point


def run(log: Callable[[str], None] = print) -> dict:
    """Every GPU measurement of the batch-invariant matmul, as one results dict."""
    if not torch.cuda.is_available():
        raise RuntimeError("the matmul benchmark needs a CUDA GPU")
    from benchmarks.suites.cublas_workspace import measure

    result: dict = {"invariance": invariance_rows(log=log)}
    try:
        hf = hf_llama_invariance()
        hf_plain = hf_llama_invariance(mode=False)
    except ImportError as exc:  # transformers missing on this machine
        log(f"hf_llama check skipped: {exc!r}")
    else:
        result["invariance"].append(hf)
        result["hf_llama_without_mode"] = {"cases": hf_plain["cases"],
                                           "mismatches": hf_plain["mismatches"]}
        log(f"invariance hf_llama batch 32: {hf['mismatches']}/{hf['cases']} mismatches "
            f"(without the mode: {hf_plain['mismatches']})")
    result["latency"] = latency_rows(log=log)
    result["summary"] = summarize(result["latency"])
    log(f"summary: {result['summary']}")
    result["cublas_workspace_invariant"] = measure(log=log)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="batch-invariant matmul: invariance, latency vs cuBLAS, config sweep (GPU)")
    parser.add_argument("--out", default="benchmarks/results/matmul.json")
    parser.add_argument("--sweep", action="store_true", help="run the config sweep only")
    parser.add_argument("--layers", default=",".join(SWEEP_LAYERS), help="sweep: layers")
    parser.add_argument("--ms", default=",".join(map(str, SWEEP_M)), help="sweep: row counts")
    parser.add_argument("--paths", default="split,persistent",
                        help="sweep: kernel paths to time (split, persistent)")
    args = parser.parse_args(argv)
    from benchmarks.harness import results_meta, write_results

    command = " ".join(["python -m benchmarks.suites.matmul", *(argv or sys.argv[1:])])
    if args.sweep:
        body = {"sweep": sweep(args.layers.split(","), [int(m) for m in args.ms.split(",")],
                               paths=tuple(args.paths.split(",")))}
    else:
        body = run()
    write_results(args.out, {"meta": results_meta(command), **body})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

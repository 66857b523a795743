"""LoRA kernel study: replay reproducibility, batch invariance and latency (GPU).

Writes ``benchmarks/results/lora_kernels.json``:

    python -m benchmarks.suites.lora_kernels --out benchmarks/results/lora_kernels.json
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import torch

from benchmarks.harness.timing import input_sets_for, time_graph_us
from detlora.ops.adapter_groups import AdapterGroups, group_tokens
from detlora.ops.lora_configs import ShrinkConfig, shrink_config, vllm_default_shrink_config
from detlora.ops.lora_expand import lora_expand
from detlora.ops.lora_shrink import lora_shrink
from detlora.study.replay import replay

REDUCTIONS = ("atomic", "unsplit", "ordered", "ordered_bi", "tree")
DETERMINISTIC = ("unsplit", "ordered", "ordered_bi", "tree")


@dataclass(frozen=True)
class ShrinkProblem:
    m: int
    hidden: int
    rank: int
    slices: int = 1
    adapters: int = 1
    dtype: torch.dtype = torch.bfloat16


@dataclass(frozen=True)
class ShrinkInputs:
    x: torch.Tensor
    lora_a: torch.Tensor
    groups: AdapterGroups
    scale: torch.Tensor


def token_adapters(m: int, adapters: int, device: torch.device, mixed_none: bool = False):
    """Row i uses adapter i % adapters (and every 5th row none, when ``mixed_none``)."""
    ids = torch.arange(m, device=device, dtype=torch.int32) % adapters
    if mixed_none:
        ids[::5] = -1
    return ids


def make_inputs(
    p: ShrinkProblem, device: torch.device, gen: torch.Generator, ids: torch.Tensor | None = None
) -> ShrinkInputs:
    x = torch.randn(p.m, p.hidden, device=device, generator=gen).to(p.dtype)
    a = (torch.randn(p.adapters, p.slices, p.rank, p.hidden, device=device, generator=gen)
         / p.hidden**0.5).to(p.dtype)
    if ids is None:
        ids = token_adapters(p.m, p.adapters, device)
    scale = torch.rand(p.adapters, device=device, generator=gen) + 0.5
    return ShrinkInputs(x, a, group_tokens(ids, p.adapters), scale)


# ----------------------------------------------------------------------------- replay


def replay_rows(
    ms: Iterable[int], hidden: int, rank: int, slices: int, executions: int,
    reductions: Iterable[str] = REDUCTIONS, log: Callable[[str], None] = print,
    device: torch.device | None = None,
) -> list[dict]:
    device = device or torch.device("cuda")
    rows = []
    for m in ms:
        gen = torch.Generator(device=device).manual_seed(1000 + m)
        inp = make_inputs(ShrinkProblem(m, hidden, rank, slices), device, gen)
        for red in reductions:
            out = torch.empty(slices, m, rank, dtype=torch.float32, device=device)
            stats = replay(
                lambda red=red, out=out, inp=inp: lora_shrink(
                    inp.x, inp.lora_a, inp.groups, inp.scale, reduction=red, out=out),
                executions,
            )
            row = {"M": m, "H": hidden, "r": rank, "slices": slices, "reduction": red,
                   **stats.as_dict()}
            rows.append(row)
            log(f"replay M={m:5d} {red:10s} differing {stats.differing}/{stats.comparisons} "
                f"frac={stats.differing_element_fraction:.3g} max={stats.max_abs_diff:.3g}")
    return rows


# ----------------------------------------------------------------------------- invariance


def batch_invariance_rows(
    hidden: int, rank: int, slices: int, m_values: Iterable[int], adapters: int = 4,
    rows_checked: int = 64, log: Callable[[str], None] = print,
    device: torch.device | None = None,
) -> list[dict]:
    """Each row computed alone (M = 1) against the same row inside larger batches."""
    device = device or torch.device("cuda")
    m_values = sorted(m_values)
    m_max = max(m_values)
    gen = torch.Generator(device=device).manual_seed(7)
    p = ShrinkProblem(m_max, hidden, rank, slices, adapters)
    mixed_ids = token_adapters(m_max, adapters, device, mixed_none=True)
    perm = torch.randperm(m_max, device=device, generator=gen)
    mixed_ids = mixed_ids[perm].contiguous()  # adapters interleaved in random order
    uniform_ids = torch.zeros(m_max, dtype=torch.int32, device=device)
    base = make_inputs(p, device, gen, ids=mixed_ids)
    n_out = 3 * 128
    lora_b = (torch.randn(adapters, n_out, rank, device=device, generator=gen) / rank**0.5).to(
        p.dtype)
    y0 = torch.randn(m_max, n_out, device=device, generator=gen).to(p.dtype)
    offsets = [0, 192, 256, 384]  # unequal widths, as GQA q/k/v
    check = list(range(min(rows_checked, m_max)))

    def shrink(red: str, ids: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        g = group_tokens(ids[lo:hi].contiguous(), adapters)
        return lora_shrink(base.x[lo:hi], base.lora_a, g, base.scale, reduction=red)

    def expand(ids: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        g = group_tokens(ids[lo:hi].contiguous(), adapters)
        h = lora_shrink(base.x[lo:hi], base.lora_a[:, :3] if slices >= 3 else base.lora_a, g,
                        base.scale, reduction="ordered_bi")
        y = y0[lo:hi].clone()
        width = offsets if h.shape[0] == 3 else None
        return lora_expand(y, h, lora_b if h.shape[0] == 3 else lora_b[:, : h.shape[0] * 128],
                           g, width)

    results = []
    cases: list[tuple[str, str, Callable]] = []
    for red in ("ordered_bi", "ordered", "unsplit", "atomic"):
        for label, ids in (("uniform", uniform_ids), ("mixed", mixed_ids)):
            cases.append((red, label, lambda lo, hi, red=red, ids=ids: shrink(red, ids, lo, hi)))
    cases.append(("expand", "mixed", lambda lo, hi: expand(mixed_ids, lo, hi)))
    for red, label, fn in cases:
        alone = {i: fn(i, i + 1) for i in check}
        mismatches = 0
        checked = 0
        for m in m_values:
            batch = fn(0, m)
            for i in check:
                if i >= m:
                    continue
                checked += 1
                row_batch = batch[:, i] if batch.dim() == 3 else batch[i]
                row_alone = alone[i][:, 0] if batch.dim() == 3 else alone[i][0]
                if not torch.equal(row_batch, row_alone):
                    mismatches += 1
        results.append({"reduction": red, "adapters": label, "M_values": m_values,
                        "rows_checked": checked, "mismatches": mismatches})
        log(f"invariance {red:10s} {label:7s} rows {checked:5d} mismatches {mismatches}")
    return results


# ----------------------------------------------------------------------------- latency


def _sets(p: ShrinkProblem, device: torch.device) -> list[ShrinkInputs]:
    bytes_per_call = (p.m * p.hidden + p.adapters * p.slices * p.rank * p.hidden) * 2
    n = input_sets_for(bytes_per_call)
    gen = torch.Generator(device=device).manual_seed(p.m * 31 + p.hidden)
    return [make_inputs(p, device, gen) for _ in range(n)]


def time_shrink(
    p: ShrinkProblem, reduction: str, sets: list[ShrinkInputs],
    config: ShrinkConfig | None = None,
) -> float:
    outs = [torch.empty(p.slices, p.m, p.rank, dtype=torch.float32, device=s.x.device)
            for s in sets]
    calls = [
        (lambda s=s, o=o: lora_shrink(s.x, s.lora_a, s.groups, s.scale, reduction=reduction,
                                      out=o, config=config))
        for s, o in zip(sets, outs, strict=False)
    ]
    return time_graph_us(calls)


def time_torch_mm(p: ShrinkProblem, sets: list[ShrinkInputs]) -> float:
    """Floor reference: one dense ``x @ A.T`` for the first adapter, no grouping or scale."""
    ws = [s.lora_a[0].reshape(p.slices * p.rank, p.hidden) for s in sets]
    outs = [torch.empty(p.m, p.slices * p.rank, dtype=p.dtype, device=s.x.device) for s in sets]
    calls = [(lambda s=s, w=w, o=o: torch.mm(s.x, w.t(), out=o))
             for s, w, o in zip(sets, ws, outs, strict=True)]
    return time_graph_us(calls)


def latency_rows(
    ms: Iterable[int], hiddens: Iterable[int], ranks: Iterable[int], slices_list: Iterable[int],
    adapters_list: Iterable[int], log: Callable[[str], None] = print,
    device: torch.device | None = None,
) -> list[dict]:
    device = device or torch.device("cuda")
    rows = []
    for h, r, s, a, m in itertools.product(hiddens, ranks, slices_list, adapters_list, ms):
        p = ShrinkProblem(m, h, r, s, a)
        sets = _sets(p, device)
        line = []
        for red in REDUCTIONS:
            cfg = shrink_config(red, m, h, s * r)
            us = time_shrink(p, red, sets)
            rows.append({"M": m, "H": h, "r": r, "slices": s, "adapters": a, "reduction": red,
                         "split_k": cfg.ctas_along_k(h), "cta_covers": cfg.cta_covers,
                         "us": round(us, 3)})
            line.append(f"{red}={us:.2f}")
        # The paper's Split-K = 1 baseline: vLLM's default tiles with one split.
        vllm1 = replace(vllm_default_shrink_config(m), split_k=1)
        us = time_shrink(p, "unsplit", sets, vllm1)
        rows.append({"M": m, "H": h, "r": r, "slices": s, "adapters": a,
                     "reduction": "unsplit_vllm", "split_k": 1, "cta_covers": "all",
                     "us": round(us, 3)})
        line.append(f"unsplit_vllm={us:.2f}")
        us = time_torch_mm(p, sets)
        rows.append({"M": m, "H": h, "r": r, "slices": s, "adapters": a, "reduction": "torch_mm",
                     "split_k": 1, "cta_covers": "all", "us": round(us, 3)})
        log(f"lat M={m:5d} H={h} r={r:3d} s={s} a={a} " + " ".join(line) + f" mm={us:.2f}")
        del sets
    return rows


def summarize_targets(latency: list[dict]) -> dict:
    """The issue's latency targets, computed from the measured grid."""
    by_point: dict[tuple, dict[str, float]] = {}
    for row in latency:
        key = (row["M"], row["H"], row["r"], row["slices"], row["adapters"])
        by_point.setdefault(key, {})[row["reduction"]] = row["us"]
    ord_vs_atomic = {k: v["ordered"] / v["atomic"] for k, v in by_point.items()}
    bi_vs_ord = {k: v["ordered_bi"] / v["ordered"] for k, v in by_point.items()}
    unsplit_vs_ord_small = {k: v["unsplit"] / v["ordered"] for k, v in by_point.items()
                            if k[0] <= 16}
    vllm1_vs_ord_small = {k: v["unsplit_vllm"] / v["ordered"] for k, v in by_point.items()
                          if k[0] <= 16 and "unsplit_vllm" in v}
    worst = max(ord_vs_atomic, key=ord_vs_atomic.get)
    worst_small = min(unsplit_vs_ord_small, key=unsplit_vs_ord_small.get)
    worst_bi = max(bi_vs_ord, key=bi_vs_ord.get)
    keys = ("M", "H", "r", "slices", "adapters")
    return {
        "ordered_over_atomic_median": round(statistics.median(ord_vs_atomic.values()), 4),
        "ordered_over_atomic_max": round(ord_vs_atomic[worst], 4),
        "ordered_over_atomic_max_at": dict(zip(keys, worst, strict=False)),
        "ordered_over_atomic_points_above_1.05": sum(v > 1.05 for v in ord_vs_atomic.values()),
        "unsplit_over_ordered_min_M_le_16": round(unsplit_vs_ord_small[worst_small], 4),
        "unsplit_over_ordered_min_at": dict(zip(keys, worst_small, strict=False)),
        "unsplit_over_ordered_median_M_le_16": round(
            statistics.median(unsplit_vs_ord_small.values()), 4),
        "unsplit_vllm_over_ordered_min_M_le_16": round(min(vllm1_vs_ord_small.values()), 4)
        if vllm1_vs_ord_small else None,
        "unsplit_vllm_over_ordered_median_M_le_16": round(
            statistics.median(vllm1_vs_ord_small.values()), 4) if vllm1_vs_ord_small else None,
        "ordered_bi_over_ordered_median": round(statistics.median(bi_vs_ord.values()), 4),
        "ordered_bi_over_ordered_max": round(bi_vs_ord[worst_bi], 4),
        "ordered_bi_over_ordered_max_at": dict(zip(keys, worst_bi, strict=False)),
        "points": len(by_point),
    }


# ----------------------------------------------------------------------------- sweep


def sweep_rows(
    ms: Iterable[int], hidden: int, rank: int, slices: int, log: Callable[[str], None] = print,
    device: torch.device | None = None,
) -> list[dict]:
    """Time candidate tilings of each reduction (tuning data for lora_configs.py)."""
    device = device or torch.device("cuda")
    rows = []
    n = slices * rank
    for m in ms:
        p = ShrinkProblem(m, hidden, rank, slices)
        sets = _sets(p, device)
        for red, cfg in _candidates(m, hidden, n):
            try:
                us = time_shrink(p, red, sets, cfg)
            except Exception as exc:  # a candidate that does not compile is data, not a crash
                log(f"sweep M={m} {red} {cfg} failed: {exc!r}"[:300])
                continue
            rows.append({"M": m, "H": hidden, "r": rank, "slices": slices, "reduction": red,
                         "config": dict(cfg.__dict__), "us": round(us, 3)})
        best: dict[str, dict] = {}
        for row in rows:
            if row["M"] == m and (row["reduction"] not in best
                                  or row["us"] < best[row["reduction"]]["us"]):
                best[row["reduction"]] = row
        for red, row in best.items():
            log(f"sweep M={m:5d} best {red:10s} {row['us']:.2f}us {row['config']}")
        del sets
    return rows


def _candidates(m: int, hidden: int, n: int) -> list[tuple[str, ShrinkConfig]]:
    """A focused candidate set around the configurations lora_configs.py picks."""
    from detlora.ops.lora_configs import BI_BLOCK_K, BI_GROUP_CHUNKS, CTA_COVERS, ordered_bi_split

    out: list[tuple[str, ShrinkConfig]] = [
        ("atomic", shrink_config("atomic", m, hidden, n)),
        ("unsplit", shrink_config("unsplit", m, hidden, n)),
        ("ordered", shrink_config("ordered", m, hidden, n)),
        ("ordered_bi", shrink_config("ordered_bi", m, hidden, n)),
    ]
    if m <= 64:
        tiles = [(split, 16, 128, w) for split in (8, 12, 16, 24) for w in (2, 4)]
    elif m <= 256:
        tiles = [(split, bm, bk, 2) for split in (4, 8) for bm, bk in ((16, 128), (32, 256))]
    else:
        tiles = [(split, bm, bk, w) for split in (2, 4)
                 for bm, bk, w in ((32, 128, 2), (64, 128, 4), (64, 256, 4))]
    for split, bm, bk, w in tiles:
        if hidden // split >= bk:
            out.append(("ordered", ShrinkConfig(split, bm, 16, bk, w, 3)))
    s_bi = ordered_bi_split(hidden)
    for bm, bn, w, covers in itertools.product((16, 32, 64), (16,), (4,), CTA_COVERS):
        if (covers == "all" and m < 256) or (covers == "chunk" and m > 1024):
            continue
        out.append(("ordered_bi", ShrinkConfig(s_bi, bm, bn, BI_BLOCK_K, w, 3, BI_GROUP_CHUNKS,
                                               covers)))
    return out


# ----------------------------------------------------------------------------- entry point


@dataclass(frozen=True)
class BenchPlan:
    replay_ms: tuple[int, ...] = (1, 8, 64, 256, 2048)
    replay_executions: int = 1000
    invariance_ms: tuple[int, ...] = (2, 3, 16, 64, 257, 1024, 4096)
    latency_ms: tuple[int, ...] = (1, 4, 16, 64, 256, 1024, 4096)
    latency_hiddens: tuple[int, ...] = (2048, 3072, 4096)
    latency_ranks: tuple[int, ...] = (16, 32, 64)
    latency_slices: tuple[int, ...] = (1, 3)
    latency_adapters: tuple[int, ...] = (1, 4)
    sweep_ms: tuple[int, ...] = ()

    @classmethod
    def quick(cls) -> BenchPlan:
        return cls(replay_ms=(1, 256), replay_executions=50, invariance_ms=(2, 17, 300),
                   latency_ms=(1, 64, 1024), latency_hiddens=(3072,), latency_ranks=(16,),
                   latency_slices=(3,), latency_adapters=(1,))


def run(plan: BenchPlan, log: Callable[[str], None] = print, sweep_only: bool = False) -> dict:
    """Every GPU measurement of the LoRA kernel issue, as one results dict."""
    if not torch.cuda.is_available():
        raise RuntimeError("the LoRA kernel benchmark needs a CUDA GPU")
    result: dict = {}
    if plan.sweep_ms:
        result["sweep"] = []
        for hidden, rank, slices in ((3072, 16, 3), (3072, 16, 1), (4096, 64, 1)):
            result["sweep"] += sweep_rows(plan.sweep_ms, hidden, rank, slices, log)
    if sweep_only:
        return result
    result["replay"] = []
    for hidden, rank, slices in ((3072, 16, 3), (4096, 64, 1)):
        result["replay"] += replay_rows(plan.replay_ms, hidden, rank, slices,
                                        plan.replay_executions, log=log)
    result["batch_invariance"] = batch_invariance_rows(3072, 16, 3, plan.invariance_ms, log=log)
    result["latency"] = latency_rows(plan.latency_ms, plan.latency_hiddens, plan.latency_ranks,
                                     plan.latency_slices, plan.latency_adapters, log)
    result["targets"] = summarize_targets(result["latency"])
    log(f"targets: {result['targets']}")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results/lora_kernels.json")
    parser.add_argument("--quick", action="store_true", help="a small grid, for smoke tests")
    parser.add_argument("--sweep", action="store_true", help="also time candidate tilings")
    parser.add_argument("--sweep-only", action="store_true", help="time candidate tilings only")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("the LoRA kernel benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    from benchmarks.harness import results_meta, write_results

    plan = BenchPlan.quick() if args.quick else BenchPlan()
    if args.sweep or args.sweep_only:
        plan = replace(plan, sweep_ms=(1, 16, 64, 256, 1024, 4096))
    command = " ".join(["python -m benchmarks.suites.lora_kernels", *(argv or sys.argv[1:])])
    result = run(plan, sweep_only=args.sweep_only)
    write_results(args.out, {"meta": results_meta(command), **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())

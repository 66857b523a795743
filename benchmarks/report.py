"""Summarise benchmarks/results/*.json as the Markdown tables README.md shows.

    python benchmarks/report.py            # print the tables
    python benchmarks/report.py --readme   # rewrite README.md between the RESULTS markers
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
BEGIN, END = "<!-- RESULTS:BEGIN -->", "<!-- RESULTS:END -->"


def _meta_line(meta: dict) -> str:
    return (f"{meta['gpu']}, driver {meta['driver']}, torch {meta['torch']}, triton "
            f"{meta['triton']}, commit `{meta['commit'][:10]}`, {meta['date']}, "
            f"`{meta['command']}`")


def lora_kernels(path: Path) -> list[str]:
    d = json.loads(path.read_text())
    lines = [f"**LoRA shrink kernels** ({_meta_line(d['meta'])})", ""]
    shapes = sorted({(r["M"], r["H"], r["r"]) for r in d["replay"]})
    lines += [f"Replay on identical inputs, {len(shapes)} shapes (M in "
              f"{sorted({s[0] for s in shapes})}, (H, r) in {sorted({s[1:] for s in shapes})}), "
              f"{d['replay'][0]['comparisons'] + 1} executions each (paper section 5.2):", "",
              "| reduction | differing runs | differing elements | max abs diff |",
              "|---|---|---|---|"]
    by_red: dict[str, list[dict]] = defaultdict(list)
    for row in d["replay"]:
        by_red[row["reduction"]].append(row)
    for red, rows in by_red.items():
        runs = sum(r["differing"] for r in rows)
        comps = sum(r["comparisons"] for r in rows)
        frac = statistics.mean(r["differing_element_fraction"] for r in rows)
        lines.append(f"| {red} | {runs}/{comps} | {frac:.1%} | "
                     f"{max(r['max_abs_diff'] for r in rows):.2g} |")
    lines += ["", "Batch invariance (each row alone vs inside M = "
              f"{d['batch_invariance'][0]['M_values']}):", "",
              "| reduction | adapters | rows checked | mismatches |", "|---|---|---|---|"]
    for row in d["batch_invariance"]:
        lines.append(f"| {row['reduction']} | {row.get('adapters', '')} | "
                     f"{row['rows_checked']} | {row['mismatches']} |")
    by_m: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    points: dict[tuple, dict[str, float]] = defaultdict(dict)
    for row in d["latency"]:
        key = (row["M"], row["H"], row["r"], row["slices"], row["adapters"])
        points[key][row["reduction"]] = row["us"]
    for key, v in points.items():
        for red in ("unsplit", "unsplit_vllm", "ordered_bi", "tree", "torch_mm"):
            if red in v:
                by_m[key[0]][f"{red}/ordered"].append(v[red] / v["ordered"])
        by_m[key[0]]["ordered/atomic"].append(v["ordered"] / v["atomic"])
        by_m[key[0]]["ordered_us"].append(v["ordered"])
    cols = ["ordered_us", "ordered/atomic", "ordered_bi/ordered", "unsplit/ordered",
            "unsplit_vllm/ordered", "tree/ordered"]
    lines += ["", "Latency, CUDA-graph replay, median over H {2048, 3072, 4096} x r {16, 32, 64} "
              "x slices {1, 3} x adapters {1, 4}; a/b is time a over time b (< 1: a is "
              "faster):", "",
              "| M | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for m in sorted(by_m):
        cells = [f"{statistics.median(by_m[m][c]):.2f}" if by_m[m][c] else "-" for c in cols]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    t = d.get("targets", {})
    if t:
        lines += ["", "Targets over all points: ordered/atomic median "
                  f"{t['ordered_over_atomic_median']} (max {t['ordered_over_atomic_max']}, "
                  f"{t['ordered_over_atomic_points_above_1.05']} of {t['points']} points above "
                  f"1.05); unsplit/ordered for M <= 16 median "
                  f"{t['unsplit_over_ordered_median_M_le_16']} (min "
                  f"{t['unsplit_over_ordered_min_M_le_16']}), against vLLM's Split-K=1 tiles "
                  f"median {t.get('unsplit_vllm_over_ordered_median_M_le_16')} (min "
                  f"{t.get('unsplit_vllm_over_ordered_min_M_le_16')}); ordered_bi/ordered median "
                  f"{t['ordered_bi_over_ordered_median']} (max "
                  f"{t['ordered_bi_over_ordered_max']})."]
    return lines


def batch_invariant_ops(path: Path) -> list[str]:
    d = json.loads(path.read_text())
    metas = d.get("meta_parts", {"all": d["meta"]})
    lines = ["**Batch-invariant ops** (" + "; ".join(f"{k}: {_meta_line(v)}"
                                                   for k, v in metas.items()) + ")", "",
             "Invariance (row alone vs the same row inside M in {2, 3, 7, 16, 64, 128, 257, "
             "1024, 4096}; attention also across prefill, chunked prefill, decode, cached "
             "prefix, split KV):", "",
             "| op | check | shapes | cases | mismatches |", "|---|---|---|---|---|"]
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for row in d["invariance"]:
        groups[(row["op"], row["check"])].append(row)
    for (op, check), rows in groups.items():
        lines.append(f"| {op} | {check} | {len(rows)} | {sum(r['cases'] for r in rows)} | "
                     f"{sum(r['mismatches'] for r in rows)} |")
    summary = d.get("matmul", {}).get("summary")
    if summary:
        lo, hi = summary["throughput_vs_cublas_M_le_64"], summary["throughput_vs_cublas_M_ge_256"]
        lines += ["", f"matmul throughput vs cuBLAS (Llama-3.2-3B and Qwen3-0.6B layers): M <= 64 "
                  f"median {lo['median']} (min {lo['min']} at {lo['min_at']}), M >= 256 median "
                  f"{hi['median']} (min {hi['min']} at {hi['min_at']}); targets 0.75 and 0.9."]
    att = d.get("attention", {}).get("summary")
    if att:
        cells = [f"{r['shape']} b{r['M']}: {r['speed_vs_split_kv']}" for r in att
                 if r["M"] == 1]
        lines += ["", "Decode attention speed vs the (non-invariant) split-KV kernel at batch 1: "
                  + ", ".join(cells) + " (target 0.8 at 8k)."]
    t = d.get("rowwise", {}).get("targets")
    if t:
        lines += ["", f"rms_norm share of its bandwidth floor at M >= 256: "
                  f"{t['rms_norm_floor_fraction_M_ge_256']} (target 0.8)."]
    cub = d.get("cublas_workspace_invariant")
    if cub:
        lines += ["", "cuBLAS bf16 `torch.mm` batch-invariant (row 0 at M = 1 vs inside larger M):",
                  "", "| weight N x K | default | CUBLAS_WORKSPACE_CONFIG=:16:8 |", "|---|---|---|"]
        small = cub.get(":16:8", {})
        for shape, invariant in cub.get("default", {}).items():
            lines.append(f"| {shape} | {invariant} | {small.get(shape)} |")
    return lines


def engine(path: Path) -> list[str]:
    d = json.loads(path.read_text())
    lines = [f"**Engine, Llama-3.2-3B shape, random bf16 weights, rank-16 adapter on all seven "
             f"projections** ({_meta_line(d['meta'])})", "",
             f"Roofline: {d['roofline']['weight_bytes'] / 1e9:.2f} GB of weights over "
             f"{d['roofline']['copy_TBps']:.2f} TB/s copy = "
             f"{d['roofline']['batch1_tpot_floor_ms']:.2f} ms per token at batch 1.", ""]
    if d["meta"].get("note"):
        lines += [f"Note: {d['meta']['note']}", ""]
    lines += ["| mode | batch | output tok/s | TPOT ms | prefill tok/s |", "|---|---|---|---|---|"]
    for r in d["throughput"]:
        lines.append(f"| {r['mode']} | {r['batch']} | {r['output_tok_per_s']:.0f} | "
                     f"{r['tpot_ms']:.2f} | {r['prefill_tok_per_s']:.0f} |")
    lines += ["", "Determinism: outputs (token ids and logprobs, exact) that differ from the "
              "reference run:", "", "| mode | check | differing / comparisons |", "|---|---|---|"]
    for r in d["determinism"]:
        extra = f" (batch {r['batch']})" if "batch" in r and r["check"] == "cross_batch" else ""
        lines.append(f"| {r['mode']} | {r['check']}{extra} | {r['differing']}/{r['comparisons']} |")
    lines += ["", *_engine_targets(d)]
    return lines


def _engine_targets(d: dict) -> list[str]:
    """The issue's targets, computed from the rows (missing rows are skipped)."""
    by = {(r["mode"], r["batch"]): r for r in d["throughput"] if "batch" in r
          and "output_tok_per_s" in r}
    floor = d["roofline"]["batch1_tpot_floor_ms"]
    out = []

    def tok(mode: str, batch: int) -> float | None:
        row = by.get((mode, batch))
        return row["output_tok_per_s"] if row else None

    if ("batch_invariant", 1) in by:
        frac = floor / by[("batch_invariant", 1)]["tpot_ms"]
        out.append(f"batch-1 decode in batch_invariant at {frac:.0%} of the roofline "
                   "(target 65%)")
    if tok("run_to_run", 64):
        out.append(f"run_to_run at batch 64: {tok('run_to_run', 64):.0f} tok/s (target 15000)")
    for mode, target in (("run_to_run", "within 2%"), ("batch_invariant", ">= 0.85x")):
        if tok(mode, 64) and tok("fast", 64):
            out.append(f"{mode} / fast at batch 64: {tok(mode, 64) / tok('fast', 64):.3f} "
                       f"(target {target})")
    if tok("batch_invariant", 64) and tok("hf_peft", 64):
        out.append(f"batch_invariant / HF + PEFT at batch 64: "
                   f"{tok('batch_invariant', 64) / tok('hf_peft', 64):.1f}x (target 40x)")
    return ["Against the targets: " + "; ".join(out) + "."] if out else []


def prefix_caching(path: Path) -> list[str]:
    d = json.loads(path.read_text())
    plan = d["meta"]["plan"]
    lines = [f"**Prefix caching, guardrail workload** ({_meta_line(d['meta'])}): "
             f"{plan['requests']} requests sharing a {plan['shared_len']}-token prompt, "
             f"{plan['unique_len']} tokens each of their own, {plan['verdict_len']} output "
             "tokens.", ""]
    if d["meta"].get("note"):
        lines += [f"Note: {d['meta']['note']}", ""]
    lines += ["| mode | cache | requests/s | prompt tok/s | cached prompt tokens |",
              "|---|---|---|---|---|"]
    for r in d["runs"]:
        lines.append(f"| {r['mode']} | {'on' if r['prefix_caching'] else 'off'} | "
                     f"{r['requests_per_s']:.1f} | {r['prompt_tok_per_s']:.0f} | "
                     f"{r['cached_prompt_tokens']:.0f} / {r['prompt_tokens']} |")
    lines += ["", "Cache on against cache off, token ids and logprobs exact: " + "; ".join(
        f"{r['mode']} {r['differing']}/{r['comparisons']} outputs differ"
        for r in d["determinism"]) + ". Speed-up with the cache: " + ", ".join(
        f"{mode} {x:.1f}x" for mode, x in d.get("speedup", {}).items()) + "."]
    return lines


def other(path: Path) -> list[str]:
    d = json.loads(path.read_text())
    meta = d.get("meta")
    return [f"**{path.stem}**: see `{path.relative_to(ROOT)}`"
            + (f" ({_meta_line(meta)})" if meta else "")]


def tables() -> list[str]:
    out: list[str] = []
    for path in sorted(RESULTS.glob("*.json")):
        if path.name == "lora_kernels.json":
            out += [*lora_kernels(path), ""]
        elif path.name == "batch_invariant_ops.json":
            out += [*batch_invariant_ops(path), ""]
        elif path.name == "engine.json":
            out += [*engine(path), ""]
        elif path.name == "prefix_caching.json":
            out += [*prefix_caching(path), ""]
        elif path.name != "lora_sweep.json":
            out += [*other(path), ""]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--readme", action="store_true")
    args = parser.parse_args()
    text = "\n".join(tables())
    if not args.readme:
        print(text)
        return
    readme = ROOT / "README.md"
    body = readme.read_text()
    start, end = body.index(BEGIN) + len(BEGIN), body.index(END)
    readme.write_text(body[:start] + "\n" + text + "\n" + body[end:])


if __name__ == "__main__":
    main()

"""Write ``docs/results.md`` from the results: one section per study (its current file in
``benchmarks/results/``) with its headline table, where and how it was measured, a link to the
JSON, and the study's runs from ``history.jsonl`` (with their headline figures) for trends.
Every figure comes from those files.

    python -m benchmarks.report            # rewrite docs/results.md
    python -m benchmarks.report --check    # exit 1 if docs/results.md is out of date
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.harness.history import RESULTS_DIR, read_history

ROOT = RESULTS_DIR.parents[1]
DOC = ROOT / "docs" / "results.md"
FIRST = ("engine", "lora_kernels", "batch_invariant_ops", "prefix_caching", "profile_engine")
MAX_ROWS = 20  # rows of a generic table; the JSON has the rest
MAX_COLUMNS = 12
SCALARS = (str, int, float, bool, type(None))


def _short(commit: str, n: int) -> str:
    """A commit's first n characters, keeping a ``-dirty`` mark (``harness.meta.git_commit``)."""
    return commit[:n] + ("-dirty" if commit.endswith("-dirty") else "")


def _meta_line(meta: dict) -> str:
    host = f", host {meta['host']}" if meta.get("host") else ""
    return (f"{meta['gpu']}, driver {meta['driver']}, torch {meta['torch']}, triton "
            f"{meta.get('triton', '?')}{host}, commit `{_short(meta['commit'], 10)}`, "
            f"{meta['date']}, `{meta['command']}`")


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    text = "" if value is None else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|---" * len(header) + "|",
            *("| " + " | ".join(_cell(v) for v in row) + " |" for row in rows)]


def lora_kernels(d: dict) -> list[str]:
    lines: list[str] = []
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


def batch_invariant_ops(d: dict) -> list[str]:
    metas = d.get("meta_parts", {})
    lines = ["Measured in parts: " + "; ".join(f"{k}: {_meta_line(v)}" for k, v in metas.items())
             + ".", ""] if metas else []
    lines += [
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


def engine(d: dict) -> list[str]:
    lines = ["Llama-3.2-3B shape, random bf16 weights, rank-16 adapter on all seven "
             "projections.", "",
             f"Roofline: {d['roofline']['weight_bytes'] / 1e9:.2f} GB of weights over "
             f"{d['roofline']['copy_TBps']:.2f} TB/s copy = "
             f"{d['roofline']['batch1_tpot_floor_ms']:.2f} ms per token at batch 1.", ""]
    lines += ["| mode | batch | output tok/s | TPOT ms | prefill tok/s |", "|---|---|---|---|---|"]
    for r in d["throughput"]:
        lines.append(f"| {r['mode']} | {r['batch']} | {r['output_tok_per_s']:.0f} | "
                     f"{r['tpot_ms']:.2f} | {r['prefill_tok_per_s']:.0f} |")
    lines += ["", "Determinism: outputs (token ids and logprobs, exact) that differ from the "
              "reference run:", "", "| mode | check | differing / comparisons |", "|---|---|---|"]
    for r in d["determinism"]:
        extra = f" (batch {r['batch']})" if "batch" in r and r["check"] == "cross_batch" else ""
        lines.append(f"| {r['mode']} | {r['check']}{extra} | "
                     f"{r['differing']}/{r['comparisons']} |")
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


def prefix_caching(d: dict) -> list[str]:
    plan = d["meta"]["plan"]
    lines = [f"Guardrail workload: {plan['requests']} requests sharing a "
             f"{plan['shared_len']}-token prompt, {plan['unique_len']} tokens each of their "
             f"own, {plan['verdict_len']} output tokens.", ""]
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


def generic(d: dict) -> list[str]:
    """Each top-level list of records as a table (scalar columns, the first rows), each flat
    mapping as key/value lines, each scalar as a line."""
    lines: list[str] = []
    for key, value in d.items():
        if key in ("meta", "meta_parts", "note"):
            continue
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            cols: list[str] = []
            for row in value:
                cols += [k for k, v in row.items() if isinstance(v, SCALARS) and k not in cols]
            cols = cols[:MAX_COLUMNS]
            shown = value[:MAX_ROWS]
            more = f" (the first {MAX_ROWS} of {len(value)})" if len(value) > MAX_ROWS else ""
            lines += [f"`{key}`{more}:", "", *_table(cols, [[r.get(c) for c in cols]
                                                             for r in shown]), ""]
        elif isinstance(value, dict) and value and all(isinstance(v, SCALARS)
                                                       for v in value.values()):
            lines += [f"`{key}`:", "", *_table(["key", "value"], [[k, v] for k, v in
                                                                 value.items()]), ""]
        elif isinstance(value, SCALARS):
            lines += [f"`{key}`: {_cell(value)}", ""]
        else:
            lines += [f"`{key}`: nested data, see the JSON.", ""]
    return lines


RENDERERS: dict[str, Callable[[dict], list[str]]] = {
    "engine": engine, "lora_kernels": lora_kernels,
    "batch_invariant_ops": batch_invariant_ops, "prefix_caching": prefix_caching,
}


def _flatten(figures: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in figures.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


def history_table(rows: list[dict]) -> list[str]:
    """The study's runs, oldest first, with their headline figures."""
    flat = [_flatten(r.get("headline", {})) for r in rows]
    cols: list[str] = []
    for f in flat:
        cols += [k for k in f if k not in cols]
    cols = cols[:MAX_COLUMNS]
    table = []
    for row, f in zip(rows, flat, strict=True):
        source = f"`{row['file']}`" + (f" at `{row['file_at'][:7]}`" if row.get("file_at")
                                       else "")
        table.append([row["date"][:16], f"`{_short(row['commit'], 7)}`", row.get("label", ""),
                      source, *(f.get(c) for c in cols)])
    return _table(["date", "commit", "label", "file", *cols], table)


def section(path: Path, runs: list[dict]) -> list[str]:
    d = json.loads(path.read_text())
    rel = path.relative_to(ROOT).as_posix()
    lines = [f"## {path.stem}", ""]
    if isinstance(d.get("meta"), dict):
        lines += [f"{_meta_line(d['meta'])}; [{rel}](../{rel}).", ""]
        if d["meta"].get("note"):
            lines += [f"Note: {d['meta']['note']}", ""]
    else:
        lines += [f"[{rel}](../{rel}).", ""]
    if d.get("note"):
        lines += [f"Note: {d['note']}", ""]
    try:
        lines += [*RENDERERS.get(path.stem, generic)(d), ""]
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:  # a layout it does not know
        lines += [f"(no table: {type(e).__name__} {e}; see the JSON)", ""]
    if len(runs) > 1:
        lines += [f"Runs in the history ({len(runs)}):", "", *history_table(runs), ""]
    return lines


def render(results_dir: Path = RESULTS_DIR) -> str:
    paths = sorted(results_dir.glob("*.json"),
                   key=lambda p: (FIRST.index(p.stem) if p.stem in FIRST else len(FIRST), p.stem))
    by_study: dict[str, list[dict]] = defaultdict(list)
    for row in read_history(results_dir / "history.jsonl"):
        by_study[row["study"]].append(row)
    lines = ["# Results", "",
             "Generated by `python -m benchmarks.report` from `benchmarks/results/*.json` (one "
             "current file per study) and `benchmarks/results/history.jsonl` (every recorded "
             "run); do not edit by hand. A run's file that is no longer current is in git: "
             "`git show COMMIT:benchmarks/results/FILE`.", "",
             "Studies: " + ", ".join(f"[{p.stem}](#{p.stem})"
                                     for p in paths) + ".", ""]
    for path in paths:
        lines += section(path, sorted(by_study.get(path.stem, []), key=lambda r: r["date"]))
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DOC)
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if the file is not what this would write")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.out.read_text() if args.out.exists() else ""
        if current != text:
            print(f"{args.out} is out of date: run python -m benchmarks.report", file=sys.stderr)
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

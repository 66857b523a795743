"""A results file's headline figures: the few numbers a history row keeps.

Chosen by the file's layout (the suite that wrote it), so that every run of a suite, under any
file name, gets the same figures. A layout not known here has no headline figures ({}).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Headline = dict[str, Any]


def _r(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(float(x), digits)


def engine(d: dict) -> Headline:
    """tok/s at batch 64 and TPOT at batch 1 per level; outputs that differ, per level."""
    out: Headline = {"tok_per_s_b64": {}, "tpot_ms_b1": {}}
    for row in d.get("throughput", []):
        if row.get("batch") == 64 and "output_tok_per_s" in row:
            out["tok_per_s_b64"][row["mode"]] = _r(row["output_tok_per_s"], 1)
        if row.get("batch") == 1 and "tpot_ms" in row:
            out["tpot_ms_b1"][row["mode"]] = _r(row["tpot_ms"])
    differing: dict[str, list[int]] = {}
    for row in d.get("determinism", []):
        pair = differing.setdefault(row["mode"], [0, 0])
        pair[0] += row["differing"]
        pair[1] += row["comparisons"]
    out["differing_outputs"] = {mode: f"{a}/{b}" for mode, (a, b) in differing.items()}
    floor = d.get("roofline", {}).get("batch1_tpot_floor_ms")
    if floor:
        out["batch1_tpot_floor_ms"] = _r(floor)
    return out


def lora_kernels(d: dict) -> Headline:
    """The study's targets (ratios of medians over the latency grid) and invariance."""
    out: Headline = {k: v for k, v in d.get("targets", {}).items()
                     if isinstance(v, int | float) and not isinstance(v, bool)}
    if d.get("batch_invariance"):
        out["batch_invariance_mismatches"] = sum(r["mismatches"] for r in d["batch_invariance"])
    return out


def batch_invariant_ops(d: dict) -> Headline:
    """Invariance mismatches per op, matmul against cuBLAS, attention against split-KV."""
    out: Headline = {}
    per_op: dict[str, int] = {}
    for row in d.get("invariance", []):
        per_op[row["op"]] = per_op.get(row["op"], 0) + row["mismatches"]
    if per_op:
        out["mismatches"] = per_op
    summary = d.get("matmul", {}).get("summary", {})
    for key, name in (("throughput_vs_cublas_M_le_64", "matmul_vs_cublas_M_le_64_median"),
                      ("throughput_vs_cublas_M_ge_256", "matmul_vs_cublas_M_ge_256_median")):
        if key in summary:
            out[name] = summary[key]["median"]
    attention = d.get("attention", {}).get("summary", [])
    b1 = {r["shape"]: r["speed_vs_split_kv"] for r in attention if r["M"] == 1}
    if b1:
        out["attention_vs_split_kv_b1"] = b1
    floor = d.get("rowwise", {}).get("targets", {}).get("rms_norm_floor_fraction_min")
    if floor is not None:
        out["rms_norm_floor_fraction_min"] = floor
    return out


def prefix_caching(d: dict) -> Headline:
    """Requests/s with the cache on and off per level, the speed-up, differing outputs."""
    out: Headline = {"requests_per_s": {}}
    for row in d.get("runs", []):
        key = f"{row['mode']}_cache_{'on' if row['prefix_caching'] else 'off'}"
        out["requests_per_s"][key] = _r(row["requests_per_s"], 1)
    out["speedup"] = {k: _r(v, 2) for k, v in d.get("speedup", {}).items()}
    out["differing_outputs"] = {r["mode"]: f"{r['differing']}/{r['comparisons']}"
                                for r in d.get("determinism", [])}
    return out


def profile(d: dict) -> Headline:
    """Per level and batch: wall ms per step and one decode graph replay (us)."""
    out: Headline = {}
    for row in d.get("rows", []):
        key = f"{row['mode']}_b{row['batch']}"
        fig: Headline = {}
        if row.get("steps"):
            fig["ms_per_step"] = _r(row["total_ms"] / row["steps"])
        if row.get("replay_us") is not None:
            fig["replay_us"] = row["replay_us"]
        out[key] = fig
    return out


def run_ahead_cases(d: dict) -> Headline:
    """Per case: tok/s with run-ahead on and off, and outputs that differ between them."""
    return {row["case"]: {"on_tok_per_s": row["on"]["output_tok_per_s"],
                          "off_tok_per_s": row["off"]["output_tok_per_s"],
                          "differing": row["differing_on_vs_off"]}
            for row in d.get("rows", [])}


def study(d: dict) -> Headline:
    """``detlora study``: per model, generations and decisions changed under atomic and under
    every deterministic configuration, batch_invariant's cross-batch bits, and the best
    deterministic configuration's end-to-end time against atomic."""
    out: Headline = {}
    for model in d.get("meta", {}).get("model", []):
        def total(rows: list[dict], key: str) -> str:
            return f"{sum(r[key] for r in rows)}/{sum(r['comparisons'] for r in rows)}"

        rep = [r for r in d.get("repeat", []) if r["model"] == model]
        dec = [r for r in d.get("decisions", []) if r["model"] == model and r["check"] == "repeat"]
        bi = [r for r in d.get("cross_batch", [])
              if r["model"] == model and r["level"] == "batch_invariant"]
        h: Headline = {
            "repeat_changed_atomic": total([r for r in rep if r["reduction"] == "atomic"],
                                           "changed"),
            "repeat_bits_changed_deterministic": total(
                [r for r in rep if r["reduction"] != "atomic"], "bits_changed"),
            "decisions_changed_atomic": total([r for r in dec if r["reduction"] == "atomic"],
                                              "changed"),
            "cross_batch_bits_changed_batch_invariant": total(bi, "bits_changed"),
        }
        ratios: dict[str, list[float]] = {}
        for r in d.get("performance", []):
            if r["model"] == model and r["reduction"] != "atomic" and "e2e_vs_atomic" in r:
                ratios.setdefault(f"{r['level']}/{r['reduction']}", []).append(r["e2e_vs_atomic"])
        if ratios:
            name, vals = min(ratios.items(), key=lambda kv: sum(kv[1]) / len(kv[1]))
            h["best_deterministic_e2e_vs_atomic"] = {name: _r(sum(vals) / len(vals), 4)}
        out[model] = h
    return out


def _is_study(d: dict) -> bool:
    return {"repeat", "cross_batch", "decisions", "trace"} <= set(d)

def multi_lora(d: dict) -> Headline:
    """Traffic against one adapter per (distribution, max_loras, pass: ``_pass2`` for the
    repeat with the host cache warm); TPOT at max_loras 64 over max_loras 1 per (model,
    level, batch); invariance comparisons that differ (rows marked invalid left out)."""
    out: Headline = {"vs_single": {
        f"{r['distribution']}_max_loras_{r['max_loras']}"
        + ("_pass2" if r.get("pass", 1) == 2 else ""): r["vs_single"]
        for r in d.get("traffic", []) if r["distribution"] != "single"}}
    tpot = {(r["model"], r["level"], r["batch"], r["max_loras"]): r["tpot_ms"]
            for r in d.get("slot_cost", [])}
    ratios = {}
    for (model, level, batch, ml), t in tpot.items():
        one = tpot.get((model, level, batch, 1))
        if ml == 64 and one:
            ratios[f"{model}_{level}_b{batch}"] = _r(t / one)
    if ratios:
        out["tpot_64_over_1"] = ratios
    inv = [r for r in d.get("invariance", []) if "invalid" not in r]
    out["differing_outputs"] = (f"{sum(r['differing'] for r in inv)}/"
                                f"{sum(r['comparisons'] for r in inv)}")
    return out


def evals(d: dict) -> Headline:
    """Loglikelihood requests/s over HTTP at the highest concurrency and its ratio to offline
    scoring; differing samples over every row."""
    rows = d.get("rows", [])
    http = [r for r in rows if r.get("client") == "http" and r["task_type"] == "loglikelihood"]
    out: Headline = {"differing": sum(r.get("differing") or 0 for r in rows),
                     "lm_eval": d.get("lm_eval")}
    if http:
        top = max(http, key=lambda r: r["concurrency"])
        out[f"loglikelihood_per_s_c{top['concurrency']}"] = _r(top["requests_per_s"], 1)
        out["vs_offline"] = _r(top["vs_offline"])
    return out


def _is_evals(d: dict) -> bool:
    rows = d.get("rows")
    return bool(rows) and isinstance(rows[0], dict) and {"task_type", "client",
                                                         "concurrency"} <= set(rows[0])


def audit(d: dict) -> Headline:
    """Serving tok/s with the audit log over without; verify's throughput over offline and
    its verdicts."""
    out: Headline = {"serving_with_log_vs_without": d.get("serving_ratio")}
    for row in d.get("verify", []):
        name = row.get("log", "log")
        out[f"verify_{name}"] = f"{row['identical']}/{row['requests']} identical"
        if row.get("vs_offline") is not None:
            out[f"verify_{name}_vs_offline"] = _r(row["vs_offline"])
    return out


def _is_audit(d: dict) -> bool:
    return "serving" in d and "verify" in d


def small_models(d: dict) -> Headline:
    """Requests a second offline and through the server, TPOT batch_invariant / fast, outputs
    differing from each alone, the demo's runs."""
    out: Headline = {}
    for row in d.get("offline", []):
        out[f"{row['model']}_{row['workload']}_per_s"] = _r(row["per_s"], 1)
    for row in d.get("server", []):
        key = f"{row['model']}_server_{row['workload']}_c{row['concurrency']}"
        out[key] = _r(row["vs_offline"] if row.get("vs_offline") is not None
                      else row["per_s"], 3)
    tpot = {(r["model"], r["level"], r["batch"]): r["tpot_ms"] for r in d.get("levels", [])}
    for (model, level, batch), ms in tpot.items():
        fast = tpot.get((model, "fast", batch))
        if level == "batch_invariant" and fast:
            out[f"{model}_bi_over_fast_b{batch}"] = _r(ms / fast)
    out["differing"] = sum(r.get("differing", 0) for r in d.get("server", []))
    for row in d.get("demo", []):
        out[f"demo_run{row['run']}_s"] = row["seconds"]
    return out


def _is_small_models(d: dict) -> bool:
    return "offline" in d and "levels" in d and "demo" in d


def _is_multi_lora(d: dict) -> bool:
    return "traffic" in d and "slot_cost" in d


def _is_engine(d: dict) -> bool:
    return "throughput" in d and "roofline" in d


def _is_lora_kernels(d: dict) -> bool:
    return "batch_invariance" in d and "replay" in d


def _is_batch_invariant_ops(d: dict) -> bool:
    return "invariance" in d and "latency" in d


def _is_prefix_caching(d: dict) -> bool:
    return "runs" in d and "speedup" in d


def _is_profile(d: dict) -> bool:
    rows = d.get("rows")
    return bool(rows) and isinstance(rows[0], dict) and {"mode", "batch", "total_ms"} <= set(
        rows[0])


def _is_run_ahead_cases(d: dict) -> bool:
    rows = d.get("rows")
    return bool(rows) and isinstance(rows[0], dict) and {"case", "on", "off"} <= set(rows[0])


def architectures(d: dict) -> Headline:
    """Per model: batch-1 TPOT and roofline share per level, batch_invariant over fast at
    batch 1 and 64, outputs that differ per level."""
    out: Headline = {"tpot_ms_b1": {}, "roofline_b1": {}, "bi_vs_fast": {}, "differing": {}}
    for r in d.get("rows", []):
        key = f"{r['model']}_{r['level']}"
        out["tpot_ms_b1"][key] = _r(r.get("tpot_b1_ms"))
        out["roofline_b1"][key] = _r(r.get("roofline_b1"))
        out["differing"][key] = f"{r['differing']}/{r['comparisons']}"
        if r["level"] == "batch_invariant":
            out["bi_vs_fast"][r["model"]] = {"b1": _r(r.get("bi_vs_fast_b1")),
                                             "b64": _r(r.get("bi_vs_fast_b64"))}
    return out


def _is_architectures(d: dict) -> bool:
    rows = d.get("rows")
    return bool(rows) and isinstance(rows[0], dict) and {
        "model", "family", "level", "tpot_b1_ms"} <= set(rows[0])


LAYOUTS: tuple[tuple[Callable[[dict], bool], Callable[[dict], Headline]], ...] = (
    (_is_study, study),
    (_is_small_models, small_models),
    (_is_multi_lora, multi_lora),
    (_is_engine, engine),
    (_is_lora_kernels, lora_kernels),
    (_is_batch_invariant_ops, batch_invariant_ops),
    (_is_prefix_caching, prefix_caching),
    (_is_profile, profile),
    (_is_run_ahead_cases, run_ahead_cases),
    (_is_evals, evals),
    (_is_audit, audit),
    (_is_architectures, architectures),
)


def headline(result: dict) -> Headline:
    """The headline figures of a results dict, by its layout; {} for an unknown layout."""
    for matches, figures in LAYOUTS:
        if matches(result):
            return figures(result)
    return {}

"""``study.md``: the study's tables with the paper's figures beside them, its figures, and the
targets it was run to check. Everything is read from the study's JSON (``StudyResult``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from detlora.study import paper
from detlora.study.plan import LEVEL_DEFAULTS


def pct(part: int, whole: int) -> str:
    if not whole:
        return "-"
    return f"{part}/{whole} ({100 * part / whole:.2f}%)"


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join("" if c is None else str(c) for c in row) + " |" for row in rows]
    return [*out, ""]


def _g(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}g}"


def targets(data: dict) -> list[tuple[str, str]]:
    """(target, what this study measured) for the issue's targets."""
    out = []
    rep = data["repeat"]
    atomic = [r for r in rep if r["reduction"] == "atomic"]
    det = [r for r in rep if r["reduction"] != "atomic"]
    reps = data["replay"]
    atomic_replay = sum(r["differing"] for r in reps if r["reduction"] == "atomic")
    out.append(("atomic visibly non-reproducible in replay and generation",
                f"replay {atomic_replay} differing; generation "
                f"{sum(r['changed'] for r in atomic)} of {sum(r['comparisons'] for r in atomic)} "
                "changed" if reps or atomic else "not measured"))
    det_replay = sum(r["differing"] for r in reps if r["reduction"] != "atomic")
    det_dec = sum(r["changed"] for r in data["decisions"]
                  if r["reduction"] != "atomic" and r["check"] == "repeat")
    out.append(("every deterministic reduction and level: 0 changes in replay, repetition and "
                "decisions", f"replay {det_replay}, repetition "
                f"{sum(r['bits_changed'] for r in det)} (bits), decisions {det_dec}"))
    bi = [r for r in data["cross_batch"] if r["level"] == "batch_invariant"]
    out.append(("batch_invariant: 0 changes across batch sizes, order, chunking, preemption "
                "and cache state", (f"{sum(r['bits_changed'] for r in bi)} of "
                                    f"{sum(r['comparisons'] for r in bi)} (bits) over "
                                    f"{len(bi)} checks") if bi else "not measured"))
    perf = [r for r in data["performance"] if r.get("e2e_vs_atomic") is not None
            and r["reduction"] != "atomic"]
    if perf:
        # Per model: one model's best configuration says nothing of another's.
        by: dict[str, dict[str, list[float]]] = {}
        for r in perf:
            by.setdefault(r["model"], {}).setdefault(
                f"{r['model']}: {r['level']}/{r['reduction']}", []).append(r["e2e_vs_atomic"])
        best = []
        for configs in by.values():
            name, ratios = min(configs.items(), key=lambda kv: sum(kv[1]) / len(kv[1]))
            best.append(f"{name}: end-to-end time {100 * (sum(ratios) / len(ratios) - 1):+.2f}%"
                        f" against atomic on average over batches (worst "
                        f"{100 * (max(ratios) - 1):+.2f}%)")
        out.append(("the best deterministic reduction within 2% of atomic end to end",
                    "; ".join(best)))
    else:
        out.append(("the best deterministic reduction within 2% of atomic end to end",
                    "not measured (needs a GPU)"))
    return out


def render(data: dict, figures: Sequence[str]) -> str:
    meta = data["meta"]
    lines = ["# detlora study: reproducibility of LoRA inference", ""]
    where = meta.get("gpu") or "CPU"
    runs = meta.get("merged_from") or []
    produced = (f"Merged from {len(runs)} runs (`detlora study --merge`)" if runs
                else f"Produced by `{meta['command']}`")
    lines += [
        f"{produced} on {where} at {meta['date']} (detlora "
        f"{meta['detlora']}, commit {str(meta.get('commit'))[:12]}, torch {meta['torch']}, "
        f"triton {meta['triton']}{', CUDA ' + meta['cuda'] if meta.get('cuda') else ''}), in "
        f"{meta.get('seconds', '-')} s{' in all' if runs else ''}"
        f"{' (quick form)' if meta['quick'] else ''}.",
        "",
    ]
    if runs:
        lines += [f"- `{r['command']}` at {r['date']}, {r.get('seconds', '-')} s" for r in runs]
        lines += [""]
    lines += [
        f"The paper's figures are from {paper.CITATION}, measured in vLLM on an NVIDIA RTX PRO "
        "6000 Blackwell; its Atomic Split-K=8 is detlora's `atomic`, Split-K=1 `unsplit`, "
        "Deterministic Split-K=8 `ordered`.",
        "",
        f"Tasks: {meta['tasks']}. The paper used GSM8K, MBPP and Civil Comments; none can be "
        "downloaded here, so the study writes its own with checkable answers (`--prompts "
        "FILE.jsonl` takes yours: one `{\"prompt\": ...}` per line, with `\"answer\"` or "
        "`\"tests\"` to check). Code answers run in a sandbox: "
        f"{meta['sandbox']}.",
        "",
    ]
    by_model = meta.get("sections_by_model")  # a merged study: not every model has all
    lines += _table(["model", "adapter", *(["sections"] if by_model else []),
                     "fingerprints (level/reduction: fingerprint)"], [
        (m, meta["adapter"].get(m, "-"),
         *([", ".join(by_model.get(m, []))] if by_model else []), "<br>".join(
            f"{k}: `{v}`" for k, v in meta["fingerprint"].get(m, {}).items()))
        for m in meta["model"]])
    plan = meta["plan"]
    lines += [f"Plan: {plan['prompts']} prompts x {plan['repetitions']} repetitions of "
              f"{plan['max_tokens']} tokens; cross-batch {plan['cross_prompts']} prompts x "
              f"{plan['cross_tokens']} tokens in batches {plan['cross_batches']}; "
              f"{plan['comments']} comments x {plan['repetitions']}; replay "
              f"{plan['replay_executions']} executions at M = {plan['replay_rows']}; trace "
              f"up to {plan['trace_runs']} repetitions; performance at batches "
              f"{plan['perf_batches']}, {plan['perf_tokens']} tokens, {plan['perf_trials']} "
              "trials. All generation is greedy.", ""]
    for note in meta.get("notes", []):
        lines += [f"> {note}", ""]
    for err in meta.get("errors", []):
        lines += [f"> ERROR in {err['section']} on {err['model']}: {err['error']}", ""]
    lines += ["## Targets", ""]
    lines += _table(["target", "measured"], targets(data))
    lines += _replay(data) + _repeat(data) + _cross(data) + _decisions(data)
    lines += _trace(data) + _performance(data)
    if figures:
        lines += ["## Figures", ""] + [f"![{f}]({f})" for f in figures] + [""]
    return "\n".join(lines)


def _replay(data: dict) -> list[str]:
    lines = ["## 1. Identical-input shrink replay", "",
             "Each shrink of the model's shapes (q|k|v and down projection, the adapter's "
             "rank) run N times on the same inputs; executions 1..N-1 compared with 0, bit for "
             "bit. `in_gemm` replays x [W; A]^T through cuBLAS.", ""]
    rows = data["replay"]
    if not rows:
        return [*lines, "Not run.", ""]
    by: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        by.setdefault((r["model"], r["reduction"]), []).append(r)
    table = []
    for (model, red), rs in by.items():
        dec = [r for r in rs if r["phase"] == "decode"]
        pre = [r for r in rs if r["phase"] == "prefill"]
        table.append((model, red, pct(sum(r["differing"] for r in rs),
                                      sum(r["comparisons"] for r in rs)),
                      pct(sum(r["differing"] for r in dec), sum(r["comparisons"] for r in dec)),
                      pct(sum(r["differing"] for r in pre), sum(r["comparisons"] for r in pre)),
                      _g(max(r["max_abs_diff"] for r in rs)),
                      paper.REPLAY.get(red, "-")))
    return lines + _table(["model", "reduction", "differing", "decode (M=1)", "prefill",
                           "max abs diff", "paper"], table)


def _repeat(data: dict) -> list[str]:
    lines = ["## 2. Repeated generation", "",
             "All prompts in one call per repetition (a fixed batch), prefix cache cold; "
             "repetitions 1..R-1 against 0. `changed`: token ids differ; `bits`: token ids or "
             "logprobs differ; `answers`: the extracted answer (number, or the code's test "
             "outcome) differs; `flips`: its correctness differs.", ""]
    rows = data["repeat"]
    if not rows:
        return [*lines, "Not run.", ""]
    table = [(r["model"], f"{r['level']}/{r['reduction']}", r["task"],
              pct(r["changed"], r["comparisons"]), r["bits_changed"], r["answers_changed"],
              r["correctness_flips"], r.get("correct_first", "-"),
              paper.REPEAT.get((r["task"], r["reduction"]), "-")) for r in rows]
    return lines + _table(["model", "configuration", "task", "changed", "bits", "answers",
                           "flips", "correct (rep 0)", "paper"], table)


def _cross(data: dict) -> list[str]:
    lines = ["## 3. Batch size, order and engine state", "",
             "Each prompt alone (cold cache) is the reference; every check runs the same "
             "prompts otherwise and counts outputs whose token ids differ (bits: or logprobs). "
             "`batch_B_repeat` compares two runs at the same batch (the paper's fixed-batch "
             "column). The chunked, preemption and cache engines run eagerly. Levels run their "
             f"default reductions ({', '.join(f'{k}: {v}' for k, v in LEVEL_DEFAULTS.items())})."
             "", ""]
    rows = data["cross_batch"]
    if not rows:
        return [*lines, "Not run.", ""]
    levels = list(dict.fromkeys(r["level"] for r in rows))
    keys = list(dict.fromkeys((r["model"], r["check"]) for r in rows))
    table = []
    for model, check in keys:
        cells = []
        for lv in levels:
            r = next((x for x in rows if x["model"] == model and x["check"] == check
                      and x["level"] == lv), None)
            cells.append("-" if r is None else
                         f"{pct(r['changed'], r['comparisons'])}, bits {r['bits_changed']}")
        if check.endswith("_repeat"):
            ref = (f"fixed batch: atomic {paper.CROSS_BATCH_FIXED['atomic']}, SK1 / Det. SK8 "
                   "0")
        elif check.startswith("batch_"):
            ref = (f"atomic {paper.CROSS_BATCH_CHANGED['atomic']}, SK1 "
                   f"{paper.CROSS_BATCH_CHANGED['unsplit']}, Det. SK8 "
                   f"{paper.CROSS_BATCH_CHANGED['ordered']}")
        else:
            ref = "-"
        table.append((model, check, *cells, ref))
    return lines + _table(["model", "check", *levels, "paper (batch 16/32/64 vs 1)"], table)


def _decisions(data: dict) -> list[str]:
    lines = ["## 4. Structured decisions", "",
             "\"Is this comment toxic?\" over seeded comments, read as `LLM.decide` reads a "
             "noul question: P(yes) from the first reply token's raw logprobs at the labels "
             "yes/no, renormalised. `repeat`: R runs at a fixed batch against the first; "
             "`batch_sizes`: batched runs against each comment alone. A "
             "decision is P(yes) >= 0.5.", ""]
    rows = data["decisions"]
    if not rows:
        return [*lines, "Not run.", ""]
    table = []
    for r in rows:
        p = paper.DECISIONS.get(r["reduction"]) if r["check"] == "repeat" else None
        ref = "-" if p is None else (f"{p['changed']}, mean {p['mean_abs_drift']}, max "
                                     f"{p['max_abs_drift']}, flips {p['flips']}, accuracy "
                                     f"{p['accuracy']}")
        table.append((r["model"], f"{r['level']}/{r['reduction']}", r["check"],
                      pct(r["changed"], r["comparisons"]), _g(r["mean_abs_drift"]),
                      _g(r["max_abs_drift"]), r["flips"],
                      "-" if r.get("accuracy") is None else f"{100 * r['accuracy']:.1f}%", ref))
    return lines + _table(["model", "configuration", "check", "probability changed",
                           "mean abs drift", "max abs drift", "flips", "accuracy", "paper"],
                          table)


def _trace(data: dict) -> list[str]:
    lines = ["## 5. Trace of a divergence", "", f"Paper: {paper.TRACE}", ""]
    entries = data["trace"].get("per_model", [])
    if not entries:
        return [*lines, "Not run.", ""]
    for e in entries:
        lines.append(f"### {e['model']} ({e['level']}/{e['reduction']}, eager, the repeat "
                     "section's batch)")
        lines.append("")
        if not e.get("found"):
            lines += [f"{e.get('note', 'no divergence found')}: nothing to trace.", ""]
            continue
        ta, tb = e["token_a"] or {}, e["token_b"] or {}
        la, lb = e.get("logits_run_a") or {}, e.get("logits_run_b") or {}
        lines += [
            f"Prompt {e['prompt_index']} of the batch, repetitions {e['pair'][0]} and "
            f"{e['pair'][1]}: the first "
            f"{e['first_differing_token']} output tokens agree; token "
            f"{e['first_differing_token']} (position {e['position']}) is "
            f"{ta.get('text')!r} (id {ta.get('id')}) in run A and {tb.get('text')!r} (id "
            f"{tb.get('id')}) in run B.",
            "",
            f"Logits there: run A {_g(la.get('logit_a'), 6)} vs {_g(la.get('logit_b'), 6)} "
            f"(margin {_g(la.get('margin'), 3)}); run B {_g(lb.get('logit_a'), 6)} vs "
            f"{_g(lb.get('logit_b'), 6)} (margin {_g(lb.get('margin'), 3)}).",
            "",
        ]
        f = e.get("first_shrink_difference")
        if f:
            lines += [f"First differing shrink output: step {f['step']}, `{f['layer_name']}`, "
                      f"position {f['position']}: {f['value_a']!r} against {f['value_b']!r} "
                      f"({_g(f['abs_diff'])} apart).", ""]
        lines += _table(["layer", "shrink max abs diff", "shrink elements differing",
                         "K max abs diff", "K differing", "V max abs diff", "V differing"],
                        [(x["layer"], _g(x["shrink_max_abs"]), x["shrink_differing"],
                          _g(x["k_max_abs"]), x["k_differing"], _g(x["v_max_abs"]),
                          x["v_differing"]) for x in e["layers"]])
        c = e.get("controlled")
        if c and "skipped" in c:
            lines += [f"Controlled experiment: not run ({c['skipped']}).", ""]
        elif c:
            rows = []
            for name in ("from_cache_a", "from_cache_b"):
                x = c[name]
                rows.append((name.replace("_", " "), f"{x['token']['text']!r}",
                             _g(x["logit_a"], 6), _g(x["logit_b"], 6), x["repeatable"],
                             x.get("answer", "-"), x.get("correct", "-")))
            lines += [f"Controlled experiment: {c['level']}/{c['reduction']} continues from "
                      "each run's KV cache (all positions before the last shared token), "
                      f"{c['trials']} trials each. The cache alone "
                      f"{'changes' if c['token_changed_by_cache'] else 'does not change'} the "
                      "token.", ""]
            lines += _table(["continue", "token", "logit of A's token", "logit of B's token",
                             "repeatable", "answer", "correct"], rows)
    return lines


def _performance(data: dict) -> list[str]:
    lines = ["## 6. Performance", "", f"Paper: {paper.PERFORMANCE}", ""]
    rows = data["performance"]
    if not rows:
        return [*lines, "Not measured (needs a GPU).", ""]
    table = [(r["model"], f"{r['level']}/{r['reduction']}", r["batch"], f"{r['tpot_ms']:.3f}",
              f"{r['output_tok_per_s']:.0f}", _g(r.get("e2e_vs_atomic"), 4),
              _g(r.get("tpot_vs_atomic"), 4)) for r in rows]
    return lines + _table(["model", "configuration", "batch", "TPOT ms", "output tok/s",
                           "end-to-end / atomic", "TPOT / atomic"], table)


def write_report(result: Any, out: Path) -> list[str]:
    """Render the figures (when matplotlib is there) and study.md; the figure file names."""
    from detlora.study.figures import render_figures

    data = result.as_json()
    try:
        figures = render_figures(data, out)
    except ImportError:
        figures = []
        data["meta"]["notes"].append("figures skipped: matplotlib is not installed (`detlora "
                                     "study --render DIR` draws them from study.json)")
    (out / "study.md").write_text(render(data, figures))
    return figures

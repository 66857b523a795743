"""The study's PNG figures (matplotlib, no display needed): change rates per configuration,
the decision drift histogram, latency against atomic, and the divergence trace per layer."""

from __future__ import annotations

from pathlib import Path


def render_figures(data: dict, out: Path) -> list[str]:
    """Write every figure the data allows into ``out``; their file names, in report order."""
    import matplotlib

    matplotlib.use("Agg")
    names = []
    for name, fn in (("changes.png", _changes), ("drift.png", _drift),
                     ("latency.png", _latency), ("trace.png", _trace)):
        if fn(data, out / name):
            names.append(name)
    return names


def _save(fig, path: Path) -> bool:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return True


def _changes(data: dict, path: Path) -> bool:
    import matplotlib.pyplot as plt

    rep, cross = data["repeat"], data["cross_batch"]
    if not rep and not cross:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    ax = axes[0]
    keys = list(dict.fromkeys((r["model"], r["level"], r["reduction"]) for r in rep))
    tasks = list(dict.fromkeys(r["task"] for r in rep))
    width = 0.8 / max(1, len(tasks))
    for t, task in enumerate(tasks):
        vals = []
        for k in keys:
            r = next((x for x in rep if (x["model"], x["level"], x["reduction"]) == k
                      and x["task"] == task), None)
            vals.append(0.0 if r is None or not r["comparisons"]
                        else 100 * r["changed"] / r["comparisons"])
        ax.bar([i + t * width for i in range(len(keys))], vals, width, label=task)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(keys))])
    ax.set_xticklabels([f"{lv}/{red}" + (f"\n{m}" if len({k[0] for k in keys}) > 1 else "")
                        for m, lv, red in keys], rotation=45, ha="right", fontsize=7)
    ax.set_ylabel("generations changed (%)")
    ax.set_title("Repeated generation: changed against repetition 0")
    if tasks:
        ax.legend(fontsize=8)
    ax = axes[1]
    checks = list(dict.fromkeys(r["check"] for r in cross))
    levels = list(dict.fromkeys(r["level"] for r in cross))
    width = 0.8 / max(1, len(levels))
    for j, lv in enumerate(levels):
        vals = []
        for c in checks:
            rs = [x for x in cross if x["check"] == c and x["level"] == lv]
            n = sum(x["comparisons"] for x in rs)
            vals.append(0.0 if not n else 100 * sum(x["changed"] for x in rs) / n)
        ax.bar([i + j * width for i in range(len(checks))], vals, width, label=lv)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(checks))])
    ax.set_xticklabels(checks, rotation=45, ha="right", fontsize=7)
    ax.set_ylabel("outputs changed against alone (%)")
    ax.set_title("Batch size, order and engine state")
    if levels:
        ax.legend(fontsize=8)
    return _save(fig, path)


def _drift(data: dict, path: Path) -> bool:
    import matplotlib.pyplot as plt

    rows = data["decisions"]
    if not rows:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    drawn = False
    for r in rows:
        drifts = r.get("drift_values") or []
        if drifts:
            import math

            ax.hist([math.log10(d) for d in drifts], bins=30, alpha=0.6,
                    label=f"{r['level']}/{r['reduction']} {r['check']} (n={len(drifts)})")
            drawn = True
    if drawn:
        ax.set_xlabel("log10 |P(yes) drift| (changed comparisons)")
        ax.set_ylabel("comparisons")
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no decision probability changed in any configuration",
                ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
    ax.set_title("Structured decisions: probability drift")
    return _save(fig, path)


def _latency(data: dict, path: Path) -> bool:
    import matplotlib.pyplot as plt

    rows = [r for r in data["performance"] if r.get("e2e_vs_atomic") is not None]
    if not rows:
        return False
    keys = list(dict.fromkeys((r["model"], r["level"], r["reduction"]) for r in rows))
    batches = sorted({r["batch"] for r in rows})
    fig, ax = plt.subplots(figsize=(max(7, len(keys)), 4.5))
    width = 0.8 / len(batches)
    for j, b in enumerate(batches):
        vals = []
        for k in keys:
            r = next((x for x in rows if (x["model"], x["level"], x["reduction"]) == k
                      and x["batch"] == b), None)
            vals.append(0.0 if r is None else 100 * (r["e2e_vs_atomic"] - 1))
        ax.bar([i + j * width for i in range(len(keys))], vals, width, label=f"batch {b}")
    ax.axhline(2.0, color="gray", linestyle="--", linewidth=0.8)
    ax.axhline(0.0, color="black", linewidth=0.6)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(keys))])
    ax.set_xticklabels([f"{lv}/{red}" + (f"\n{m}" if len({k[0] for k in keys}) > 1 else "")
                        for m, lv, red in keys], rotation=45, ha="right", fontsize=7)
    ax.set_ylabel("end-to-end time vs atomic (%)")
    ax.set_title("Performance against atomic (dashed: +2%)")
    ax.legend(fontsize=8)
    return _save(fig, path)


def _trace(data: dict, path: Path) -> bool:
    import matplotlib.pyplot as plt

    entries = [e for e in data["trace"].get("per_model", []) if e.get("found")]
    if not entries:
        return False
    fig, axes = plt.subplots(1, len(entries), figsize=(7 * len(entries), 4.5), squeeze=False)
    for ax, e in zip(axes[0], entries, strict=True):
        layers = [x["layer"] for x in e["layers"]]
        for key, label in (("shrink_max_abs", "shrink output"), ("k_max_abs", "K cache"),
                           ("v_max_abs", "V cache")):
            vals = [x[key] if x[key] > 0 else float("nan") for x in e["layers"]]
            ax.plot(layers, vals, marker="o", label=label)
        ax.set_yscale("log")
        ax.set_xlabel("layer")
        ax.set_ylabel("max |run A - run B| up to the differing token")
        ta, tb = (e.get("token_a") or {}).get("text"), (e.get("token_b") or {}).get("text")
        ax.set_title(f"{e['model']}: token {e['first_differing_token']} {ta!r} vs {tb!r}",
                     fontsize=9)
        ax.legend(fontsize=8)
    return _save(fig, path)

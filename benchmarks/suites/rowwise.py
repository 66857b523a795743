"""Row-wise kernel study (GPU): batch invariance of every row-wise op, and latency of RMSNorm
and log-softmax against the bandwidth floor and a device-to-device copy of the same bytes.

``run()`` returns ``{"invariance": [...], "latency": [...], "targets": {...}}``:
    invariance  {"op", "shape", "check": "batch_sizes", "cases", "mismatches"}: each of the
                first rows computed alone (M = 1) against the same row inside every larger M.
    latency     {"op", "shape", "M", "impl", "us"}; impl is "detlora" (measured), "torch"
                (measured, the eager torch op, no invariance promise), "copy" (measured
                ``copy_`` moving the same bytes) or "floor" (bytes moved / 4.3e12 B/s).
    targets     the fraction of the floor that rms_norm and fused_add_rms_norm reach at
                M >= 256 (target: >= 0.8).

``rms_norm_sweep()`` (not part of ``run()``) times both RMSNorm ops over a grid of
``RmsNormConfig`` tilings, to choose ``rms_norm_config``'s defaults:

    python -m benchmarks.suites.rowwise --out out/rowwise.json     # run()
    python -m benchmarks.suites.rowwise --rms-sweep --hiddens 1024,3072 --ms 1024,4096 \
        --rows 1,2 --warps 4,8,16,32 --out out/rms_norm_warps.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from benchmarks.harness.timing import input_sets_for, time_graph_us
from detlora.ops.embedding import embedding
from detlora.ops.reductions import argmax, mean
from detlora.ops.rms_norm import (
    RmsNormConfig,
    check_rms_norm_config,
    fused_add_rms_norm,
    rms_norm,
    rms_norm_config,
)
from detlora.ops.rotary import rope_cos_sin_cache, rotary
from detlora.ops.silu_and_mul import silu_and_mul
from detlora.ops.softmax import log_softmax, softmax

HBM_BYTES_PER_S = 4.3e12  # H200
BATCH_SIZES = (2, 3, 7, 16, 64, 128, 257, 1024, 4096)
ROWS_CHECKED = 32
LATENCY_MS = (1, 4, 16, 64, 256, 1024, 4096)
SOFTMAX_MS = (1, 64, 256)
SWEEP_HIDDENS = (1024, 3072)
SWEEP_MS = (1024, 4096)
SWEEP_ROWS = (1, 2, 4, 8)
SWEEP_WARPS = (1, 2, 4, 8)
EPS = 1e-5
DTYPE = torch.bfloat16
LLAMA3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


# ----------------------------------------------------------------------------- invariance


@dataclass(frozen=True)
class RowCase:
    """One op on one shape: ``setup(m_max)`` builds inputs once; ``call(inputs, m)`` runs the
    op on the first m rows and returns its outputs, each with rows on the first axis."""

    op: str
    shape: str
    setup: Callable[[int, torch.Generator], object]
    call: Callable[[object, int, int], Sequence[torch.Tensor]]


def _randn(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(DTYPE)


def _rms_cases(hidden: int) -> list[RowCase]:
    def setup(m: int, g: torch.Generator):
        return _randn(g, m, hidden, scale=3), _randn(g, m, hidden), _randn(g, hidden) + 1

    return [
        RowCase("rms_norm", f"H={hidden}", setup,
                lambda d, lo, hi: (rms_norm(d[0][lo:hi], d[2], EPS),)),
        RowCase("fused_add_rms_norm", f"H={hidden}", setup,
                lambda d, lo, hi: fused_add_rms_norm(d[0][lo:hi], d[1][lo:hi], d[2], EPS)),
    ]


def _rotary_case(hq: int, hk: int, d: int) -> RowCase:
    cos_sin = rope_cos_sin_cache(d, 8192, 500000.0, LLAMA3).cuda()

    def setup(m: int, g: torch.Generator):
        qkv = _randn(g, m, (hq + 2 * hk) * d)  # q and k as views of a fused qkv output
        pos = torch.randint(0, 8192, (m,), device="cuda", generator=g)
        return qkv, pos

    def call(data, lo: int, hi: int):
        qkv, pos = data
        q = qkv[lo:hi, : hq * d].view(hi - lo, hq, d)
        k = qkv[lo:hi, hq * d: (hq + hk) * d].view(hi - lo, hk, d)
        return rotary(q, k, pos[lo:hi], cos_sin, validate=False)

    return RowCase("rotary", f"Hq={hq},Hk={hk},D={d}", setup, call)


def _row_op_case(name: str, fn: Callable[[torch.Tensor], torch.Tensor], width: int,
                 scale: float = 1.0) -> RowCase:
    return RowCase(name, f"N={width}", lambda m, g: _randn(g, m, width, scale=scale),
                   lambda x, lo, hi: (fn(x[lo:hi]),))


def _embedding_case(vocab: int, hidden: int) -> RowCase:
    def setup(m: int, g: torch.Generator):
        ids = torch.randint(0, vocab, (m,), device="cuda", generator=g)
        return ids, _randn(g, vocab, hidden)

    return RowCase("embedding", f"V={vocab},H={hidden}", setup,
                   lambda d, lo, hi: (embedding(d[0][lo:hi], d[1], validate=False),))


def invariance_cases() -> list[RowCase]:
    """Llama-3.2-3B (H 3072, I 8192, 24/8 heads, V 128256) and Qwen3-0.6B (H 1024, I 3072,
    16/8 heads, V 151936) shapes."""
    return [
        *_rms_cases(3072), *_rms_cases(1024),
        _row_op_case("silu_and_mul", silu_and_mul, 2 * 8192, scale=3),
        _row_op_case("silu_and_mul", silu_and_mul, 2 * 3072, scale=3),
        _rotary_case(24, 8, 128), _rotary_case(16, 8, 128),
        _embedding_case(128256, 3072),
        _row_op_case("softmax", softmax, 128256, scale=5),
        _row_op_case("log_softmax", log_softmax, 128256, scale=5),
        _row_op_case("log_softmax", log_softmax, 151936, scale=5),
        _row_op_case("mean", mean, 3072),
        _row_op_case("argmax", argmax, 128256, scale=5),
        _row_op_case("argmax", argmax, 151936, scale=5),
    ]


def invariance_rows(
    batch_sizes: Sequence[int] = BATCH_SIZES, rows_checked: int = ROWS_CHECKED,
    log: Callable[[str], None] = print,
) -> list[dict]:
    results = []
    m_max = max(batch_sizes)
    for case in invariance_cases():
        gen = torch.Generator(device="cuda").manual_seed(len(case.op) * 1000 + m_max)
        data = case.setup(m_max, gen)
        check = range(min(rows_checked, m_max))
        alone = {i: [o.clone() for o in case.call(data, i, i + 1)] for i in check}
        cases = mismatches = 0
        for m in batch_sizes:
            batch = case.call(data, 0, m)
            for i in check:
                if i >= m:
                    continue
                cases += 1
                if not all(torch.equal(b[i], a[0]) for b, a in zip(batch, alone[i], strict=True)):
                    mismatches += 1
            del batch
        results.append({"op": case.op, "shape": case.shape, "check": "batch_sizes",
                        "cases": cases, "mismatches": mismatches})
        log(f"invariance {case.op:20s} {case.shape:22s} cases {cases:4d} "
            f"mismatches {mismatches}")
        del data, alone
        torch.cuda.empty_cache()
    return results


# ----------------------------------------------------------------------------- latency


def _time_sets(make: Callable[[], object], call: Callable[[object], object],
               bytes_per_call: int) -> float:
    sets = [make() for _ in range(input_sets_for(bytes_per_call))]
    return time_graph_us([(lambda s=s: call(s)) for s in sets])


_COPY_GRANULE = 4096  # elements: 8 KiB of 16-bit values


def time_copy(bytes_moved: int) -> float:
    """A device-to-device copy that reads and writes at least bytes_moved in total, in 16-bit
    elements, rounded up to whole 8 KiB: ``copy_`` is a memcpy whose other sizes take a path
    1.45x slower on the H200 (20.3 against 14.0-14.2 us around 24 MiB, copy_reference.json)."""
    n = -(-max(1, bytes_moved // 4) // _COPY_GRANULE) * _COPY_GRANULE

    def make():
        return (torch.randn(n, device="cuda").to(DTYPE), torch.empty(n, dtype=DTYPE,
                                                                   device="cuda"))

    return _time_sets(make, lambda s: s[1].copy_(s[0]), bytes_moved)


def _latency_point(op: str, shape: str, m: int, bytes_moved: int,
                   impls: dict[str, tuple[Callable[[], object], Callable[[object], object]]],
                   log: Callable[[str], None]) -> list[dict]:
    rows = [{"op": op, "shape": shape, "M": m, "impl": "floor",
             "us": round(bytes_moved / HBM_BYTES_PER_S * 1e6, 3)}]
    for impl, (make, call) in impls.items():
        rows.append({"op": op, "shape": shape, "M": m, "impl": impl,
                     "us": round(_time_sets(make, call, bytes_moved), 3)})
    rows.append({"op": op, "shape": shape, "M": m, "impl": "copy",
                 "us": round(time_copy(bytes_moved), 3)})
    log(f"latency {op:20s} {shape:8s} M={m:5d} " +
        " ".join(f"{r['impl']}={r['us']:.2f}" for r in rows))
    torch.cuda.empty_cache()
    return rows


def rms_norm_latency_rows(hiddens: Sequence[int] = (3072, 1024),
                          ms: Sequence[int] = LATENCY_MS,
                          log: Callable[[str], None] = print) -> list[dict]:
    rows: list[dict] = []
    gen = torch.Generator(device="cuda").manual_seed(1)
    for h in hiddens:
        w = _randn(gen, h) + 1
        for m in ms:
            def make(m=m, h=h):
                return (_randn(gen, m, h), _randn(gen, m, h), torch.empty(m, h, dtype=DTYPE,
                        device="cuda"), torch.empty(m, h, dtype=DTYPE, device="cuda"))

            plain = {
                "detlora": (make, lambda s, w=w: rms_norm(s[0], w, EPS, out=s[2])),
                "torch": (make, lambda s, w=w, h=h: torch.nn.functional.rms_norm(
                    s[0], (h,), w, EPS)),
            }
            fused = {
                "detlora": (make, lambda s, w=w: fused_add_rms_norm(
                    s[0], s[1], w, EPS, out=s[2], residual_out=s[3])),
            }
            moved = rms_bytes(m, h)
            rows += _latency_point("rms_norm", f"H={h}", m, moved["rms_norm"], plain, log)
            rows += _latency_point("fused_add_rms_norm", f"H={h}", m,
                                   moved["fused_add_rms_norm"], fused, log)
    return rows


def rms_bytes(m: int, h: int) -> dict[str, int]:
    """Bytes each op moves: x (and residual) read, y (and the new residual) written, weight."""
    elt = torch.finfo(DTYPE).bits // 8
    return {"rms_norm": (2 * m * h + h) * elt, "fused_add_rms_norm": (4 * m * h + h) * elt}


def _valid(cfg: RmsNormConfig, h: int) -> bool:
    try:
        check_rms_norm_config(cfg, h)
    except ValueError:
        return False
    return True


def rms_norm_sweep(
    hiddens: Sequence[int] = SWEEP_HIDDENS, ms: Sequence[int] = SWEEP_MS,
    rows: Sequence[int] = SWEEP_ROWS, warps: Sequence[int] = SWEEP_WARPS,
    log: Callable[[str], None] = print,
) -> list[dict]:
    """Latency of rms_norm and fused_add_rms_norm for every valid ``RmsNormConfig(r, w)``
    with r in ``rows`` and w in ``warps`` (plus the current default), timed as the latency
    rows are: {"op", "H", "M", "rows", "num_warps", "us", "floor_us"}.

    Every config of one (H, M) runs on the same rotating input sets, side by side.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("the RMSNorm config sweep needs a CUDA GPU")
    results: list[dict] = []
    gen = torch.Generator(device="cuda").manual_seed(3)
    for h in hiddens:
        w = _randn(gen, h) + 1
        default = rms_norm_config(h)
        configs = [default] + [RmsNormConfig(r, nw) for r in rows for nw in warps
                               if RmsNormConfig(r, nw) != default]
        configs = [c for c in configs if _valid(c, h)]
        for m in ms:
            moved = rms_bytes(m, h)
            # Enough sets for the smaller op keeps the larger one out of L2 too.
            sets = [(_randn(gen, m, h), _randn(gen, m, h),
                     torch.empty(m, h, dtype=DTYPE, device="cuda"),
                     torch.empty(m, h, dtype=DTYPE, device="cuda"))
                    for _ in range(input_sets_for(moved["rms_norm"]))]
            calls = {
                "rms_norm": lambda s, c, w=w: rms_norm(s[0], w, EPS, out=s[2], config=c),
                "fused_add_rms_norm": lambda s, c, w=w: fused_add_rms_norm(
                    s[0], s[1], w, EPS, out=s[2], residual_out=s[3], config=c),
            }
            for op, call in calls.items():
                floor = round(moved[op] / HBM_BYTES_PER_S * 1e6, 3)
                timed = []
                for cfg in configs:
                    us = time_graph_us([(lambda s=s, c=cfg, f=call: f(s, c)) for s in sets])
                    row = {"op": op, "H": h, "M": m, "rows": cfg.rows,
                           "num_warps": cfg.num_warps, "us": round(us, 3), "floor_us": floor}
                    timed.append(row)
                    log(f"sweep {op:20s} H={h:5d} M={m:5d} rows={cfg.rows} "
                        f"warps={cfg.num_warps} {us:7.2f} us (floor {floor:.2f}, "
                        f"{floor / us:.1%}){' default' if cfg == default else ''}")
                best = min(timed, key=lambda r: r["us"])
                log(f"sweep {op:20s} H={h:5d} M={m:5d} best rows={best['rows']} "
                    f"warps={best['num_warps']} {best['us']:.2f} us")
                results += timed
            del sets
            torch.cuda.empty_cache()
    return results


def log_softmax_latency_rows(vocab: int = 128256, ms: Sequence[int] = SOFTMAX_MS,
                             log: Callable[[str], None] = print) -> list[dict]:
    rows: list[dict] = []
    gen = torch.Generator(device="cuda").manual_seed(2)
    elt = torch.finfo(DTYPE).bits // 8
    for m in ms:
        def make(m=m):
            return _randn(gen, m, vocab, scale=5), torch.empty(m, vocab, dtype=DTYPE,
                                                               device="cuda")

        impls = {
            "detlora": (make, lambda s: log_softmax(s[0], out=s[1])),
            "torch": (make, lambda s: torch.log_softmax(s[0], dim=-1)),
        }
        # Floor: read the logits once and write the result once.
        rows += _latency_point("log_softmax", f"V={vocab}", m, 2 * m * vocab * elt, impls, log)
    return rows


def targets(latency: list[dict]) -> dict:
    """Fraction of the bandwidth floor (floor us / measured us) at M >= 256."""
    by_key: dict[tuple, dict[str, float]] = {}
    for r in latency:
        by_key.setdefault((r["op"], r["shape"], r["M"]), {})[r["impl"]] = r["us"]
    out: dict = {}
    for op in ("rms_norm", "fused_add_rms_norm"):
        fracs = {f"{shape},M={m}": round(v["floor"] / v["detlora"], 3)
                 for (o, shape, m), v in by_key.items() if o == op and m >= 256}
        if fracs:
            out[f"{op}_floor_fraction_M_ge_256"] = fracs
            out[f"{op}_floor_fraction_min"] = min(fracs.values())
            out[f"{op}_meets_0.8"] = min(fracs.values()) >= 0.8
    copy_fracs = [v["floor"] / v["copy"] for v in by_key.values() if v.get("copy")]
    if copy_fracs:
        out["copy_floor_fraction_median"] = round(statistics.median(copy_fracs), 3)
    return out


# ----------------------------------------------------------------------------- entry point


def run(log: Callable[[str], None] = print) -> dict:
    """Every row-wise measurement: invariance across batch sizes, then latency."""
    if not torch.cuda.is_available():
        raise RuntimeError("the row-wise kernel benchmark needs a CUDA GPU")
    result = {"invariance": invariance_rows(log=log)}
    result["latency"] = rms_norm_latency_rows(log=log) + log_softmax_latency_rows(log=log)
    result["targets"] = targets(result["latency"])
    log(f"targets: {result['targets']}")
    return result


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--rms-sweep", action="store_true",
                        help="time RMSNorm tilings (rms_norm_sweep) instead of run()")
    parser.add_argument("--hiddens", type=_ints, default=SWEEP_HIDDENS)
    parser.add_argument("--ms", type=_ints, default=SWEEP_MS)
    parser.add_argument("--rows", type=_ints, default=SWEEP_ROWS)
    parser.add_argument("--warps", type=_ints, default=SWEEP_WARPS)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("the row-wise benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    from benchmarks.harness import results_meta, write_results

    command = " ".join(["python -m benchmarks.suites.rowwise",
                        *(sys.argv[1:] if argv is None else argv)])
    body = ({"rows": rms_norm_sweep(args.hiddens, args.ms, args.rows, args.warps)}
            if args.rms_sweep else run())
    write_results(args.out, {"meta": results_meta(command), **body})
    return 0


__all__ = ["RowCase", "invariance_cases", "invariance_rows", "rms_norm_sweep", "run",
           "targets"]


if __name__ == "__main__":
    sys.exit(main())

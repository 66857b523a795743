"""Attention study (GPU): bitwise invariance of paged attention and its decode latency.

``run(log)`` returns ``{"invariance": [...], "latency": [...]}``:

* invariance rows ``{"op", "shape", "check", "cases", "mismatches"}``: a query row computed
  alone against the same row inside batches of 1..64 (``batch_sizes``), in a full prefill
  against chunked prefill and decode steps (``prefill_vs_chunked_vs_decode``), after a cached
  prefix (``cached_prefix``), and with the KV axis split over CTAs or not
  (``split_vs_unsplit``). ``cases`` counts compared rows, ``mismatches`` rows that differ in
  any bit. The fast split-KV kernel is checked too: it is *expected* to mismatch.
* latency rows ``{"op", "shape", "M", "impl", "us", "floor_us"}``: one decode step (q_len 1,
  every sequence at the same context) for batch M, timed by CUDA-graph replay, median, with
  the inputs rotated beyond L2. ``impl``: ``detlora`` (batch-invariant, fixed 512-position
  segments), ``detlora_nohint`` (the same without ``max_query_len``: the engine's current
  call), ``split_kv`` (FlashDecoding-style, splits from the work size) and ``sdpa``
  (``torch.nn.functional.scaled_dot_product_attention`` on dense contiguous K/V). ``floor_us``
  is the K/V bytes over 4.3 TB/s.

``tile_sweep`` and ``split_kv_sweep`` time other tilings (tuning data, timings only):

    python -m benchmarks.suites.attention --sweep tiles --out out/attention_tile_sweep.json
    python -m benchmarks.suites.attention --sweep split-kv --out out/split_kv_sweep.json
    python -m benchmarks.suites.attention --out out/attention.json   # run() alone
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from benchmarks.harness.timing import input_sets_for, time_graph_us
from detlora.ops import paged_attention as pa
from detlora.ops.paged_attention_split_kv import paged_attention_split_kv

MODELS = {"llama3b": (24, 8, 128), "qwen3_0_6b": (16, 8, 128)}  # (q heads, kv heads, D)
PAGE = 16
HBM_BYTES_PER_S = 4.3e12  # H200 copy bandwidth
DTYPE = torch.bfloat16
_OPS: dict[str, Callable[..., torch.Tensor]] = {
    "paged_attention": pa.paged_attention,
    "paged_attention_split_kv": paged_attention_split_kv,
}


@dataclass(frozen=True)
class AttentionBenchPlan:
    models: tuple[str, ...] = ("llama3b", "qwen3_0_6b")
    batches: tuple[int, ...] = (1, 16, 64)
    contexts: tuple[int, ...] = (1024, 8192, 32768)
    invariance_batches: tuple[int, ...] = (1, 2, 3, 5, 8, 16, 31, 48, 64)
    prefill_len: int = 4096
    replays: int = 15

    @classmethod
    def quick(cls) -> AttentionBenchPlan:
        return cls(models=("llama3b",), batches=(1, 64), contexts=(8192,),
                   invariance_batches=(1, 5, 64), prefill_len=1500, replays=5)


class KVPool:
    """Sequences' K/V written with write_kv into pages in shuffled order, and a seeded query
    for every position of every sequence (made on first use)."""

    def __init__(self, lens: list[int], hq: int, hk: int, d: int, seed: int,
                 device: torch.device, dtype: torch.dtype = DTYPE) -> None:
        self.lens, self.hq, self.d, self.seed = lens, hq, d, seed
        self.device, self.dtype = device, dtype
        g = torch.Generator(device=device).manual_seed(seed)
        pages_per = [-(-n // PAGE) for n in lens]
        total = sum(pages_per) + 1
        perm = torch.randperm(total, device=device, generator=g)
        self.k_cache = torch.full((total, PAGE, hk, d), float("nan"), dtype=dtype,
                                  device=device)
        self.v_cache = torch.full_like(self.k_cache, float("nan"))
        self.tables = torch.zeros(len(lens), max(pages_per), dtype=torch.int32, device=device)
        start = 0
        for b, n in enumerate(lens):
            mine = perm[start:start + pages_per[b]]
            start += pages_per[b]
            self.tables[b, :len(mine)] = mine.int()
            pos = torch.arange(n, device=device)
            k = torch.randn(n, hk, d, device=device, generator=g).to(dtype)
            v = torch.randn(n, hk, d, device=device, generator=g).to(dtype)
            pa.write_kv(k, v, self.k_cache, self.v_cache, mine[pos // PAGE] * PAGE + pos % PAGE)
        self._queries: dict[int, torch.Tensor] = {}

    def queries(self, s: int, first: int, end: int) -> torch.Tensor:
        if s not in self._queries:
            g = torch.Generator(device=self.device).manual_seed(self.seed * 1000 + s)
            self._queries[s] = torch.randn(self.lens[s], self.hq, self.d, device=self.device,
                                           generator=g).to(self.dtype)
        return self._queries[s][first:end]

    def attend(self, pieces: list[tuple[int, int, int]], op: str = "paged_attention",
               **kw) -> list[torch.Tensor]:
        """One launch over pieces (sequence, first, end): queries [first, end), context end."""
        q = torch.cat([self.queries(s, a, e) for s, a, e in pieces])
        q_lens = [e - a for _, a, e in pieces]
        seq_lens = torch.tensor([e for _, _, e in pieces], dtype=torch.int32, device=self.device)
        qsl = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32,
                           device=self.device)
        tables = self.tables[[s for s, _, _ in pieces]]
        scale = self.d**-0.5
        out = _OPS[op](q, self.k_cache, self.v_cache, tables, seq_lens, qsl, scale, **kw)
        return list(out.split(q_lens))


def _differing_rows(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a != b).reshape(a.shape[0], -1).any(dim=1).sum())


def _row(op: str, shape: str, check: str, cases: int, mismatches: int,
         log: Callable[[str], None]) -> dict:
    log(f"invariance {op:25s} {shape:22s} {check:30s} cases {cases:6d} "
        f"mismatches {mismatches}")
    return {"op": op, "shape": shape, "check": check, "cases": cases, "mismatches": mismatches}


# ----------------------------------------------------------------------------- invariance


def batch_size_rows(model: str, plan: AttentionBenchPlan, device: torch.device,
                    log: Callable[[str], None]) -> list[dict]:
    """Decode rows of three targets alone against the same rows in batches of other
    sequences (random contexts up to 8k, every fourth one a 37-token prefill chunk)."""
    hq, hk, d = MODELS[model]
    g = torch.Generator().manual_seed(11)
    targets = [8192, 3001, 517]
    others = torch.randint(1, 8193, (max(plan.invariance_batches),), generator=g).tolist()
    pool = KVPool(targets + others, hq, hk, d, seed=12, device=device)
    rows = []
    for op in _OPS:
        cases = mismatches = 0
        for hint in (False, True):
            alone = [pool.attend([(t, n - 1, n)], op, max_query_len=1 if hint else None)[0]
                     for t, n in enumerate(targets)]
            for bs in plan.invariance_batches:
                for t, n in enumerate(targets):
                    pick = torch.randperm(len(others), generator=g)[:bs - 1].tolist()
                    pieces = []
                    for j, o in enumerate(pick):
                        q_len = min(others[o], 37) if j % 4 == 3 else 1
                        pieces.append((len(targets) + o, others[o] - q_len, others[o]))
                    at = int(torch.randint(0, bs, (1,), generator=g))
                    pieces.insert(at, (t, n - 1, n))
                    mql = max(e - a for _, a, e in pieces) if hint else None
                    got = pool.attend(pieces, op, max_query_len=mql)[at]
                    cases += 1
                    mismatches += _differing_rows(got, alone[t])
        rows.append(_row(op, f"{model}_ctx517-8192", "batch_sizes", cases, mismatches, log))
    return rows


def mode_rows(model: str, plan: AttentionBenchPlan, device: torch.device,
              log: Callable[[str], None]) -> list[dict]:
    """One sequence's rows: full prefill against chunked prefill and decode steps, against
    prefill after cached prefixes, and (batch-invariant op) split against unsplit KV."""
    hq, hk, d = MODELS[model]
    length = plan.prefill_len
    pool = KVPool([length, 700], hq, hk, d, seed=13, device=device)
    shape = f"{model}_ctx{length}"
    steps = sorted({0, 1, 63, 64, 511, 512, 513, length // 2, length - 2, length - 1,
                    *range(0, length, max(1, length // 50))})
    chunkings = [(0, 1000, 2000, length), (0, 517, length)]
    prefixes = [p for p in (512, 1000, 2048, length - 96, length - 1) if 0 < p < length]
    rows = []
    for op in _OPS:
        full = pool.attend([(0, 0, length)], op)[0]
        cases = mismatches = 0
        for bounds in chunkings:
            for a, e in itertools.pairwise(b for b in bounds if b <= length):
                got = pool.attend([(0, a, e)], op)[0]
                cases += e - a
                mismatches += _differing_rows(got, full[a:e])
        decode = pool.attend([(0, p, p + 1) for p in steps], op)
        for p, got in zip(steps, decode, strict=True):
            cases += 1
            mismatches += _differing_rows(got, full[p:p + 1])
        for p in steps[::5]:  # decode steps alone, and next to another sequence's prefill
            for pieces, mql in (([(0, p, p + 1)], 1), ([(1, 0, 700), (0, p, p + 1)], 700)):
                got = pool.attend(pieces, op, max_query_len=mql)[-1]
                cases += 1
                mismatches += _differing_rows(got, full[p:p + 1])
        rows.append(_row(op, shape, "prefill_vs_chunked_vs_decode", cases, mismatches, log))
        cases = mismatches = 0
        for p in prefixes:
            got = pool.attend([(0, p, length)], op)[0]
            cases += length - p
            mismatches += _differing_rows(got, full[p:])
        rows.append(_row(op, shape, "cached_prefix", cases, mismatches, log))
        if op == "paged_attention":
            cases = mismatches = 0
            for ctas in (1, 2, 7, 16):
                got = pool.attend([(0, 0, length)], op, kv_ctas=ctas)[0]
                cases += length
                mismatches += _differing_rows(got, full)
                dec = pool.attend([(0, p, p + 1) for p in steps], op, kv_ctas=ctas)
                for p, row in zip(steps, dec, strict=True):
                    cases += 1
                    mismatches += _differing_rows(row, full[p:p + 1])
            rows.append(_row(op, shape, "split_vs_unsplit", cases, mismatches, log))
    return rows


# ----------------------------------------------------------------------------- latency


def decode_calls(impl: str, b: int, ctx: int, hq: int, hk: int, d: int,
                 device: torch.device, num_splits: int | None = None,
                 **attention_kw: int | None) -> list[Callable[[], object]]:
    """Calls of one decode step, each on its own inputs, together larger than twice L2.
    ``attention_kw`` (``kv_split``, ``kv_ctas``) goes to the batch-invariant kernel."""
    kv_bytes = 2 * b * ctx * hk * d * 2
    n = input_sets_for(kv_bytes, max_sets=32, min_sets=1)
    g = torch.Generator(device=device).manual_seed(b * 7 + ctx)
    scale = d**-0.5
    if impl == "sdpa":
        import torch.nn.functional as F

        sets = [(torch.randn(b, hq, 1, d, device=device, generator=g).to(DTYPE),
                 torch.randn(b, hk, ctx, d, device=device, generator=g).to(DTYPE),
                 torch.randn(b, hk, ctx, d, device=device, generator=g).to(DTYPE))
                for _ in range(n)]
        return [lambda s=s: F.scaled_dot_product_attention(s[0], s[1], s[2], scale=scale,
                                                           enable_gqa=True) for s in sets]
    pages = -(-ctx // PAGE)
    total = n * b * pages
    k_cache = torch.randn(total, PAGE, hk, d, device=device, generator=g).to(DTYPE)
    v_cache = torch.randn(total, PAGE, hk, d, device=device, generator=g).to(DTYPE)
    tables = torch.randperm(total, device=device, generator=g).int().view(n, b, pages)
    seq_lens = torch.full((b,), ctx, dtype=torch.int32, device=device)
    qsl = torch.arange(b + 1, dtype=torch.int32, device=device)
    qs = [torch.randn(b, hq, d, device=device, generator=g).to(DTYPE) for _ in range(n)]
    outs = [torch.empty_like(q) for q in qs]
    if impl == "split_kv":
        def call(i):
            return paged_attention_split_kv(qs[i], k_cache, v_cache, tables[i], seq_lens, qsl,
                                            scale, out=outs[i], max_query_len=1,
                                            num_splits=num_splits)
    else:
        hint = 1 if impl == "detlora" else None

        def call(i):
            return pa.paged_attention(qs[i], k_cache, v_cache, tables[i], seq_lens, qsl, scale,
                                      out=outs[i], max_query_len=hint, **attention_kw)
    return [lambda i=i: call(i) for i in range(n)]


def latency_rows(plan: AttentionBenchPlan, device: torch.device,
                 log: Callable[[str], None]) -> list[dict]:
    rows = []
    for model, ctx, b in itertools.product(plan.models, plan.contexts, plan.batches):
        hq, hk, d = MODELS[model]
        shape = f"{model}_ctx{ctx}"
        floor = 2 * b * ctx * hk * d * 2 / HBM_BYTES_PER_S * 1e6
        found = {}
        for impl in ("detlora", "detlora_nohint", "split_kv", "sdpa"):
            calls = decode_calls(impl, b, ctx, hq, hk, d, device)
            try:
                us = time_graph_us(calls, replays=plan.replays)
            except Exception as exc:  # a baseline that fails to run is data, not a crash
                log(f"latency {shape} M={b} {impl} failed: {exc!r}"[:300])
                continue
            finally:
                del calls
                torch.cuda.empty_cache()
            found[impl] = us
            rows.append({"op": "paged_attention_decode", "shape": shape, "M": b, "impl": impl,
                         "us": round(us, 3), "floor_us": round(floor, 3)})
        ratio = (found["split_kv"] / found["detlora"]
                 if "split_kv" in found and "detlora" in found else float("nan"))
        log(f"latency {shape:22s} M={b:3d} " + " ".join(
            f"{k}={v:8.2f}us" for k, v in found.items())
            + f" floor={floor:.2f}us split_kv/detlora={ratio:.3f}")
    return rows


def tile_sweep(log: Callable[[str], None] = print) -> list[dict]:
    """Decode latency of the batch-invariant kernel under other tile settings (warps, stages)
    and KV segment lengths: tuning data for ``tile_config`` and ``KV_SEGMENT``. Each setting
    gives different bits, so these are timings only."""
    device = torch.device("cuda", torch.cuda.current_device())
    hq, hk, d = MODELS["llama3b"]
    default = pa.tile_config
    rows = []
    for b, ctx in ((1, 1024), (1, 8192), (16, 8192), (64, 256), (64, 1024)):
        calls = decode_calls("split_kv", b, ctx, hq, hk, d, device)
        ref = time_graph_us(calls, replays=10)
        del calls
        rows.append({"b": b, "ctx": ctx, "impl": "split_kv", "us": round(ref, 2)})
        for (warps, stages), segment in itertools.product(
                ((4, 3), (4, 2), (4, 4), (8, 2), (8, 3)), (512, 256)):
            def cfg(head_dim: int, group: int, warps=warps, stages=stages) -> pa.TileConfig:
                return pa.TileConfig(default(head_dim, group).block_m, warps, stages)

            pa.tile_config = cfg
            original = pa.KV_SEGMENT
            pa.KV_SEGMENT = segment
            try:
                calls = decode_calls("detlora", b, ctx, hq, hk, d, device)
                us = time_graph_us(calls, replays=10)
            except Exception as exc:  # a setting that does not fit is data
                log(f"tiles b={b} ctx={ctx} w{warps} s{stages} seg{segment}: {exc!r}"[:300])
                continue
            finally:
                pa.tile_config = default
                pa.KV_SEGMENT = original
                torch.cuda.empty_cache()
            rows.append({"b": b, "ctx": ctx, "impl": "detlora", "warps": warps,
                         "stages": stages, "segment": segment, "us": round(us, 2)})
            log(f"tiles b={b:3d} ctx={ctx:5d} w{warps} s{stages} seg{segment}: {us:8.2f} us "
                f"(split_kv {ref:.2f} us, ratio {ref / us:.2f})")
    return rows


def split_kv_sweep(log: Callable[[str], None] = print) -> list[dict]:
    """Decode latency of the fast split-KV kernel at the engine's short contexts (a 100-token
    prompt plus up to 150 outputs) under other warps, stages, key blocks and split counts:
    tuning data for ``split_kv_config``. That kernel's bits may change; timings only."""
    from detlora.ops import paged_attention_split_kv as skv

    device = torch.device("cuda", torch.cuda.current_device())
    hq, hk, d = MODELS["llama3b"]
    default_cfg, default_bn = skv.split_kv_config, skv.BLOCK_N
    rows = []
    for b, ctx in ((16, 176), (64, 128), (64, 176), (64, 256), (256, 176)):
        for warps, stages, block_n, splits in itertools.product(
                (2, 4), (2, 3, 4), (32, 64, 128), (None, 2)):
            skv.split_kv_config = lambda *_a, w=warps, s=stages: (16, w, s)
            skv.BLOCK_N = block_n
            try:
                calls = decode_calls("split_kv", b, ctx, hq, hk, d, device,
                                      num_splits=splits)
                us = time_graph_us(calls, replays=10)
            except Exception as exc:  # a setting that does not fit is data
                log(f"split_kv b={b} ctx={ctx} w{warps} s{stages} n{block_n} "
                    f"splits={splits}: {exc!r}"[:300])
                continue
            finally:
                skv.split_kv_config, skv.BLOCK_N = default_cfg, default_bn
                torch.cuda.empty_cache()
            floor = 2 * b * ctx * hk * d * 2 / HBM_BYTES_PER_S * 1e6
            rows.append({"b": b, "ctx": ctx, "warps": warps, "stages": stages,
                         "block_n": block_n, "splits": splits or "auto", "us": round(us, 2),
                         "floor_us": round(floor, 2)})
            log(f"split_kv b={b:3d} ctx={ctx:4d} w{warps} s{stages} n{block_n:3d} "
                f"splits={splits or 'auto'}: {us:7.2f} us (floor {floor:.2f})")
    return rows


# ----------------------------------------------------------------------------- entry point


def run(log: Callable[[str], None] = print, plan: AttentionBenchPlan | None = None) -> dict:
    """Every GPU measurement of the attention issue, as one results dict."""
    if not torch.cuda.is_available():
        raise RuntimeError("the attention benchmark needs a CUDA GPU")
    plan = plan or AttentionBenchPlan()
    device = torch.device("cuda", torch.cuda.current_device())
    invariance = []
    for model in plan.models:
        invariance += batch_size_rows(model, plan, device, log)
        invariance += mode_rows(model, plan, device, log)
        torch.cuda.empty_cache()
    latency = latency_rows(plan, device, log)
    return {"invariance": invariance, "latency": latency, "summary": summarize(latency)}


def summarize(latency: list[dict]) -> list[dict]:
    """detlora / split_kv speed ratio per (shape, M): >= 0.8 is the target at M=1, ctx 8k."""
    by_key: dict[tuple[str, int], dict[str, float]] = {}
    for row in latency:
        by_key.setdefault((row["shape"], row["M"]), {})[row["impl"]] = row["us"]
    out = []
    for (shape, m), t in sorted(by_key.items()):
        if "detlora" in t and "split_kv" in t:
            out.append({"shape": shape, "M": m,
                        "speed_vs_split_kv": round(t["split_kv"] / t["detlora"], 3)})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--sweep", choices=("tiles", "split-kv"),
                        help="time other tilings instead of run()")
    parser.add_argument("--quick", action="store_true", help="run(): a small grid")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("the attention benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    from benchmarks.harness import results_meta, write_results

    command = " ".join(["python -m benchmarks.suites.attention",
                        *(sys.argv[1:] if argv is None else argv)])
    if args.sweep == "tiles":
        body: dict = {"rows": tile_sweep()}
    elif args.sweep == "split-kv":
        body = {"rows": split_kv_sweep()}
    else:
        body = run(plan=AttentionBenchPlan.quick() if args.quick else None)
    write_results(args.out, {"meta": results_meta(command), **body})
    return 0


__all__ = ["AttentionBenchPlan", "decode_calls", "main", "run", "split_kv_sweep", "tile_sweep"]


if __name__ == "__main__":
    sys.exit(main())

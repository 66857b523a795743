"""(Runs at commit 71e86be only: the op and the engine hook it measures were removed after
this measurement, benchmarks/results/l2_prefetch.json.)

Does hinting the next GEMM's weight into L2 during the small kernels of a decode step pay?

Part 1, one GEMM (M = 1, Llama-3.2-3B layer shapes, detlora linear and cuBLAS): CUDA-graph
replays of steps [optional l2_prefetch(W_i, cols)] -> [idle window: torch.cuda._sleep] ->
[linear(x, W_i)] over enough distinct weights that none stays in L2 from the last step;
median per step. "window_only" is the sleep alone.
Part 2, the engine (bench_engine's model, one engine per variant): throughput and TPOT at
batch 1 and 64 with ``model_runner.L2_PREFETCH_BYTES`` at several budgets (0 = off); the bits
are tests/gpu/test_l2_prefetch_gpu.py's.

    PYTHONPATH=src python benchmarks/experiments/l2_prefetch.py OUT.json [engine budgets MB]
    PYTHONPATH=src python benchmarks/experiments/l2_prefetch.py OUT.json warm   # part 3

Part 3 ("warm"): the same GEMMs with one weight every step (in L2) against rotated weights,
and each prefetch kernel alone (bulk requests, or one ``prefetch.global.L2`` per line).
"""

import contextlib
import functools
import json
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from benchmarks.harness import results_meta
from benchmarks.harness.timing import time_graph_us
from detlora.engine import model_runner
from detlora.ops.matmul import linear
from detlora.study.engine_variants import time_variants

SHAPES = {"qkv": (5120, 3072), "o": (3072, 3072), "gate_up": (16384, 3072), "down": (3072, 8192)}
CYCLES_PER_US = 1980  # H200 SM clock under load (nvidia_smi.txt)
MB = 1 << 20


def _operands(n: int, k: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Enough distinct [n, k] weights (160 MB, three at least) that none stays in L2 from one
    step to the next, and one input row of k."""
    copies = max(3, -(-160 * MB // (n * k * 2)))
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    return ws, torch.randn(1, k, device="cuda", dtype=torch.bfloat16)


def gemm_rows() -> list[dict]:
    from detlora.ops.l2_prefetch import l2_prefetch, l2_prefetches  # at 71e86be only

    rows = []
    for name, (n, k) in SHAPES.items():
        ws, xk = _operands(n, k)
        copies = len(ws)
        for impl, fn in (("detlora", linear), ("cublas", F.linear)):
            for window_us in (0, 5, 10):
                for budget_mb in (0, 16, 32, 48):
                    cols = min(k, budget_mb * MB // (n * 2))

                    def step(w, cols=cols, window_us=window_us, fn=fn, xk=xk):
                        if cols:
                            l2_prefetch(w, cols)
                        if window_us:
                            torch.cuda._sleep(window_us * CYCLES_PER_US)
                        fn(xk, w, None)

                    with l2_prefetches():
                        us = time_graph_us([lambda w=w: step(w) for w in ws], replays=20)
                    rows.append({"gemm": name, "N": n, "K": k, "impl": impl,
                                 "window_us": window_us, "budget_mb": budget_mb,
                                 "prefetched_mb": round(n * cols * 2 / MB, 1),
                                 "step_us": round(us, 2)})
                    print(rows[-1], flush=True)
            if impl == "cublas":
                for window_us in (5, 10):
                    us = time_graph_us([lambda us=window_us: torch.cuda._sleep(us * CYCLES_PER_US)]
                                       * copies, replays=20)
                    rows.append({"gemm": name, "impl": "window_only", "window_us": window_us,
                                 "step_us": round(us, 2)})
                    print(rows[-1], flush=True)
        del ws
        torch.cuda.empty_cache()
    return rows


@triton.jit
def _line_prefetch_kernel(w_ptr, n_lines, BLOCK: tl.constexpr):
    """One ``prefetch.global.L2::evict_last`` per 128-byte line (the per-line alternative)."""
    line = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ptr = w_ptr.to(tl.pointer_type(tl.uint8)) + line.to(tl.int64) * 128
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2::evict_last [$1]; "
        "mov.u32 $0, 0; }", "=r,l,r", [ptr, (line < n_lines).to(tl.int32)],
        dtype=tl.int32, is_pure=False, pack=1)


def line_prefetch(w: torch.Tensor, nbytes: int) -> None:
    lines = nbytes // 128
    _line_prefetch_kernel[(-(-lines // 256),)](w, lines, BLOCK=256, num_warps=8)


def warm_rows() -> list[dict]:
    """Is a decode GEMM faster with its weight already in L2? Same weight every step (warm)
    against rotated weights (cold); and the prefetch kernels alone, per MB hinted."""
    from detlora.ops.l2_prefetch import l2_prefetch, l2_prefetches  # at 71e86be only

    rows = []
    for name, (n, k) in SHAPES.items():
        ws, xk = _operands(n, k)
        copies = len(ws)
        w0 = ws[0]
        for impl, fn in (("detlora", linear), ("cublas", F.linear)):
            cold = time_graph_us([functools.partial(fn, xk, w, None) for w in ws], replays=20)
            warm = time_graph_us([functools.partial(fn, xk, w0, None)] * copies, replays=20)
            rows.append({"gemm": name, "impl": impl, "cold_us": round(cold, 2),
                         "warm_us": round(warm, 2), "weight_mb": round(n * k * 2 / MB, 1)})
            print(rows[-1], flush=True)
        nbytes = min(n * k * 2, 32 * MB)
        with l2_prefetches():
            bulk = time_graph_us([functools.partial(l2_prefetch, w, nbytes // (2 * n))
                                  for w in ws], replays=20)
        lines = time_graph_us([functools.partial(line_prefetch, w, nbytes) for w in ws],
                              replays=20)
        per_line = []
        for window_us in (0, 10):
            def step(w, window_us=window_us, xk=xk, nbytes=nbytes):
                line_prefetch(w, nbytes)
                if window_us:
                    torch.cuda._sleep(window_us * CYCLES_PER_US)
                linear(xk, w, None)
            per_line.append(round(time_graph_us([functools.partial(step, w) for w in ws],
                                                replays=20), 2))
        rows.append({"gemm": name, "hinted_mb": round(nbytes / MB, 1),
                     "bulk_prefetch_kernel_us": round(bulk, 2),
                     "line_prefetch_kernel_us": round(lines, 2),
                     "line_prefetch_then_detlora_us_window_0_10": per_line})
        print(rows[-1], flush=True)
        del ws
        torch.cuda.empty_cache()
    return rows


@contextlib.contextmanager
def budget(mb: int):
    old = model_runner.L2_PREFETCH_BYTES
    model_runner.L2_PREFETCH_BYTES = mb * MB
    try:
        yield
    finally:
        model_runner.L2_PREFETCH_BYTES = old


def engine_rows(budgets: list[int]) -> list[dict]:
    variants = [(mode, mb, lambda mb=mb: budget(mb))
                for mode in ("batch_invariant", "fast") for mb in budgets
                if mode == "batch_invariant" or mb in (0, max(budgets))]
    return time_variants(variants, (1, 64), "budget_mb")


if __name__ == "__main__":
    if sys.argv[2:3] == ["warm"]:
        with open(sys.argv[1], "w") as f:
            json.dump({"meta": results_meta("python benchmarks/experiments/l2_prefetch.py "
                                            "OUT.json warm"), "warm": warm_rows()}, f, indent=1)
        sys.exit(0)
    budgets = [int(v) for v in sys.argv[2].split(",")] if len(sys.argv) > 2 else [0, 16, 32, 48]
    out = {"meta": results_meta("python benchmarks/experiments/l2_prefetch.py OUT.json "
                                + ",".join(map(str, budgets))),
           "gemm": gemm_rows()}
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)
    out["engine"] = engine_rows(budgets)
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)

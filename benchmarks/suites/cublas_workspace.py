"""Is cuBLAS bf16 ``torch.mm`` batch-invariant? Row 0 computed alone (M = 1) against row 0
inside batches of M rows, for the Llama-3.2-3B and Qwen3-0.6B weight shapes, once with default
settings and once with ``CUBLAS_WORKSPACE_CONFIG=:16:8`` (the small workspace vLLM sets on
Hopper, which is meant to rule out cuBLAS's split-K).

cuBLAS reads CUBLAS_WORKSPACE_CONFIG when CUDA initializes, so each setting runs in its own
subprocess (``python -m benchmarks.suites.cublas_workspace --child``), which prints one JSON line.

    from benchmarks.suites.cublas_workspace import measure
    measure()  # {"default": {"3072x3072": False, ...}, ":16:8": {...}}
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterable

import torch

from benchmarks.harness.meta import REPO_ROOT

# Weight shapes (N, K) as nn.Linear stores them: Llama-3.2-3B qkv/o/gate_up/down/lm_head,
# Qwen3-0.6B q/kv/qkv/o/gate_up/down/lm_head.
SHAPES: tuple[tuple[int, int], ...] = (
    (5120, 3072), (3072, 3072), (16384, 3072), (3072, 8192), (128256, 3072),
    (2048, 1024), (1024, 1024), (4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072),
    (151936, 1024),
)
M_VALUES: tuple[int, ...] = (2, 3, 7, 16, 64, 128, 257, 1024, 4096)
# Environment of each measured setting. CUBLASLT_WORKSPACE_SIZE (KiB; vLLM sets 1 beside
# :16:8) is cleared for both; pass e.g. {"lt1": {"CUBLAS_WORKSPACE_CONFIG": ":16:8",
# "CUBLASLT_WORKSPACE_SIZE": "1"}} to measure() to include it.
SETTINGS: dict[str, dict[str, str]] = {
    "default": {},
    ":16:8": {"CUBLAS_WORKSPACE_CONFIG": ":16:8"},
}
_CLEARED = ("CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE")


def shape_key(n: int, k: int) -> str:
    return f"{n}x{k}"


def differing_batch_sizes(
    shapes: Iterable[tuple[int, int]] = SHAPES, m_values: Iterable[int] = M_VALUES,
    seed: int = 0,
) -> dict[str, list[int]]:
    """In this process: for each weight shape, the M at which row 0 of ``x @ W.T`` differs
    from row 0 computed alone (an empty list means batch-invariant for these M)."""
    m_values = list(m_values)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    out: dict[str, list[int]] = {}
    for n, k in shapes:
        w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(torch.bfloat16)
        x = torch.randn(max(m_values), k, device="cuda", generator=gen).to(torch.bfloat16)
        alone = torch.mm(x[:1], w.t())[0]  # the layout nn.Linear hands to cuBLAS
        out[shape_key(n, k)] = [m for m in m_values
                                if not torch.equal(torch.mm(x[:m], w.t())[0], alone)]
        del w, x
    return out


def measure(
    shapes: Iterable[tuple[int, int]] = SHAPES, m_values: Iterable[int] = M_VALUES,
    log: Callable[[str], None] = print, timeout_s: float = 600.0,
    settings: dict[str, dict[str, str]] | None = None,
) -> dict[str, dict[str, bool]]:
    """``{"default": {shape: invariant}, ":16:8": {shape: invariant}}``, one subprocess each
    (shape keys are "NxK" of the weight)."""
    args = json.dumps({"shapes": [list(s) for s in shapes], "m_values": list(m_values)})
    result: dict[str, dict[str, bool]] = {}
    for label, variables in (settings or SETTINGS).items():
        env = {k: v for k, v in os.environ.items() if k not in _CLEARED}
        env.update(variables)
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks.suites.cublas_workspace", "--child", args],
            env=env, capture_output=True, text=True, timeout=timeout_s, check=False,
            cwd=REPO_ROOT,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"cuBLAS study child ({label}) failed:\n{proc.stderr[-4000:]}")
        differing = json.loads(proc.stdout.strip().splitlines()[-1])
        result[label] = {shape: not ms for shape, ms in differing.items()}
        for shape, ms in differing.items():
            log(f"cublas {label:8s} {shape:>12s} invariant={not ms} differs at M={ms}")
    return result


def _child(args_json: str) -> None:
    args = json.loads(args_json)
    differing = differing_batch_sizes([tuple(s) for s in args["shapes"]], args["m_values"])
    print(json.dumps(differing))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        _child(sys.argv[2])
    else:
        print(json.dumps(measure(), indent=2))

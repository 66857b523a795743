"""Time the bench model's engine under several code variants in one process.

A study that asks "is variant X faster end to end" builds one engine per variant on the model
of ``suites.engine`` and times its throughput batches like ``suites.engine`` does. A variant is
a context manager that patches what the engine reads when it captures its decode graphs (a
config table, a config function); it stays in place while that engine runs.
"""

from __future__ import annotations

import dataclasses
import gc
import tempfile
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch

from benchmarks.suites import engine as be

# (level, label recorded in each row, patch in force while that engine runs)
Variant = tuple[str, Any, Callable[[], AbstractContextManager[Any]]]


def time_variants(variants: Sequence[Variant], batches: tuple[int, ...], label_key: str,
                  log: Callable[[str], None] = print,
                  plan: be.BenchPlan | None = None) -> list[dict[str, Any]]:
    """One row per (variant, batch): ``suites.engine``'s throughput row plus ``mode`` and
    ``label_key``: the variant's label. ``plan`` (default ``BenchPlan()``) sets the model."""
    from detlora import LoRARequest

    plan = dataclasses.replace(plan or be.BenchPlan(), throughput_batches=batches)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="detlora-variants-") as tmp:
        root = Path(tmp)
        be.write_model(root / "model", plan.shape)
        be.write_adapter(root / "adapter0", plan.shape, seed=10)
        w = be.Workload(plan, [LoRARequest("a0", 1, str(root / "adapter0"))])
        for mode, label, patch in variants:
            with patch():
                llm = be.make_engine(root / "model", mode, plan)
                for row in be.throughput_rows(llm, f"{mode}:{label}", w, log):
                    rows.append({**row, "mode": mode, label_key: label})
                del llm
                if torch.cuda.is_available():
                    be.free_gpu()
                else:
                    gc.collect()
    return rows


__all__ = ["Variant", "time_variants"]

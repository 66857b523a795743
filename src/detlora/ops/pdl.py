"""Programmatic dependent launch (PDL): let a small kernel start while the one before it ends.

Semantics:
    Changes when a kernel starts, never what it computes: the bits are those of plain launches.

A decode step is ~250 kernels, most of them a few microseconds long, and each waits for the
previous one to drain before its first CTA is scheduled. On sm_90 a kernel launched with
``launch_pdl=True`` may be scheduled as soon as every CTA of the kernel before it has run
``griddepcontrol.launch_dependents``; it must then run ``griddepcontrol.wait`` before it reads
anything earlier kernels wrote, and before it writes anything they may still read. ``wait``
returns once the previous kernel has completed and its writes are visible. Every PDL kernel
here opens with ``pdl_start``: trigger, then wait, unconditionally and before any load or
store, so "completed" is transitive along the chain.

Which kernels: RMSNorm, the LoRA expands and both attention kernels (with the split-KV
combine and the KV write). The batch-invariant matmul launches plainly: every PDL variant of
it made the decode step slower. Only the engine's CUDA graphs (decode and step graphs) launch
with PDL (``pdl_launches``); eager steps stay plain, because PDL there slowed prefill (see
docs/decisions.md, "PDL").

``pdl_launch(tensor)`` is False off sm_90+, in the interpreter, outside ``pdl_launches``, and
with ``DETLORA_PDL=0`` (for measuring the difference).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator

import torch
import triton
import triton.language as tl

from detlora.ops._runtime import interpreting


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


_scopes = 0  # open ``pdl_launches`` blocks


@contextlib.contextmanager
def pdl_launches() -> Iterator[None]:
    """Kernels launched inside this block (on sm_90+) use PDL. The engine opens it around its
    decode graphs' warm-up and capture, so that both compile and run the same variant."""
    global _scopes
    _scopes += 1
    try:
        yield
    finally:
        _scopes -= 1


def pdl_launch(tensor: torch.Tensor) -> bool:
    """Whether a kernel on ``tensor``'s device launches with PDL (inside ``pdl_launches``)."""
    if not _scopes or not tensor.is_cuda or interpreting() \
            or os.environ.get("DETLORA_PDL", "1") == "0":
        return False
    index = tensor.device.index
    return _capable(index if index is not None else torch.cuda.current_device())


def pdl_kwargs(tensor: torch.Tensor) -> dict[str, bool]:
    """Launch arguments of a PDL-aware kernel: its ``PDL`` constexpr and ``launch_pdl``."""
    on = pdl_launch(tensor)
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """A PDL kernel's opening: let the next kernel be scheduled, then block until the previous
    one has completed and its writes are visible."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


__all__ = ["pdl_kwargs", "pdl_launch", "pdl_launches", "pdl_start"]

"""Programmatic dependent launch (PDL): let a kernel start while the one before it finishes.

Semantics:
    Changes when a kernel starts, never what it computes: the bits are those of plain launches.

A batch-1 decode step is ~250 kernels, most of them a few microseconds long, and each waits
for the previous one to drain before its first CTA is scheduled. On sm_90 a kernel launched
with ``launch_pdl=True`` may be scheduled as soon as every CTA of the kernel before it has
run ``griddepcontrol.launch_dependents`` (``pdl_trigger``); it must then run
``griddepcontrol.wait`` (``pdl_wait``) before it reads anything the earlier kernels wrote,
and before it writes anything they may still read. ``wait`` returns once the previous kernel
has completed and its writes are visible.

Rules every PDL kernel here follows:
  * it calls ``pdl_wait`` unconditionally, before its first read of a tensor an earlier
    kernel writes and before its first store, so "completed" is transitive along the chain;
  * before the wait it only reads weights (constant while a step runs): the matmul prefetches
    the head of its weight tile into L2 there, which is what the early start is for;
  * small kernels trigger first thing, the matmul after its K loop, so at most the next small
    kernel and the matmul after it are waiting on SMs at any time.

``pdl_launch(tensor)`` is False off sm_90+, in the interpreter, and with ``DETLORA_PDL=0``
(for measuring the difference).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from detlora.ops._runtime import interpreting


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_launch(tensor: torch.Tensor) -> bool:
    """Whether kernels on ``tensor``'s device launch with PDL."""
    if not tensor.is_cuda or interpreting() or os.environ.get("DETLORA_PDL", "1") == "0":
        return False
    index = tensor.device.index
    return _capable(index if index is not None else torch.cuda.current_device())


def pdl_kwargs(tensor: torch.Tensor) -> dict[str, bool]:
    """Launch arguments of a PDL-aware kernel: its ``PDL`` constexpr and ``launch_pdl``."""
    on = pdl_launch(tensor)
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def pdl_trigger(PDL: tl.constexpr):
    """Allow the next kernel to be scheduled (it still waits in ``pdl_wait``)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Block until the previous kernel has completed and its writes are visible."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """A small kernel's opening: let the next one launch, then wait for the previous one."""
    pdl_trigger(PDL)
    pdl_wait(PDL)


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the 128-byte lines at ``ptrs`` (kept at eviction priority "last");
    nothing is loaded into registers."""
    tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l",
                              [ptrs], dtype=tl.int32, is_pure=False, pack=1)


__all__ = ["pdl_kwargs", "pdl_launch", "pdl_start", "pdl_trigger", "pdl_wait", "prefetch_l2"]

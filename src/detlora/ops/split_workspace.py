"""Scratch and completion counters for kernels that reduce across CTAs in a fixed order.

Allocated once and reused by every call, so a captured CUDA graph keeps valid pointers. The
ordered kernels leave every counter at zero when they return (the last CTA of a tile resets
it), so the counters are zeroed once, at allocation, and never again.

One workspace serves one stream at a time: two such kernels running concurrently on different
streams must not share one.

A buffer that grows is replaced, and the old one is kept alive (``retired``) for the
workspace's life: a CUDA graph captured before the growth still points at it. The engine
captures its decode graphs before its step graphs, whose larger warm-up steps may grow a
shared workspace; freeing the old buffer then would let every later decode replay write into
memory the allocator has handed out again, or returned to the driver. Sizes double, so the
retired buffers together hold less than the current ones.
"""

from __future__ import annotations

from typing import TypeVar

import torch

W = TypeVar("W", bound="SplitWorkspace")


class SplitWorkspace:
    """Reusable FP32 scratch for partial sums and int32 per-tile counters."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._scratch = torch.empty(0, dtype=torch.float32, device=self.device)
        self._counters = torch.zeros(0, dtype=torch.int32, device=self.device)
        self.retired: list[torch.Tensor] = []  # outgrown buffers, alive for captured graphs

    def scratch(self, numel: int) -> torch.Tensor:
        """A flat FP32 buffer of at least ``numel`` elements (contents undefined)."""
        if self._scratch.numel() < numel:
            self._check_not_capturing("scratch", numel)
            self._retire(self._scratch)
            self._scratch = torch.empty(_grow(numel), dtype=torch.float32, device=self.device)
        return self._scratch[:numel]

    def counters(self, numel: int) -> torch.Tensor:
        """A flat int32 buffer of at least ``numel`` zeros (kept at zero by the kernel)."""
        if self._counters.numel() < numel:
            self._check_not_capturing("counters", numel)
            self._retire(self._counters)
            self._counters = torch.zeros(_grow(numel), dtype=torch.int32, device=self.device)
        return self._counters[:numel]

    def reserve(self, scratch_numel: int, counter_numel: int) -> None:
        """Grow both buffers ahead of a CUDA-graph capture."""
        self.scratch(scratch_numel)
        self.counters(counter_numel)

    @property
    def scratch_capacity(self) -> int:
        return self._scratch.numel()

    @property
    def counter_capacity(self) -> int:
        return self._counters.numel()

    def _retire(self, buffer: torch.Tensor) -> None:
        if buffer.numel():
            self.retired.append(buffer)

    def _check_not_capturing(self, what: str, numel: int) -> None:
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise ValueError(
                f"{type(self).__name__} {what} must grow to {numel} elements during CUDA-graph "
                "capture; run the op once before capturing (or call reserve()) so the buffer "
                "exists"
            )


def _grow(numel: int) -> int:
    # Round up so that slowly growing batches do not reallocate every step.
    return max(1024, 1 << (numel - 1).bit_length())


def per_device(cls: type[W], registry: dict[torch.device, W], device: torch.device | str) -> W:
    """The shared workspace of ``cls`` for ``device`` (created on first use)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    ws = registry.get(device)
    if ws is None:
        ws = registry[device] = cls(device)
    return ws

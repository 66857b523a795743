"""Pinned host buffers read by non-blocking host-to-device copies, refilled safely.

A non-blocking copy from pinned memory runs later on the stream, so its host buffer may only
be refilled once the copy has run. ``CopyFence`` records an event after the copies and waits
on it before the next refill (normally long done by then).
"""

from __future__ import annotations

import torch


class CopyFence:
    def __init__(self) -> None:
        self._event: torch.cuda.Event | None = None

    def wait(self) -> None:
        """Block until the copies queued before the last ``record`` have run."""
        if self._event is not None:
            self._event.synchronize()

    def record(self) -> None:
        """Mark the copies queued so far on the current stream."""
        self._event = torch.cuda.Event()
        self._event.record()


class PinnedStaging:
    """Pinned int64 buffers for a call's upload, reused by later calls (a fresh pinned tensor
    per call can cost a host allocation). Two alternate, so a call made while the previous
    one's copy is still queued (the engine launches a step before reading the last) does not
    wait for it."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._fences = [CopyFence(), CopyFence()]
        self._turn = 0
        self.fence = self._fences[0]

    def take(self, numel: int) -> torch.Tensor:
        """The first ``numel`` elements of the next buffer, once its last upload was copied;
        ``fence.record()`` after queueing the copy."""
        self._turn ^= 1
        self.fence = self._fences[self._turn]
        self.fence.wait()
        buffer = self._buffers[self._turn]
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(max(4096, 2 * numel), dtype=torch.int64, pin_memory=True)
            self._buffers[self._turn] = buffer
        return buffer[:numel]

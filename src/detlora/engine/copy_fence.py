"""Pinned host buffers read by non-blocking host-to-device copies, refilled safely.

A non-blocking copy from pinned memory runs later on the stream, so its host buffer may only
be refilled once the copy has run. ``CopyFence`` records an event after the copies and waits
on it before the next refill (the engine syncs every step, so the wait is normally free).
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
    """One growing pinned int64 buffer for a call's upload, reused by every call (a fresh
    pinned tensor per call can cost a host allocation)."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None
        self.fence = CopyFence()

    def take(self, numel: int) -> torch.Tensor:
        """The first ``numel`` elements, once the previous upload has been copied."""
        self.fence.wait()
        if self._buffer is None or self._buffer.numel() < numel:
            self._buffer = torch.empty(max(4096, 2 * numel), dtype=torch.int64, pin_memory=True)
        return self._buffer[:numel]

"""A small tqdm-like progress bar (tqdm is not a dependency): ``done/total [bar] rate``."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    """Redraws one stderr line at most every ``interval`` seconds; silent when disabled."""

    def __init__(self, total: int, *, desc: str = "", enabled: bool = True,
                 stream: TextIO | None = None, interval: float = 0.1, width: int = 30) -> None:
        self.total = total
        self.desc = desc
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.interval = interval
        self.width = width
        self.done = 0
        self.tokens = 0
        self._start = time.perf_counter()
        self._last = 0.0

    def update(self, n: int = 1, tokens: int = 0) -> None:
        self.done += n
        self.tokens += tokens
        now = time.perf_counter()
        if self.enabled and (now - self._last >= self.interval or self.done >= self.total):
            self._last = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        frac = self.done / self.total if self.total else 1.0
        fill = int(frac * self.width)
        bar = "#" * fill + "." * (self.width - fill)
        elapsed = max(now - self._start, 1e-9)
        rate = f"{self.tokens / elapsed:.1f} tok/s" if self.tokens else \
            f"{self.done / elapsed:.2f} it/s"
        prefix = f"{self.desc}: " if self.desc else ""
        self.stream.write(f"\r{prefix}{self.done}/{self.total} [{bar}] {elapsed:.1f}s {rate}")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self._draw(time.perf_counter())
            self.stream.write("\n")
            self.stream.flush()

"""The audit log's writer: a background thread that appends JSON lines to files it rotates.

``submit`` never blocks: it puts the entry in a bounded queue (a full queue drops it and
counts it in ``stats.lines_dropped``), so neither a step nor the event loop waits for the
disk. The thread turns entries into lines (hashes and JSON are computed there, not by the
caller), and writes each batch it drains with one ``write`` on a file opened ``O_APPEND``
with mode 0600 in a directory it makes with mode 0700: a killed process leaves whole lines
behind, and a machine that stops mid-write at most one torn last line, which the reader
skips. It syncs to disk at most every ``sync_interval_s``, on rotation and on ``close``.

Files are ``audit-YYYYMMDDTHHMMSSZ-PID-N.jsonl``; a new one starts when the next line would
pass ``max_bytes`` or the UTC day changes, each beginning with the engine line.
"""

from __future__ import annotations

import atexit
import bisect
import json
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from detlora.audit.format import ENGINE, VERSION, utc_time
from detlora.log import get_logger

logger = get_logger(__name__)

# Seconds from submit to written (bucket upper bounds, for /metrics).
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                   5.0, 10.0)


@dataclass(frozen=True)
class AuditConfig:
    """Where the log goes and how: ``hash_only`` keeps hashes instead of prompt and output
    token ids and texts; ``max_bytes`` per file before the next one; ``queue_size`` entries
    may wait for the writer before new ones are dropped (and counted)."""

    directory: str
    hash_only: bool = False
    max_bytes: int = 256 << 20
    queue_size: int = 1 << 16
    sync_interval_s: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.directory, str) or not self.directory:
            raise ValueError(f"the audit log directory must be a non-empty path, got "
                             f"{self.directory!r}")
        for name in ("max_bytes", "queue_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"audit log {name} must be a positive int, got {value!r}")


def prepare_directory(path: str | Path) -> Path:
    """Make the log directory (mode 0700) if it is missing; ValueError when it cannot be made
    or written."""
    directory = Path(path)
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"the audit log directory {directory} cannot be made: "
                         f"{e.strerror or e}") from None
    if not directory.is_dir() or not os.access(directory, os.W_OK | os.X_OK):
        raise ValueError(f"the audit log directory {directory} is not a writable directory")
    return directory


class AuditStats:
    """What the writer did so far (read by /metrics from another thread: plain counters,
    each written by the writer thread alone, except ``lines_dropped``)."""

    def __init__(self) -> None:
        self.lines_written = 0
        self.bytes_written = 0
        self.lines_dropped = 0
        self.files = 0
        self.latency_counts = [0] * (len(LATENCY_BUCKETS) + 1)  # the last: above every bound
        self.latency_sum = 0.0

    def observe(self, seconds: float) -> None:
        self.latency_counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.latency_sum += seconds


class _Item:
    __slots__ = ("build", "queued")

    def __init__(self, build: Callable[[], Mapping[str, Any]], queued: float) -> None:
        self.build = build
        self.queued = queued


_STOP = object()


class AuditWriter:
    """Append-only JSON-lines writer in a thread of its own (see the module doc).

    ``header``: the engine line's fields (beside ``v``, ``kind``, ``time``), written first in
    every file."""

    def __init__(self, config: AuditConfig, header: Mapping[str, Any]) -> None:
        self.config = config
        self.header = dict(header)
        self.stats = AuditStats()
        self.directory = prepare_directory(config.directory)
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=config.queue_size)
        self._fd: int | None = None
        self._size = 0
        self._day = ""
        self._seq = 0
        self._synced = time.monotonic()
        self._closed = False
        self._dropped_warned = 0.0
        self._open_next()  # a directory it cannot write fails here, at start
        self._thread = threading.Thread(target=self._run, name="detlora-audit", daemon=True)
        self._thread.start()
        atexit.register(self.close)  # an interpreter that exits first writes the queue out

    # ---- the caller's side ----

    def submit(self, build: Callable[[], Mapping[str, Any]]) -> bool:
        """Queue an entry: ``build()`` (called on the writer thread) returns its record.
        Never blocks; False (and one more dropped line) when the queue is full or closed."""
        if not self._closed:
            try:
                self._queue.put_nowait(_Item(build, time.monotonic()))
                return True
            except queue.Full:
                pass
        self.stats.lines_dropped += 1
        now = time.monotonic()
        if now - self._dropped_warned > 10.0:
            self._dropped_warned = now
            logger.warning("audit log: %d lines dropped so far (%s)", self.stats.lines_dropped,
                           "the log is closed" if self._closed else "the writer is behind")
        return False

    def close(self, timeout: float = 60.0) -> None:
        """Write what is queued, sync and close the file; later entries are dropped."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        self._queue.put(_STOP)
        self._thread.join(timeout)

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    # ---- the writer thread ----

    def _run(self) -> None:
        get = self._queue.get
        try:
            while True:
                try:
                    item = get(timeout=self.config.sync_interval_s)
                except queue.Empty:
                    self._sync_if_due()
                    continue
                batch = [item]
                while len(batch) < 4096:
                    try:
                        batch.append(self._queue.get_nowait())
                    except queue.Empty:
                        break
                stop = any(x is _STOP for x in batch)
                self._write([x for x in batch if x is not _STOP])
                self._sync_if_due()
                if stop:
                    break
        finally:
            self._close_file()

    def _line(self, item: _Item) -> bytes | None:
        try:
            record = item.build()
            return (json.dumps(record, separators=(",", ":"), ensure_ascii=False)
                    + "\n").encode()
        except Exception as e:  # a bug in a record: never the writer's end
            logger.error("audit log: a record could not be built: %s: %s", type(e).__name__, e)
            return None

    def _write(self, items: list[_Item]) -> None:
        chunk: list[bytes] = []
        size = 0
        written: list[_Item] = []
        today = datetime.now(timezone.utc).strftime("%Y%m%d")
        for item in items:
            line = self._line(item)
            if line is None:
                self.stats.lines_dropped += 1
                continue
            if self._due_rotation(today, size, len(line)):
                self._flush(chunk, written)
                chunk, size, written = [], 0, []
                self._open_next()
            chunk.append(line)
            written.append(item)
            size += len(line)
        self._flush(chunk, written)

    def _flush(self, chunk: list[bytes], items: list[_Item]) -> None:
        if not chunk:
            return
        data = b"".join(chunk)
        try:
            self._write_all(data)
        except OSError as e:
            self.stats.lines_dropped += len(chunk)
            logger.error("audit log: %d lines could not be written: %s", len(chunk), e)
            return
        now = time.monotonic()
        stats = self.stats
        stats.lines_written += len(chunk)
        stats.bytes_written += len(data)
        for item in items:
            stats.observe(now - item.queued)

    def _write_all(self, data: bytes) -> None:
        assert self._fd is not None
        view = memoryview(data)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]
        self._size += len(data)

    def _due_rotation(self, today: str, pending: int, line: int) -> bool:
        """Whether ``line`` bytes go to a new file, after ``pending`` bytes not written yet: a
        new UTC day, or the size limit (a file holds at least one line)."""
        if today != self._day:
            return True
        size = self._size + pending
        return size + line > self.config.max_bytes and size > self._header_size

    def _open_next(self) -> None:
        """Close the current file (synced) and start the next one with the engine line."""
        self._close_file()
        now = time.time()
        stamp = datetime.fromtimestamp(now, tz=timezone.utc)
        self._day = stamp.strftime("%Y%m%d")
        while True:
            self._seq += 1
            name = f"audit-{stamp.strftime('%Y%m%dT%H%M%SZ')}-{os.getpid()}-{self._seq}.jsonl"
            try:
                self._fd = os.open(self.directory / name,
                                   os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600)
                break
            except FileExistsError:
                continue
        os.fchmod(self._fd, 0o600)  # whatever the umask
        self._size = 0
        self.stats.files += 1
        head = {"v": VERSION, "kind": ENGINE, "time": utc_time(now), "file": name,
                **self.header}
        line = (json.dumps(head, separators=(",", ":"), ensure_ascii=False) + "\n").encode()
        self._header_size = len(line)
        self._write_all(line)
        os.fsync(self._fd)  # the engine line is on disk before any request line
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)  # and the file's name too
        finally:
            os.close(fd)

    def _sync_if_due(self) -> None:
        if self._fd is not None and time.monotonic() - self._synced >= self.config.sync_interval_s:
            os.fsync(self._fd)
            self._synced = time.monotonic()

    def _close_file(self) -> None:
        if self._fd is not None:
            try:
                os.fsync(self._fd)
            finally:
                os.close(self._fd)
                self._fd = None
            self._synced = time.monotonic()


__all__ = ["LATENCY_BUCKETS", "AuditConfig", "AuditStats", "AuditWriter", "prepare_directory"]

"""The host cache of adapters: read, checked and converted once, kept in (pinned) host memory.

An adapter is read from disk, checked against the base model and converted to the slot
layout of this engine (the model dtype, each linear's own part of A and B) once; its image
then stays in host memory, least recently used first out, so that giving it a GPU slot again
costs one host-to-device copy, not a disk read. On CUDA the images live in pinned memory, so
that copy runs asynchronously on a side stream (``LoRAManager``).

Reads run on worker threads when asked ahead of time (``prefetch``, most urgent first);
``get`` returns a cached image at once and otherwise waits for the read (one already under
way, or its own). The cache holds at most ``max_adapters`` images and ``max_bytes`` of them
(``default_max_bytes`` sizes the latter from the host's available memory) and evicts the least
recently used image, outside the last prefetch's window first; a read ahead never evicts an
image of that window, so reading ahead never throws out what is needed sooner. What is cached
decides only speed, never bits: an image holds exactly the values a slot receives.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from detlora.lora.pinned_arena import ArenaBlock, PinnedArena
from detlora.lora.request import LoRARequest
from detlora.lora.stats import LoRAStats

# Share of the host's available memory (at engine start) that the cache may hold by default.
HOST_MEMORY_FRACTION = 0.4
# Reader threads. More do not read faster: each read's torch ops already use the intra-op
# thread pool (8 readers on a 16-core host took 5x longer per read; docs/decisions.md).
READ_WORKERS = 2


@dataclass(frozen=True)
class ImagePiece:
    """One tensor of an image: A [rank, in] or B [out, rank] of slice ``slice`` of linear
    ``linear`` (the manager's numbering), at ``offset`` elements into the image's data."""

    linear: int
    slice: int
    kind: str  # "a" or "b"
    rank: int
    offset: int
    shape: tuple[int, int]

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]


@dataclass(frozen=True)
class ConvertedAdapter:
    """An adapter in the slot layout, before it is placed in the cache's memory."""

    hash: str
    pieces: tuple[ImagePiece, ...]
    tensors: tuple[torch.Tensor, ...]  # one per piece, the model dtype, contiguous
    scales: tuple[float, ...]  # one per linear (0.0 where no slice is targeted)


@dataclass(eq=False)
class AdapterImage:
    """A cached adapter: ``data_bytes`` bytes of piece data, then the fp32 scales, in one
    block of host memory (pinned on CUDA)."""

    request: LoRARequest
    hash: str
    pieces: tuple[ImagePiece, ...]
    layout: tuple[tuple[int, int, str, int], ...]  # (linear, slice, kind, rank) per piece
    block: ArenaBlock
    data_bytes: int
    scales_offset: int  # bytes into the block
    num_linears: int
    copied: torch.cuda.Event | None = field(default=None)  # the last copy that read it
    holds: int = 0  # users between ``get`` and ``release``: never evicted meanwhile

    @property
    def nbytes(self) -> int:
        """Bytes a slot copy moves (piece data and scales)."""
        return self.scales_offset + 4 * self.num_linears


def pack(request: LoRARequest, adapter: ConvertedAdapter, block: ArenaBlock,
         dtype: torch.dtype) -> AdapterImage:
    """Copy ``adapter`` into ``block`` (``image_bytes`` of it) as an image."""
    data_bytes = sum(p.numel for p in adapter.pieces) * dtype.itemsize
    scales_offset = -(-data_bytes // 16) * 16
    if data_bytes:
        data = block.data[:data_bytes].view(dtype)
        for p, t in zip(adapter.pieces, adapter.tensors, strict=True):
            data[p.offset: p.offset + p.numel].view(p.shape).copy_(t)
    n = len(adapter.scales)
    block.data[scales_offset: scales_offset + 4 * n].view(torch.float32).copy_(
        torch.tensor(adapter.scales, dtype=torch.float32))
    return AdapterImage(request, adapter.hash, adapter.pieces,
                        tuple((p.linear, p.slice, p.kind, p.rank) for p in adapter.pieces),
                        block, data_bytes, scales_offset, n)


class _NoRoom(LookupError):
    """A prefetched adapter found no room that evicts nothing more urgent: not kept."""


def image_bytes(adapter: ConvertedAdapter, dtype: torch.dtype) -> int:
    data_bytes = sum(p.numel for p in adapter.pieces) * dtype.itemsize
    return -(-data_bytes // 16) * 16 + 4 * len(adapter.scales)


def available_host_memory() -> int:
    """Bytes of host memory available now (MemAvailable on Linux, else free pages)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def default_max_bytes() -> int:
    return int(available_host_memory() * HOST_MEMORY_FRACTION)


class HostAdapterCache:
    def __init__(
        self,
        convert: Callable[[LoRARequest], ConvertedAdapter],
        *,
        dtype: torch.dtype,
        max_adapters: int | None,
        max_bytes: int | None,
        pin: bool,
        stats: LoRAStats,
        workers: int = READ_WORKERS,
    ) -> None:
        """``convert`` reads, checks and converts one adapter (on a worker thread for
        prefetches); its exceptions reach whoever ``get``s that adapter."""
        if max_adapters is not None and max_adapters < 1:
            raise ValueError(f"max_adapters must be positive, got {max_adapters}")
        self._convert = convert
        self.dtype = dtype
        self.max_adapters = max_adapters
        self.max_bytes = max_bytes
        self.stats = stats
        self._arena = PinnedArena(pin=pin)
        self._lock = threading.Lock()
        self._images: OrderedDict[int, AdapterImage] = OrderedDict()  # least recent first
        self._pending: dict[int, Future[AdapterImage]] = {}
        self._generation: dict[int, int] = {}  # bumped by drop: late reads are discarded
        self._wanted: frozenset[int] = frozenset()  # the last prefetch's window: kept if possible
        self._bytes = 0
        # Room made for reads not yet cached (images, bytes): concurrent reads see it taken.
        self._reserved = (0, 0)
        self._workers = workers
        self._pool: ThreadPoolExecutor | None = None

    # ---- queries ----

    def __contains__(self, lora_id: object) -> bool:
        with self._lock:
            return lora_id in self._images

    def cached(self) -> list[int]:
        """Ids of the cached images, least recently used first."""
        with self._lock:
            return list(self._images)

    @property
    def num_bytes(self) -> int:
        """Bytes of the cached images."""
        return self._bytes

    @property
    def reserved_bytes(self) -> int:
        """Host memory the cache holds (its arena's chunks)."""
        return self._arena.reserved_bytes

    # ---- reading ----

    def get(self, request: LoRARequest) -> tuple[AdapterImage, bool]:
        """(The image of ``request``'s adapter, whether it was cached already), held until
        ``release``: it is not evicted meanwhile. Waits for a read under way, or reads it
        now; a failed read raises here and is not kept."""
        waited = False
        while True:
            with self._lock:
                image = self._images.get(request.id)
                if image is not None:
                    self._images.move_to_end(request.id)
                    image.holds += 1
                    return image, not waited
                future = self._pending.get(request.id)
                gen = self._generation.get(request.id, 0)
            waited = True
            try:
                if future is None:
                    self._read(request, gen)
                else:
                    with contextlib.suppress(_NoRoom):  # read ahead, not kept: read it now
                        future.result()
            finally:
                if future is not None:
                    with self._lock:
                        if self._pending.get(request.id) is future:
                            del self._pending[request.id]
            # Cached now (or, rarely, evicted again by a concurrent read: read it again).

    def release(self, image: AdapterImage, copied: torch.cuda.Event | None = None) -> None:
        """End a ``get``'s hold; ``copied``: an event after the last copy that reads it."""
        with self._lock:
            if copied is not None:
                image.copied = copied
            image.holds -= 1

    def prefetch(self, requests: Sequence[LoRARequest]) -> int:
        """Start reading, on worker threads, those of ``requests`` (most urgent first) that
        are neither cached nor being read, as far as they fit beside the cached ones among
        them: ``requests`` is the window the cache keeps, so a prefetch never evicts a more
        urgent one. Returns how many reads were started."""
        started = 0
        with self._lock:
            for lora_id, future in list(self._pending.items()):
                # A finished read is cached (or not kept: may be read ahead again), not
                # pending; a failed one stays for ``get`` and ``failed`` to report.
                if future.done() and isinstance(future.exception(), _NoRoom | None):
                    del self._pending[lora_id]
            self._wanted = frozenset(r.id for r in requests)
            kept = sum(1 for i in self._images if i in self._wanted) + len(self._pending)
            for request in requests:
                if request.id in self._images or request.id in self._pending:
                    continue
                if self.max_adapters is not None and kept >= self.max_adapters:
                    break
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(self._workers,
                                                    thread_name_prefix="detlora-adapter-read")
                gen = self._generation.get(request.id, 0)
                self._pending[request.id] = self._pool.submit(self._read, request, gen, True)
                kept += 1
                started += 1
        return started

    def ready(self, lora_id: int) -> bool:
        """True when the adapter's image is cached (a slot copy would not wait for disk)."""
        with self._lock:
            return lora_id in self._images

    def failed(self, lora_id: int) -> bool:
        """True when a prefetch of this adapter ended in an error not yet reported."""
        with self._lock:
            future = self._pending.get(lora_id)
        return (future is not None and future.done()
                and not isinstance(future.exception(), _NoRoom | None))

    def drop(self, lora_id: int) -> bool:
        """Forget an adapter's image (a read under way is discarded); True if it was cached."""
        with self._lock:
            self._generation[lora_id] = self._generation.get(lora_id, 0) + 1
            self._pending.pop(lora_id, None)
            image = self._images.pop(lora_id, None)
            if image is not None:
                self._release(image)
        return image is not None

    def shutdown(self) -> None:
        """Stop the reader threads (reads under way finish; nothing new starts)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    # ---- internals ----

    def _read(self, request: LoRARequest, gen: int, ahead: bool = False) -> AdapterImage:
        """Read, check, convert and cache one adapter. ``ahead`` (a prefetch): make room only
        by evicting images outside the prefetch window, else keep nothing (``_NoRoom``)."""
        start = time.perf_counter()
        adapter = self._convert(request)
        nbytes = image_bytes(adapter, self.dtype)
        with self._lock:
            fits = self._make_room(nbytes, spare=self._wanted if ahead else frozenset())
            if ahead and not fits:
                self.stats.disk_seconds += time.perf_counter() - start
                raise _NoRoom(request.id)
            block = self._arena.alloc(max(1, nbytes))
            self._reserve(1, block.nbytes)
        try:
            image = pack(request, adapter, block, self.dtype)  # outside the lock: a memcpy
        except BaseException:
            with self._lock:
                self._reserve(-1, -block.nbytes)
                self._arena.free(block)
            raise
        with self._lock:
            self._reserve(-1, -block.nbytes)
            self.stats.disk_loads += 1
            self.stats.disk_seconds += time.perf_counter() - start
            dropped = self._generation.get(request.id, 0) != gen
            if dropped or request.id in self._images:  # dropped meanwhile, or read twice
                self._arena.free(block)
                if dropped:
                    raise LookupError(f"adapter id {request.id} was dropped while it was read")
                return self._images[request.id]
            self._images[request.id] = image
            self._bytes += image.block.nbytes
        return image

    def _reserve(self, images: int, nbytes: int) -> None:
        self._reserved = (self._reserved[0] + images, self._reserved[1] + nbytes)

    def _full(self, nbytes: int) -> bool:
        images, reserved = len(self._images) + self._reserved[0], self._bytes + self._reserved[1]
        return ((self.max_adapters is not None and images >= self.max_adapters)
                or (self.max_bytes is not None and reserved + nbytes > self.max_bytes))

    def _make_room(self, nbytes: int, spare: frozenset[int]) -> bool:
        """Evict least recently used images, those outside the prefetch window first, held
        and ``spare`` ones never (the lock is held), until one more image of ``nbytes`` fits;
        whether it fits (an image alone over ``max_bytes`` does)."""
        items = list(self._images.items())
        for order in ([x for x in items if x[0] not in self._wanted],
                      [x for x in items if x[0] in self._wanted]):
            for lora_id, image in order:
                if not self._full(nbytes):
                    return True
                if image.holds == 0 and lora_id not in spare:
                    del self._images[lora_id]
                    self._release(image)
                    self.stats.host_evictions += 1
        return not self._full(nbytes) or not self._images

    def _release(self, image: AdapterImage) -> None:
        if image.copied is not None:
            image.copied.synchronize()  # a slot copy may still read the block
        self._bytes -= image.block.nbytes
        self._arena.free(image.block)

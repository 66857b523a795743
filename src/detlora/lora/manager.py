"""Adapter slots: which adapter lives in which of the model's ``max_loras`` slots.

Per step the engine calls ``begin_step(requests)`` with the LoRARequest of every sequence
(None for no adapter), then ``slot_for(request)`` for each (-1 for None); ``activate`` does
both at once. ``lora_batch`` turns per-token slots into the ``LoRABatch`` of the
ForwardBatch. An adapter that is not resident is copied from the host cache (``host_cache``:
read from disk, checked and converted once) into a free slot, or into the slot of the least
recently used adapter that the step does not need. An adapter is read and checked before
anything is evicted for it, so a bad adapter never costs a good one its slot.

``prefetch`` looks ahead: it starts disk reads of the adapters the next steps will want and,
where a slot is free or idle, copies them in while the current step runs (``slot_writer``).
Where an adapter sits, which others are resident and when it was copied change no bit of any
output: a slot holds exactly the adapter's values, and every kernel treats slots alike.

An adapter read from disk again (after leaving the host cache) must have the content hash
first seen for its id, so the outputs of one id never silently change.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

from detlora.layers.forward_batch import LoRABatch
from detlora.layers.linear import LinearBase
from detlora.log import get_logger
from detlora.lora.adapter import LoRAAdapter
from detlora.lora.host_cache import (
    READ_WORKERS,
    AdapterImage,
    ConvertedAdapter,
    HostAdapterCache,
    ImagePiece,
    default_max_bytes,
)
from detlora.lora.peft_loader import load_peft_adapter
from detlora.lora.registry import LoRARegistry
from detlora.lora.request import LoRARequest, shown_path
from detlora.lora.slot_writer import SlotWriter
from detlora.lora.stats import LoRAStats
from detlora.models.causal_lm import DecoderForCausalLM
from detlora.ops.adapter_groups import group_tokens

logger = get_logger(__name__)


class LoRAManager:
    def __init__(
        self,
        model: DecoderForCausalLM,
        *,
        max_cpu_loras: int | None = None,
        max_cpu_bytes: int | None = None,
        read_workers: int = READ_WORKERS,
    ) -> None:
        """``max_cpu_loras``: adapters the host cache holds (at least ``max_loras``; None: no
        count limit). ``max_cpu_bytes``: bytes it holds (None: ``default_max_bytes()``, a
        share of the host memory available now)."""
        if model.lora_config is None:
            raise ValueError(
                "the model was built without LoRA slots (load_model(..., lora_config=...))")
        self.model = model
        self.max_loras = model.lora_config.max_loras
        self.max_rank = model.lora_config.max_lora_rank
        if max_cpu_loras is not None and (
                isinstance(max_cpu_loras, bool) or not isinstance(max_cpu_loras, int)
                or max_cpu_loras < self.max_loras):
            raise ValueError(f"max_cpu_loras must be an int >= max_loras ({self.max_loras}), "
                             f"got {max_cpu_loras!r}")
        self._linears = model.lora_linears()
        self._target_shapes = model.lora_target_shapes()
        first = self._linears[0][0].lora
        self.device = first.lora_a.device
        self.dtype = first.lora_a.dtype
        self.stats = LoRAStats()
        self.registry = LoRARegistry()  # id -> its request (path), before or at first load
        # The converter, not the manager, goes to the reader threads: no reference cycle
        # keeps the model alive once the engine is dropped.
        self.convert = AdapterConverter(tuple(self._linears), self._target_shapes,
                                        self.max_rank, self.dtype,
                                        MappingProxyType(model.lora_fused_targets()))
        self.host = HostAdapterCache(
            self.convert, dtype=self.dtype, max_adapters=max_cpu_loras,
            max_bytes=default_max_bytes() if max_cpu_bytes is None else max_cpu_bytes,
            pin=self.device.type == "cuda", stats=self.stats, workers=read_workers)
        self.writer = SlotWriter([lin for lin, _ in self._linears], self.max_loras,
                                 device=self.device, dtype=self.dtype)
        self._slots: OrderedDict[int, int] = OrderedDict()  # id -> slot, least recent first
        self._free = list(range(self.max_loras))
        self._hashes: dict[int, str] = {}  # id -> content hash, fixed at first load
        self._step: frozenset[int] = frozenset()  # ids the current step needs: never evicted

    @property
    def loads(self) -> int:
        """Adapters read from disk so far."""
        return self.stats.disk_loads

    # ---- registration ----

    def register(self, request: LoRARequest) -> None:
        """Register an adapter by path without reading it (see ``LoRARegistry``)."""
        self.registry.register(request)

    def check(self, request: LoRARequest) -> None:
        """ValueError when ``request``'s id is registered for another path."""
        self.registry.check(request)

    def load(self, request: LoRARequest) -> None:
        """Read, check and convert an adapter into the host cache now (no slot)."""
        self._check_path(request)
        image, _ = self.host.get(request)
        try:
            self._check_hash(request, image)
        finally:
            self.host.release(image)
        self.registry.note_loaded(request)

    def unregister(self, lora_id: int, *, in_use: Collection[int] = ()) -> bool:
        """Forget an adapter: its slot and host image are freed and its id may name another
        path later. ``in_use``: ids that unfinished requests need (refused). True if it was
        known."""
        if lora_id in in_use:
            raise ValueError(f"adapter id {lora_id} is in use by unfinished requests: "
                             "abort them first")
        known = self.remove(lora_id)
        known = self.host.drop(lora_id) or known
        known = self.registry.remove(lora_id) or known
        self._hashes.pop(lora_id, None)
        return known

    # ---- queries ----

    def slot_of(self, lora_id: int) -> int | None:
        """The slot of a resident adapter, or None (never loads)."""
        return self._slots.get(lora_id)

    def resident(self) -> list[int]:
        """Resident adapter ids, least recently used first."""
        return list(self._slots)

    def adapter_hash(self, request: LoRARequest | int) -> str:
        """Content hash of an adapter (by request or id), for fingerprints."""
        i = request.id if isinstance(request, LoRARequest) else request
        if i not in self._hashes:
            raise ValueError(f"adapter id {i} has never been loaded")
        return self._hashes[i]

    # ---- slot assignment ----

    def begin_step(self, requests: Sequence[LoRARequest | None]) -> None:
        """Declare the adapters of the coming step: none of them will be evicted by it. (The
        step before it has been launched by now.)"""
        self.writer.launched()
        paths: dict[int, str] = {}
        last = None
        for req in requests:
            if req is None or req is last:  # a run of one request object: checked once
                continue
            last = req
            if not isinstance(req, LoRARequest):
                raise ValueError(f"expected a LoRARequest or None, got {type(req).__name__}")
            known = paths.get(req.id)
            if known is not None and known == req.real_path:
                continue  # this id and directory passed the checks earlier in this step
            self._check_path(req, paths.setdefault(req.id, req.real_path))
        ids = set(paths)
        if len(ids) > self.max_loras:
            raise ValueError(f"the step uses {len(ids)} distinct adapters but only "
                             f"max_loras={self.max_loras} slots exist")
        self._step = frozenset(ids)

    def slot_for(self, request: LoRARequest | None) -> int:
        """The slot holding ``request``'s adapter (-1 for None), copying it in if needed. Work
        enqueued afterwards (the step) waits for the copy and is read before the slot is
        written again."""
        if request is None:
            return -1
        self._check_path(request)
        slot = self._slots.get(request.id)
        if slot is not None:
            self._slots.move_to_end(request.id)
            self.stats.slot_hits += 1
        else:
            start = time.perf_counter()
            slot = self._copy_in(request, keep=self._step | {request.id})
            self.stats.slot_misses += 1
            self.stats.swap_seconds += time.perf_counter() - start
            logger.debug("adapter %r (id %d) copied into slot %d in %.3f s", request.name,
                         request.id, slot, time.perf_counter() - start)
        self.writer.use([slot])
        return slot

    def activate(self, requests: Sequence[LoRARequest | None]) -> list[int]:
        """``begin_step(requests)``, then every request's slot (-1: none)."""
        self.begin_step(requests)
        return [self.slot_for(r) for r in requests]

    def add(self, request: LoRARequest) -> int:
        """Make one adapter resident (e.g. ahead of traffic); returns its slot."""
        return self.activate([request])[0]

    def remove(self, lora_id: int) -> bool:
        """Free an adapter's slot; True if it was resident."""
        slot = self._slots.pop(lora_id, None)
        if slot is None:
            return False
        self.writer.clear(slot)
        self._free.append(slot)
        self._free.sort()
        return True

    def prefetch(self, upcoming: Sequence[LoRARequest], keep: Collection[int] = ()) -> int:
        """Prepare the adapters of the next steps, ``upcoming`` (most urgent first): start
        reading those not in the host cache on worker threads, and copy those that are cached
        into free slots, or into slots of adapters outside ``keep`` (those a later step still
        reads: the running requests', less any whose requests all end in the launched step)
        and ``upcoming``, while the current step runs (call it once the step is launched: a
        copy into a slot it reads waits for it on the GPU). Never waits for disk and never
        fails: a bad adapter's error comes when a step needs it. Returns how many adapters
        were copied into slots."""
        self.writer.launched()  # the step prepared last is enqueued: its slots are marked
        self.host.prefetch([r for r in upcoming if r.id not in self._slots])
        protected = set(keep) | {r.id for r in upcoming}
        copied = 0
        for request in upcoming:
            if request.id in self._slots or not self.host.ready(request.id):
                continue
            if not self._free and not any(i not in protected for i in self._slots):
                break
            start = time.perf_counter()
            try:
                self._copy_in(request, keep=protected)
            except ValueError:
                continue  # reported when a step asks for it
            self.stats.prefetch_swaps += 1
            self.stats.swap_seconds += time.perf_counter() - start
            copied += 1
        return copied

    def lora_batch(self, token_slots: torch.Tensor, *, validate: bool = True) -> LoRABatch:
        """Per-token slots ([T] ints, -1 = none) grouped once for every layer of a step."""
        return LoRABatch(group_tokens(token_slots, self.max_loras, validate=validate))

    def shutdown(self) -> None:
        """Stop the host cache's reader threads."""
        self.host.shutdown()

    # ---- internals ----

    def _copy_in(self, request: LoRARequest, keep: Collection[int]) -> int:
        """Give ``request``'s adapter a slot (free, else the least recently used one outside
        ``keep``) and start copying it in; the adapter is read and checked first."""
        image, cached = self.host.get(request)
        copied = None
        try:
            self._check_hash(request, image)
            slot = self._free.pop(0) if self._free else self._evict(keep)
            copied = self.writer.write(slot, image)
        finally:
            self.host.release(image, copied)
        self._slots[request.id] = slot
        self.registry.note_loaded(request)
        self.stats.swaps += 1
        if cached:
            self.stats.host_hits += 1
        else:
            self.stats.host_misses += 1
        return slot

    def _check_path(self, req: LoRARequest, step_path: str | None = None) -> None:
        """One id names one adapter directory (its real path: every spelling of it is the same
        adapter): that of its registration or first successful load, or within a step that
        of its first request (``step_path``). A failed load registers nothing, so a mistyped
        path can be corrected under the same id."""
        self.registry.check(req)
        known = step_path or req.real_path
        if known != req.real_path:
            raise ValueError(f"adapter id {req.id} was first used for {known!r}, "
                             f"now for {shown_path(req)!r}: one id must name one adapter")

    def _check_hash(self, req: LoRARequest, image: AdapterImage) -> None:
        known = self._hashes.setdefault(req.id, image.hash)
        if known != image.hash:
            self.host.drop(req.id)
            raise ValueError(f"adapter {req.name!r} (id {req.id}) at {req.path} changed on "
                             "disk since it was first loaded; give the new version a new id")

    def _evict(self, keep: Collection[int]) -> int:
        for i, slot in self._slots.items():  # least recently used first
            if i not in keep:
                del self._slots[i]
                self.stats.slot_evictions += 1
                logger.debug("adapter id %d evicted from slot %d", i, slot)
                return slot
        raise ValueError(f"all {self.max_loras} adapter slots hold adapters of the current "
                         "step; call begin_step with every request of the step first")


@dataclass(frozen=True)
class AdapterConverter:
    """Reads and checks an adapter and lays it out for a model's slots (on the host cache's
    reader threads): per linear its own part of A and B (tensor parallelism), in the model
    dtype, and one scale."""

    linears: tuple[tuple[LinearBase, tuple[str, ...]], ...]
    target_shapes: Mapping[str, tuple[int, int]]
    max_rank: int
    dtype: torch.dtype
    fused: Mapping[str, tuple[str, ...]] = field(  # lora_fused_targets()
        default_factory=lambda: MappingProxyType({}))

    def __call__(self, req: LoRARequest) -> ConvertedAdapter:
        adapter = load_peft_adapter(req.path, self.target_shapes, self.max_rank, self.fused)
        self._check_fusable(adapter)
        pieces: list[ImagePiece] = []
        tensors: list[torch.Tensor] = []
        scales: list[float] = []
        offset = 0
        for index, (linear, names) in enumerate(self.linears):
            mods = [adapter.modules.get(n) for n in names]
            present = [m for m in mods if m is not None]
            scales.append(present[0].scale if present else 0.0)
            for s, m in enumerate(mods):
                if m is None:
                    continue
                for kind, full, dim in (("a", m.a, 1), ("b", m.b, 0)):
                    t = linear.shard(full, s, dim).to(self.dtype).contiguous()
                    shape = (int(t.shape[0]), int(t.shape[1]))
                    pieces.append(ImagePiece(index, s, kind, m.rank, offset, shape))
                    tensors.append(t)
                    offset += t.numel()
        return ConvertedAdapter(adapter.hash, tuple(pieces), tuple(tensors), tuple(scales))

    def _check_fusable(self, adapter: LoRAAdapter) -> None:
        # Fused slices (q/k/v, gate/up) share one scale per slot.
        for _, names in self.linears:
            scales = {adapter.modules[n].scale for n in names if n in adapter.modules}
            if len(scales) > 1:
                raise ValueError(
                    f"{adapter.path}: modules {list(names)} are fused in the engine and need "
                    f"one scale (alpha/r), but rank_pattern/alpha_pattern give {sorted(scales)}"
                )

"""Adapter slots: which adapter lives in which of the model's ``max_loras`` slots.

Per step the engine calls ``begin_step(requests)`` with the LoRARequest of every sequence
(None for no adapter), then ``slot_for(request)`` for each (-1 for None); ``activate`` does
both at once. ``lora_batch`` turns per-token slots into the ``LoRABatch`` of the
ForwardBatch. An adapter not yet resident is read from disk, checked, and written into a free
slot, or into the slot of the least recently used adapter that the step does not need. An
adapter is checked before anything is evicted for it, so a bad adapter never costs a good one
its slot.

An evicted adapter is read again from disk when it comes back; its content hash must equal the
one first seen for its id, so the outputs of one id never silently change.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from detlora.layers.forward_batch import LoRABatch
from detlora.lora.adapter import LoRAAdapter
from detlora.lora.peft_loader import load_peft_adapter
from detlora.lora.registry import LoRARegistry
from detlora.lora.request import LoRARequest, shown_path
from detlora.lora.stats import LoRAStats
from detlora.models.causal_lm import DecoderForCausalLM
from detlora.ops.adapter_groups import group_tokens


@dataclass(frozen=True)
class _Resident:
    slot: int
    request: LoRARequest
    hash: str


class LoRAManager:
    def __init__(self, model: DecoderForCausalLM) -> None:
        if model.lora_config is None:
            raise ValueError(
                "the model was built without LoRA slots (load_model(..., lora_config=...))")
        self.model = model
        self.max_loras = model.lora_config.max_loras
        self.max_rank = model.lora_config.max_lora_rank
        self._linears = model.lora_linears()
        self._target_shapes = model.lora_target_shapes()
        self._resident: OrderedDict[int, _Resident] = OrderedDict()  # least recent first
        self._free = list(range(self.max_loras))
        self.registry = LoRARegistry()  # id -> its request (path), before or at first load
        self._hashes: dict[int, str] = {}  # id -> content hash, fixed at first load
        self._step: frozenset[int] = frozenset()  # ids the current step needs: never evicted
        self.stats = LoRAStats()

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

    def unregister(self, lora_id: int, *, in_use: Collection[int] = ()) -> bool:
        """Forget an adapter: its slot is freed and its id may name another path later.
        ``in_use``: ids that unfinished requests need (refused). True if it was known."""
        if lora_id in in_use:
            raise ValueError(f"adapter id {lora_id} is in use by unfinished requests: "
                             "abort them first")
        known = self.remove(lora_id)
        known = self.registry.remove(lora_id) or known
        self._hashes.pop(lora_id, None)
        return known

    # ---- queries ----

    def slot_of(self, lora_id: int) -> int | None:
        """The slot of a resident adapter, or None (never loads)."""
        r = self._resident.get(lora_id)
        return None if r is None else r.slot

    def resident(self) -> list[int]:
        """Resident adapter ids, least recently used first."""
        return list(self._resident)

    def adapter_hash(self, request: LoRARequest | int) -> str:
        """Content hash of an adapter (by request or id), for fingerprints."""
        i = request.id if isinstance(request, LoRARequest) else request
        if i not in self._hashes:
            raise ValueError(f"adapter id {i} has never been loaded")
        return self._hashes[i]

    # ---- slot assignment ----

    def begin_step(self, requests: Sequence[LoRARequest | None]) -> None:
        """Declare the adapters of the coming step: none of them will be evicted by it."""
        paths: dict[int, str] = {}
        for req in requests:
            if req is None:
                continue
            if not isinstance(req, LoRARequest):
                raise ValueError(f"expected a LoRARequest or None, got {type(req).__name__}")
            self._check_path(req, paths.setdefault(req.id, req.real_path))
        ids = set(paths)
        if len(ids) > self.max_loras:
            raise ValueError(f"the step uses {len(ids)} distinct adapters but only "
                             f"max_loras={self.max_loras} slots exist")
        self._step = frozenset(ids)

    def slot_for(self, request: LoRARequest | None) -> int:
        """The slot holding ``request``'s adapter (-1 for None), loading it if needed."""
        if request is None:
            return -1
        self._check_path(request)
        r = self._resident.get(request.id)
        if r is not None:
            self._resident.move_to_end(request.id)
            self.stats.slot_hits += 1
            return r.slot
        start = time.perf_counter()
        adapter = self._load(request)  # checked before anything is evicted for it
        slot = self._free.pop(0) if self._free else self._evict(keep=self._step | {request.id})
        self._write(slot, adapter)
        self._resident[request.id] = _Resident(slot, request, adapter.hash)
        self.registry.note_loaded(request)
        self.stats.slot_misses += 1
        self.stats.swaps += 1
        self.stats.swap_seconds += time.perf_counter() - start
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
        r = self._resident.pop(lora_id, None)
        if r is None:
            return False
        self._clear(r.slot)
        self._free.append(r.slot)
        self._free.sort()
        return True

    def lora_batch(self, token_slots: torch.Tensor, *, validate: bool = True) -> LoRABatch:
        """Per-token slots ([T] ints, -1 = none) grouped once for every layer of a step."""
        return LoRABatch(group_tokens(token_slots, self.max_loras, validate=validate))

    # ---- internals ----

    def _check_path(self, req: LoRARequest, step_path: str | None = None) -> None:
        """One id names one adapter directory (its real path: every spelling of it is the same
        adapter): that of its first successful load or registration, or within a step that
        of its first request (``step_path``). A failed load pins nothing, so a mistyped path
        can be corrected under the same id."""
        self.registry.check(req)
        known = step_path or req.real_path
        if known != req.real_path:
            raise ValueError(f"adapter id {req.id} was first used for {known!r}, "
                             f"now for {shown_path(req)!r}: one id must name one adapter")

    def _load(self, req: LoRARequest) -> LoRAAdapter:
        start = time.perf_counter()
        adapter = load_peft_adapter(req.path, self._target_shapes, self.max_rank)
        self.stats.disk_seconds += time.perf_counter() - start
        self._check_fusable(adapter)
        known = self._hashes.setdefault(req.id, adapter.hash)
        if known != adapter.hash:
            raise ValueError(f"adapter {req.name!r} (id {req.id}) at {req.path} changed on "
                             "disk since it was first loaded; give the new version a new id")
        self.stats.disk_loads += 1
        return adapter

    def _check_fusable(self, adapter: LoRAAdapter) -> None:
        # Fused slices (q/k/v, gate/up) share one scale per slot.
        for _, names in self._linears:
            scales = {adapter.modules[n].scale for n in names if n in adapter.modules}
            if len(scales) > 1:
                raise ValueError(
                    f"{adapter.path}: modules {list(names)} are fused in the engine and need "
                    f"one scale (alpha/r), but rank_pattern/alpha_pattern give {sorted(scales)}"
                )

    def _evict(self, keep: Collection[int]) -> int:
        for i, r in self._resident.items():  # least recently used first
            if i not in keep:
                del self._resident[i]
                self.stats.slot_evictions += 1
                return r.slot
        raise ValueError(f"all {self.max_loras} adapter slots hold adapters of the current "
                         "step; call begin_step with every request of the step first")

    def _write(self, slot: int, adapter: LoRAAdapter) -> None:
        for linear, names in self._linears:
            mods = [adapter.modules.get(n) for n in names]
            present = [m for m in mods if m is not None]
            scale = present[0].scale if present else 0.0
            linear.set_lora(
                slot,
                [None if m is None else m.a for m in mods],
                [None if m is None else m.b for m in mods],
                scale,
            )

    def _clear(self, slot: int) -> None:
        for linear, _ in self._linears:
            linear.clear_lora(slot)

"""Registered adapters: the LoRARequest each id names, known before any adapter is read.

A server registers its adapters by path up front (``register``) and the engine reads each one
only when a request first needs it. One id names one directory for as long as it is
registered; an id that was never registered is registered by the first successful load of a
request that names it, so a mistyped path can be corrected under the same id. A directory is
its real path (``LoRARequest.real_path``): every spelling of it names the same adapter.
Names are for humans and servers (a model name per adapter): ``register`` refuses a name
another id has.
"""

from __future__ import annotations

from pathlib import Path

from detlora.lora.request import LoRARequest, shown_path


class LoRARegistry:
    def __init__(self) -> None:
        self._by_id: dict[int, LoRARequest] = {}  # in registration order

    def register(self, request: LoRARequest) -> LoRARequest:
        """Register ``request`` without reading its weights; returns the registered request.
        Registering the same (id, path) again is a no-op. Raises FileNotFoundError for a
        missing directory and ValueError when the id names another path or the name another
        id."""
        self._check_type(request)
        if not Path(request.path).is_dir():
            raise FileNotFoundError(f"adapter directory {request.path} does not exist "
                                    f"(LoRARequest {request.name!r}, id {request.id})")
        self.check(request)
        for other in self._by_id.values():
            if other.name == request.name and other.id != request.id:
                raise ValueError(f"adapter name {request.name!r} is registered for id "
                                 f"{other.id}: give id {request.id} another name")
        return self._by_id.setdefault(request.id, request)

    def check(self, request: LoRARequest) -> None:
        """ValueError when ``request``'s id is registered for another path."""
        self._check_type(request)
        known = self._by_id.get(request.id)
        if known is not None and known.real_path != request.real_path:
            raise ValueError(f"adapter id {request.id} was first used for "
                             f"{shown_path(known)!r}, now for {shown_path(request)!r}: one id "
                             "must name one adapter")

    def note_loaded(self, request: LoRARequest) -> None:
        """A request's adapter was read successfully: its id now names its path."""
        self.check(request)
        self._by_id.setdefault(request.id, request)

    def get(self, lora_id: int) -> LoRARequest | None:
        return self._by_id.get(lora_id)

    def remove(self, lora_id: int) -> bool:
        """Forget an id (its path and name become free); True if it was registered."""
        return self._by_id.pop(lora_id, None) is not None

    def requests(self) -> list[LoRARequest]:
        """Every registered request, in registration order."""
        return list(self._by_id.values())

    def __contains__(self, lora_id: object) -> bool:
        return lora_id in self._by_id

    def __len__(self) -> int:
        return len(self._by_id)

    @staticmethod
    def _check_type(request: object) -> None:
        if not isinstance(request, LoRARequest):
            raise TypeError(f"expected a LoRARequest, got {type(request).__name__}")

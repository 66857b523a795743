"""LoRARequest: which adapter a prompt runs with.

Fields ``name``, ``id``, ``path``; vLLM's spellings (``lora_name``, ``lora_int_id``,
``lora_path``) work as keyword arguments and attributes, so vLLM code ports unchanged:
``LoRARequest("tox", 1, "/adapters/tox")`` means the same in both.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from os import PathLike


@dataclass(frozen=True, init=False)
class LoRARequest:
    """An adapter, named by a positive integer id that stays tied to one PEFT directory.

    The engine keys its adapter slots by ``id``; ``name`` is for humans. The directory is
    ``real_path``: ``path`` resolved when the request is made (symlinks, ``..``, a trailing
    slash, the working directory), so every spelling of one directory names one adapter.
    """

    name: str
    id: int
    path: str

    def __init__(
        self,
        name: str | None = None,
        id: int | None = None,
        path: str | PathLike | None = None,
        *,
        lora_name: str | None = None,
        lora_int_id: int | None = None,
        lora_path: str | PathLike | None = None,
    ) -> None:
        values = {}
        for field, value, alias in (("name", name, lora_name), ("id", id, lora_int_id),
                                    ("path", path, lora_path)):
            if value is not None and alias is not None:
                raise ValueError(f"give {field} once (as {field} or as its vLLM alias)")
            values[field] = value if value is not None else alias
        if not isinstance(values["name"], str) or not values["name"]:
            raise ValueError(f"LoRARequest name must be a non-empty string, "
                             f"got {values['name']!r}")
        i = values["id"]
        if isinstance(i, bool) or not isinstance(i, int) or i < 1:
            raise ValueError(f"LoRARequest id (lora_int_id) must be a positive int, got {i!r}")
        p = values["path"]
        if isinstance(p, PathLike):
            p = str(p)
        if not isinstance(p, str) or not p:
            raise ValueError(f"LoRARequest path must be a non-empty path, got {p!r}")
        object.__setattr__(self, "name", values["name"])
        object.__setattr__(self, "id", i)
        object.__setattr__(self, "path", p)
        object.__setattr__(self, "_real_path", os.path.realpath(p))

    def __hash__(self) -> int:
        """The id's hash: equal requests have equal ids, and sets and dicts of requests (the
        scheduler's, every step) hash one int instead of three fields."""
        return hash(self.id)

    @property
    def real_path(self) -> str:
        """The adapter directory: ``path`` resolved when this request was made."""
        return self._real_path

    # vLLM's attribute names.
    @property
    def lora_name(self) -> str:
        return self.name

    @property
    def lora_int_id(self) -> int:
        return self.id

    @property
    def lora_path(self) -> str:
        return self.path


def shown_path(request: LoRARequest) -> str:
    """A request's path as given, with the directory it resolves to when that differs."""
    if request.path == request.real_path:
        return request.path
    return f"{request.path} ({request.real_path})"

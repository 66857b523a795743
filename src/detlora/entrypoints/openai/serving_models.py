"""The models a server answers to: the base model and each adapter under its own name.

Adapters come from ``--lora-modules`` at start-up, or, with runtime loading switched on, from
``/v1/load_lora_adapter`` with a path under ``--lora-root``: the path is resolved (``..`` and
symbolic links followed) and must stay inside the resolved root, and the adapter must be
safetensors (``adapter_model.safetensors``; pickled weights are never read). Each adapter is
loaded and checked by the engine before it is listed, so its fingerprint is known.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from detlora.engine.async_llm import AsyncLLM
from detlora.entrypoints.openai.errors import OpenAIError, bad_request, model_not_found
from detlora.lora.request import LoRARequest

WEIGHTS_FILE = "adapter_model.safetensors"


@dataclass(frozen=True)
class ServedAdapter:
    request: LoRARequest
    created: int
    fingerprint: str


class ServingModels:
    def __init__(self, llm: AsyncLLM, base_name: str, *, lora_root: str | None = None,
                 enable_loading: bool = False) -> None:
        self.llm = llm
        self.base_name = base_name
        self.created = int(time.time())
        self.adapters: dict[str, ServedAdapter] = {}
        self._next_id = 1
        self.enable_loading = enable_loading
        self.lora_root = Path(os.path.realpath(lora_root)) if lora_root else None

    def resolve(self, name: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names (None: the base model); 404 otherwise."""
        if name is None or name == self.base_name:
            return None
        adapter = self.adapters.get(name)
        if adapter is None:
            raise model_not_found(name)
        return adapter.request

    def list(self) -> dict:
        data = [{"id": self.base_name, "object": "model", "created": self.created,
                 "owned_by": "detlora", "root": self.base_name, "parent": None,
                 "max_model_len": self.llm.info.max_model_len}]
        for name, a in self.adapters.items():
            data.append({"id": name, "object": "model", "created": a.created,
                         "owned_by": "detlora", "root": name, "parent": self.base_name})
        return {"object": "list", "data": data}

    async def add(self, name: str, path: str, *, trusted: bool) -> ServedAdapter:
        """Load adapter ``name`` from ``path``. ``trusted`` (--lora-modules, the operator's
        own paths): any path; otherwise it must resolve under the adapter root."""
        if not name or name == self.base_name:
            raise bad_request(f"adapter name {name!r} is empty or the base model's name",
                              "lora_name")
        if name in self.adapters:
            raise bad_request(f"an adapter named {name!r} is already loaded", "lora_name")
        real = self._resolve_path(path) if not trusted else Path(os.path.realpath(path))
        if not (real / WEIGHTS_FILE).is_file():
            shown = path if not trusted else str(real)
            raise bad_request(f"{shown}: no {WEIGHTS_FILE} (adapters load from safetensors "
                              "only)", "lora_path")
        request = LoRARequest(name, self._next_id, str(real))
        try:
            fingerprint = await self.llm.add_lora(request)
        except ValueError as e:
            message = str(e) if trusted else str(e).replace(str(real), path)
            raise bad_request(f"adapter {name!r} was refused: {message}", "lora_path") from None
        self._next_id += 1
        adapter = ServedAdapter(request, int(time.time()), fingerprint)
        self.adapters[name] = adapter
        return adapter

    def _resolve_path(self, path: str) -> Path:
        if self.lora_root is None:
            raise OpenAIError(400, "runtime adapter loading is off")
        if not isinstance(path, str) or not path or "\0" in path:
            raise bad_request("lora_path must be a non-empty path", "lora_path")
        candidate = Path(path)
        if not candidate.is_absolute():
            candidate = self.lora_root / candidate
        real = Path(os.path.realpath(candidate))
        if real != self.lora_root and self.lora_root not in real.parents:
            raise bad_request("lora_path must be inside the server's adapter root",
                              "lora_path")
        if not real.is_dir():
            raise bad_request(f"{path}: no adapter directory there", "lora_path")
        return real

    async def remove(self, name: str) -> None:
        adapter = self.adapters.pop(name, None)
        if adapter is None:
            raise model_not_found(name)
        await self.llm.remove_lora(adapter.request.id)


__all__ = ["ServedAdapter", "ServingModels"]

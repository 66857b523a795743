"""Checked reads of config.json fields (models/spec.py and models/gemma_config.py): numbers
finite and in range, token ids, dtypes; every error names the file and the field."""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch

_DTYPES: Mapping[str, torch.dtype] = MappingProxyType(
    {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
)
# Bounds on config sizes: token ids are int32 on the device, positions index int32 tables.
_MAX_SIZE = 1 << 24
_MAX_TOKENS = (1 << 31) - 1


class _Reader:
    """Typed, checked access to config fields; errors name the file and the field."""

    def __init__(self, cfg: Mapping[str, Any], source: str) -> None:
        self.cfg, self.source = cfg, source

    def _get(self, key: str, default: Any) -> Any:
        value = self.cfg.get(key)
        if value is None:
            if default is None:
                raise ValueError(f"{self.source}: required field {key!r} is missing")
            return default
        return value

    def int(self, key: str, default: int | None = None, high: int = _MAX_SIZE) -> int:
        v = self._get(key, default)
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= high:
            raise ValueError(f"{self.source}: {key} must be an integer in [1, {high}], "
                             f"got {v!r}")
        return v

    def float(self, key: str, default: float | None = None,
              below: float | None = None) -> float:
        v = self._get(key, default)
        if not _positive(v) or (below is not None and v >= below):
            upper = "" if below is None else f" below {below}"
            raise ValueError(f"{self.source}: {key} must be a finite positive number{upper}, "
                             f"got {v!r}")
        return float(v)

    def bool(self, key: str, default: bool) -> bool:
        v = self.cfg.get(key, default)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise ValueError(f"{self.source}: {key} must be true or false, got {v!r}")
        return v


def _positive(v: object) -> bool:
    """A finite number > 0 (not a bool)."""
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) \
        and v > 0


def _token_ids(cfg: Mapping[str, Any], key: str, source: str) -> tuple[int, ...]:
    value = cfg.get(key)
    values = [] if value is None else value if isinstance(value, list) else [value]
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in values):
        raise ValueError(f"{source}: {key} must be a token id or a list of them, got {value!r}")
    return tuple(values)

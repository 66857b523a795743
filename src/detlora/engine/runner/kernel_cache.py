"""Whether this machine has compiled this build's GPU kernels for this model before.

Triton compiles a kernel the first time a process launches it and keeps the binary in its
cache directory (``$TRITON_CACHE_DIR``, else ``~/.triton/cache``); later processes load it
from there. An engine's first start on a machine therefore spends most of its time compiling
(graph capture runs every kernel variant a step can take). The engine says so in its log the
first time, and drops a marker into that cache once its kernels are built, keyed by what
decides which kernels exist: the compute code, Triton's and torch's versions, the GPU, the
model's shape and dtype and the determinism level.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

_MARKER_DIR = "detlora"


def kernel_key(spec: Mapping[str, Any], dtype: torch.dtype, device: torch.device, level: str,
               tensor_parallel_size: int) -> dict[str, Any]:
    """What decides which kernels an engine compiles: the compute code, the versions, the
    GPU, the model's shape (``ModelSpec.canonical()``) and dtype, the level and the TP size."""
    from detlora.engine.fingerprint import device_description, source_digest

    try:
        triton_version = metadata.version("triton")
    except metadata.PackageNotFoundError:
        triton_version = "absent"
    return {"source": source_digest(), "torch": torch.__version__, "triton": triton_version,
            "device": device_description(device), "spec": dict(spec), "dtype": str(dtype),
            "level": level, "tensor_parallel_size": tensor_parallel_size}


def triton_cache_dir() -> Path:
    """Where Triton keeps compiled kernels."""
    try:
        import triton

        return Path(triton.knobs.cache.dir)
    except (ImportError, AttributeError):  # older Triton: the same default
        return Path(os.environ.get("TRITON_CACHE_DIR")
                    or Path(os.environ.get("TRITON_HOME", Path.home())) / ".triton" / "cache")


def kernel_cache_marker(key: Mapping[str, Any]) -> Path:
    """The marker file for ``key`` (any JSON-able description of what the kernels depend
    on) inside Triton's cache."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()
    return triton_cache_dir() / _MARKER_DIR / f"kernels-{digest[:24]}.json"


def kernels_cached(key: Mapping[str, Any]) -> bool:
    """True when an engine with this ``key`` finished building its kernels on this machine
    (and Triton's cache still holds the marker it left)."""
    return kernel_cache_marker(key).is_file()


def mark_kernels_cached(key: Mapping[str, Any], seconds: float) -> None:
    """Record that the kernels for ``key`` are compiled (best effort: a read-only cache only
    means the next start says "first start" again)."""
    path = kernel_cache_marker(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, "build_seconds": round(seconds, 1)},
                                  sort_keys=True, default=str))
        tmp.replace(path)
    except OSError:
        pass

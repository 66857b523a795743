"""The fingerprint of an output: a short hash of everything that decides its bits.

Two outputs with equal fingerprints (and equal request: prompt, sampling parameters, seed)
must be equal to the bit, within the promise of the determinism level the fingerprint names.
So the hash covers the weights, the request's adapter, dtype, determinism level, LoRA
reduction, which implementation runs every op, the source of the code that computes (ops,
layers, models, lora, engine: kernel configurations live there), library versions, and the
device (GPU model and CUDA version, or the CPU model and the vector ISA torch dispatches to).
It may change when outputs do not (e.g. a comment edited in an op file); never the reverse.
"""

from __future__ import annotations

import hashlib
import json
import platform
from collections.abc import Mapping
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

import detlora

_SOURCE_DIRS = ("ops", "layers", "models", "lora", "engine")


@cache
def source_digest() -> str:
    """sha256 over the package's compute code (file names and bytes, sorted)."""
    root = Path(detlora.__file__).resolve().parent
    h = hashlib.sha256()
    for sub in _SOURCE_DIRS:
        for path in sorted((root / sub).rglob("*.py")):
            h.update(str(path.relative_to(root)).encode() + b"\0")
            h.update(path.read_bytes() + b"\0")
    return h.hexdigest()


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "absent"


@cache
def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_description(device: torch.device) -> dict[str, str]:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return {"gpu": props.name, "cuda": str(torch.version.cuda),
                "capability": f"{props.major}.{props.minor}"}
    return {"gpu": "cpu", "cpu": _cpu_model(),
            "cpu_capability": str(torch.backends.cpu.get_cpu_capability())}


def engine_fingerprint_parts(
    *,
    weights_hash: str,
    dtype: torch.dtype,
    device: torch.device,
    backend: Mapping[str, str],
    settings: Mapping[str, Any],
) -> dict[str, Any]:
    """What the engine contributes; adapters are added per request by :func:`fingerprint`."""
    return {
        "weights": weights_hash,
        "dtype": str(dtype).replace("torch.", ""),
        "backend": dict(backend),
        "settings": dict(settings),
        "source": source_digest(),
        "versions": {"torch": torch.__version__, "triton": _version("triton"),
                     "detlora": detlora.__version__},
        "device": device_description(device),
    }


def fingerprint(parts: Mapping[str, Any], adapter_hash: str | None) -> str:
    """16 hex digits over the engine's parts and the request's adapter hash."""
    blob = json.dumps({**parts, "adapter": adapter_hash}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]

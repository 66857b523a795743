"""The fingerprint of an output: a short hash of everything that decides its bits.

Two outputs with equal fingerprints (and equal request: prompt, sampling parameters, seed)
must be equal to the bit, within the promise of the determinism level the fingerprint names.
So the hash covers the weights, the request's adapter, dtype, determinism level, LoRA
reduction, which implementation runs every op, the source of the code that computes (ops,
layers, models, lora, engine: kernel configurations live there), library versions, and the
device (GPU model and CUDA version, or the CPU model and the vector ISA torch dispatches to).
Source enters as syntax trees without docstrings, so an edited comment or docstring leaves
fingerprints unchanged while any change to executable code changes them.
"""

from __future__ import annotations

import ast
import hashlib
import json
import platform
from collections.abc import Mapping
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

# The code that computes: its behaviour, not its prose, goes into the fingerprint.
_SOURCE_DIRS = ("ops", "layers", "models", "lora", "engine", "distributed", "decisions")
_SOURCE_FILES = ("config.py",)
_ROOT = Path(__file__).resolve().parents[1]


def code_digest(source: str) -> str:
    """sha256 of a module's syntax tree with docstrings removed (comments never reach it):
    editing prose leaves it unchanged, any change to what runs changes it."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and body and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str)
        ):
            node.body = body[1:] or [ast.Pass()]
    return hashlib.sha256(ast.dump(tree, include_attributes=False).encode()).hexdigest()


@cache
def source_digest() -> str:
    """sha256 over the compute code (each module's ``code_digest``) and its data files (tuned
    tables, as parsed JSON), by relative path."""
    h = hashlib.sha256()
    paths = [_ROOT / f for f in _SOURCE_FILES]
    for sub in _SOURCE_DIRS:
        paths += (_ROOT / sub).rglob("*.py")
        paths += (_ROOT / sub).rglob("*.json")
    for path in sorted(paths):
        if path.suffix == ".py":
            digest = code_digest(path.read_text())
        else:
            digest = json.dumps(json.loads(path.read_text()), sort_keys=True)
        h.update(str(path.relative_to(_ROOT)).encode() + b"\0" + digest.encode() + b"\0")
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
                     "detlora": _version("detlora")},
        "device": device_description(device),
    }


def fingerprint(parts: Mapping[str, Any], adapter_hash: str | None) -> str:
    """16 hex digits over the engine's parts and the request's adapter hash."""
    blob = json.dumps({**parts, "adapter": adapter_hash}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


# The fingerprint's inputs by name, in the order a mismatch is reported: the first ones say
# the two runs cannot be compared at all (another level, device, library or code), the last
# ones which artifact (weights, adapter) or engine setting differs.
FIELDS = ("level", "device", "versions", "source", "dtype", "lora_reduction", "kernels",
          "settings", "weights", "adapter")


def _digest16(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def fingerprint_fields(parts: Mapping[str, Any], adapter_hash: str | None) -> dict[str, str]:
    """The inputs of :func:`fingerprint`, one string each (nested ones as a 16-hex digest), so
    that two outputs whose fingerprints differ can say which input did. Equal fields give
    equal fingerprints."""
    backend = dict(parts["backend"])
    level = str(backend.pop("determinism", "unknown"))
    reduction = str(backend.pop("lora_reduction", "unknown"))
    return {
        "level": level,
        "device": ", ".join(f"{k}={v}" for k, v in sorted(parts["device"].items())),
        "versions": ", ".join(f"{k}={v}" for k, v in sorted(parts["versions"].items())),
        "source": str(parts["source"]),
        "dtype": str(parts["dtype"]),
        "lora_reduction": reduction,
        "kernels": _digest16(backend),
        "settings": _digest16(parts["settings"]),
        "weights": str(parts["weights"]),
        "adapter": adapter_hash or "none",
    }

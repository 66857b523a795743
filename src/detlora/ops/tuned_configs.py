"""Tuned kernel configurations, kept as JSON data files in ``detlora/ops/configs/``.

Tile tables are measured, not derived, so they live beside their ops as data (as vLLM keeps
its tuned configs): a retune edits a file, and the engine fingerprint hashes its contents.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any


@cache
def tuned_config(name: str) -> dict[str, Any]:
    """The parsed ``configs/<name>.json`` of this package."""
    text = resources.files("detlora.ops").joinpath("configs", f"{name}.json").read_text()
    return json.loads(text)

"""Reading the JSON object a Hugging Face or PEFT directory must hold, with clear errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json_object(directory: Path, name: str, what: str, needed_by: str) -> dict[str, Any]:
    """``directory / name`` as a dict. Errors name the directory as "{what} directory" and the
    file as what ``needed_by`` needs (e.g. "model", "a model directory"). FileNotFoundError
    when either is missing, ValueError when the file is not a JSON object."""
    if not directory.is_dir():
        raise FileNotFoundError(f"{what} directory {directory} does not exist")
    path = directory / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: {needed_by} needs {name}")
    try:
        value = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return value

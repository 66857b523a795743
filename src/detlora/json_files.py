"""Reading JSON the user hands us (a Hugging Face or PEFT directory's files, JSON-lines prompt
files), with errors that name the file and the line."""

from __future__ import annotations

import json
from collections.abc import Iterator
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


def read_jsonl_objects(path: Path, key: str = "prompt") -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for each non-blank line of a JSON-lines file; a ValueError names
    the line that is not valid JSON or not an object with ``key`` (whose value the caller
    then checks)."""
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not valid JSON ({e})") from None
        if not isinstance(row, dict) or key not in row:
            raise ValueError(f'{path}:{n}: each line must be an object with a "{key}"')
        yield n, row

"""Read an audit log back: its files in order, each line a record, a damaged line reported
and skipped (never a failure of the whole log).

A directory stands for its ``audit-*.jsonl`` files in name order (their names start with the
UTC time they were opened); files given by name are read in the order given. A line that is
not a JSON object is skipped: at the end of a file it is ``torn`` (the process or machine
stopped mid-write), elsewhere ``corrupt``; a line of a newer format version is skipped as
``unreadable``. Each request line is paired with the engine line that heads its file.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from detlora.audit.format import ENGINE, REQUEST, VERSION


@dataclass(frozen=True)
class LogEntry:
    """One request line, where it was, and the engine line of its file (None if the file has
    none)."""

    path: Path
    line: int  # 1-based
    record: dict[str, Any]
    engine: dict[str, Any] | None


@dataclass(frozen=True)
class SkippedLine:
    path: Path
    line: int
    reason: str  # "torn", "corrupt" or "unreadable"
    detail: str


def log_files(paths: Iterable[str | Path]) -> list[Path]:
    """The files of ``paths`` (files, or directories of ``audit-*.jsonl``), in reading order;
    ValueError for a path that does not exist or a directory without log files."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(p.glob("audit-*.jsonl"))
            if not found:
                raise ValueError(f"{p} holds no audit log files (audit-*.jsonl)")
            files += found
        elif p.is_file():
            files.append(p)
        else:
            raise ValueError(f"audit log {p} does not exist")
    seen: set[Path] = set()
    return [f for f in files if not (f.resolve() in seen or seen.add(f.resolve()))]


def read_lines(path: Path) -> Iterator[tuple[int, dict[str, Any] | SkippedLine]]:
    """(line number, record or the reason it was skipped) for every line of one file."""
    with path.open("rb") as f:
        data = f.read()
    lines = data.split(b"\n")
    last = len(lines)
    if lines and lines[-1] == b"":
        lines.pop()  # the file ends with a newline, as a whole last line does
        last = len(lines) + 1
    for n, raw in enumerate(lines, 1):
        try:
            record = json.loads(raw)
            if not isinstance(record, dict):
                raise ValueError("not a JSON object")
        except ValueError as e:
            reason = "torn" if n == last else "corrupt"
            yield n, SkippedLine(path, n, reason, f"{type(e).__name__}: {e}"[:200])
            continue
        version = record.get("v")
        if not isinstance(version, int) or version > VERSION or version < 1:
            yield n, SkippedLine(path, n, "unreadable", f"format version {version!r} (this "
                                 f"detlora reads 1 to {VERSION})")
            continue
        yield n, record


@dataclass
class ReadLog:
    """Every readable request line of a log, with its engines and the lines skipped."""

    entries: list[LogEntry]
    engines: dict[str, dict[str, Any]]  # engine id -> its engine line
    skipped: list[SkippedLine]
    files: list[Path]


def read_log(paths: Iterable[str | Path]) -> ReadLog:
    files = log_files(paths)
    entries: list[LogEntry] = []
    engines: dict[str, dict[str, Any]] = {}
    skipped: list[SkippedLine] = []
    for path in files:
        engine: dict[str, Any] | None = None
        for n, item in read_lines(path):
            if isinstance(item, SkippedLine):
                skipped.append(item)
            elif item.get("kind") == ENGINE:
                engine = item
                engines.setdefault(str(item.get("id")), item)
            elif item.get("kind") == REQUEST:
                entries.append(LogEntry(path, n, item, engine))
            else:
                skipped.append(SkippedLine(path, n, "unreadable",
                                           f"unknown kind {item.get('kind')!r}"))
    return ReadLog(entries, engines, skipped, files)


__all__ = ["LogEntry", "ReadLog", "SkippedLine", "log_files", "read_lines", "read_log"]

"""Triton compilations as events: which kernel, how long it took, and its specialization.

``CompileRecorder(sink).install()`` sets Triton's JIT hooks in this process: ``sink`` gets one
dict per compilation (``kernel``, ``seconds``, ``pid``, ``params``, ``key``). With
``DETLORA_COMPILE_LOG=FILE`` in the environment, ``install_from_env()`` appends them to FILE as
JSON lines; ``benchmarks/harness/sitecustomize/`` on a process's PYTHONPATH (with the
repository root) calls it at start-up, so a server's front end and engine process both report
theirs. ``read_events(FILE, offset)`` reads what was appended since ``offset``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ENV = "DETLORA_COMPILE_LOG"


def specialization(kw: dict[str, Any]) -> dict[str, Any]:
    """The compile's specialization key, raw, beside the kernel's parameter names. The hook's
    own ``repr`` cannot be used: Triton 3.6 builds it from the wrong element of the key and
    prints only ``(q_ptr: (``."""
    return {"params": [p.name for p in kw["fn"].jit_function.params], "key": str(kw["key"])}


class CompileRecorder:
    """Times each compilation from Triton's cache-miss hook to its post-compile hook."""

    def __init__(self, sink: Callable[[dict[str, Any]], None]) -> None:
        self.sink = sink
        self._started: dict[tuple, float] = {}

    def install(self) -> CompileRecorder:
        from triton import knobs

        knobs.runtime.jit_cache_hook = self._pre
        knobs.runtime.jit_post_compile_hook = self._post
        return self

    @staticmethod
    def _key(kw: dict[str, Any]) -> tuple:
        return kw["key"] if isinstance(kw["key"], tuple) else (kw["key"],)

    def _pre(self, **kw: Any) -> bool:
        self._started[self._key(kw)] = time.perf_counter()
        return False  # never skip the compile

    def _post(self, **kw: Any) -> None:
        start = self._started.pop(self._key(kw), None)
        self.sink({"kernel": kw["fn"].name, "pid": os.getpid(),
                   "seconds": None if start is None else round(time.perf_counter() - start, 3),
                   **specialization(kw)})


def install_from_env() -> CompileRecorder | None:
    """Append this process's compilations to the file named by ``DETLORA_COMPILE_LOG``."""
    path = os.environ.get(ENV)
    if not path:
        return None

    def append(event: dict[str, Any]) -> None:
        with open(path, "a") as f:  # one short write a line: processes do not interleave
            f.write(json.dumps(event) + "\n")

    return CompileRecorder(append).install()


def read_events(path: Path, offset: int = 0) -> tuple[list[dict[str, Any]], int]:
    """The events appended to ``path`` after byte ``offset``, and the new offset (a line
    still being written waits for the next read)."""
    if not path.exists():
        return [], offset
    with path.open("rb") as f:
        f.seek(offset)
        data = f.read()
    whole = data[: data.rfind(b"\n") + 1]
    return [json.loads(line) for line in whole.splitlines()], offset + len(whole)

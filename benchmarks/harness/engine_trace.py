"""The engine process's loop as a timeline: each step, each wait for the front end's messages
and each hand-over of outputs, with monotonic start and end times.

With ``DETLORA_ENGINE_TRACE=FILE`` in the environment, ``install_from_env()`` (called at start-up
by ``benchmarks/harness/sitecustomize/``) wraps the ``EngineCore`` that a server's engine process
builds: its engine's ``step_sequences``, its input pipe's ``poll`` and its output pipe's
``send``, and the requests it receives. Events go to FILE as JSON lines when the process exits
(and every 512 events): ``{"kind": "step", "t0", "t1", "rows", "running", "waiting"}``,
``{"kind": "poll", "t0", "t1", "timeout", "ready"}``, ``{"kind": "send", "t0", "t1"}``, and per
request ``{"kind": "add" | "first" | "finish", "t", "rid"}`` (received; its first token read;
finished). Lab code: it changes nothing the engine computes, only times it from outside.
"""

from __future__ import annotations

import atexit
import json
import os
import time
from typing import Any

ENV = "DETLORA_ENGINE_TRACE"
_FLUSH_EVERY = 512  # a process killed at shutdown loses at most this many


class _Trace:
    def __init__(self, path: str) -> None:
        self.path = path
        self.events: list[dict[str, Any]] = []
        atexit.register(self.flush)

    def add(self, event: dict[str, Any]) -> None:
        self.events.append(event)
        if len(self.events) >= _FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        if self.events:
            with open(self.path, "a") as f:
                f.writelines(json.dumps(e) + "\n" for e in self.events)
            self.events = []


class _TimedConn:
    """A pipe end whose ``poll`` and ``send`` are timed; everything else passes through."""

    def __init__(self, conn: Any, trace: _Trace) -> None:
        self._conn = conn
        self._trace = trace

    def poll(self, timeout: float = 0.0) -> bool:
        t0 = time.monotonic()
        ready = self._conn.poll(timeout)
        if timeout or ready:  # the many empty non-blocking polls of a busy loop stay out
            self._trace.add({"kind": "poll", "t0": t0, "t1": time.monotonic(),
                             "timeout": timeout, "ready": bool(ready)})
        return ready

    def recv(self) -> Any:
        msg = self._conn.recv()
        now = time.monotonic()
        for m in msg[1] if msg[0] == "batch" else (msg,):  # a front end's batch of messages
            if m[0] == "add":
                self._trace.add({"kind": "add", "t": now, "rid": m[1].request_id})
        return msg

    def send(self, obj: Any) -> None:
        t0 = time.monotonic()
        self._conn.send(obj)
        self._trace.add({"kind": "send", "t0": t0, "t1": time.monotonic()})

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


def install(path: str) -> None:
    from detlora.engine import core_proc

    trace = _Trace(path)
    init = core_proc.EngineCore.__init__

    def traced_init(self: Any, engine: Any, conn_in: Any, conn_out: Any) -> None:
        init(self, engine, _TimedConn(conn_in, trace), _TimedConn(conn_out, trace))
        step = engine.step_sequences
        sched = engine.scheduler
        read: set[str] = set()  # requests that read a token already

        def traced_step() -> Any:
            t0 = time.monotonic()
            out = step()
            t1 = time.monotonic()
            trace.add({"kind": "step", "t0": t0, "t1": t1, "rows": len(out),
                       "running": len(sched.running), "waiting": len(sched.waiting)})
            for seq in out:
                # A request's first appearance is its first token (its token count cannot
                # tell: a step launched ahead leaves a placeholder at the end).
                if seq.request_id not in read:
                    read.add(seq.request_id)
                    trace.add({"kind": "first", "t": t1, "rid": seq.request_id})
                if seq.is_finished:
                    read.discard(seq.request_id)
                    trace.add({"kind": "finish", "t": t1, "rid": seq.request_id})
            return out

        engine.step_sequences = traced_step

    core_proc.EngineCore.__init__ = traced_init


def install_from_env() -> bool:
    path = os.environ.get(ENV)
    if not path:
        return False
    try:
        install(path)
    except ImportError:  # a process without detlora on its path (a load client)
        return False
    return True


def read_trace(path: str | os.PathLike) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


__all__ = ["ENV", "install", "install_from_env", "read_trace"]

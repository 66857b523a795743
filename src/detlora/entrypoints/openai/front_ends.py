"""Several front-end processes over one engine process (``--api-server-count N``, vLLM's name).

One front end's event loop does HTTP, request validation, chat templates, tokenizing and
answers for every request; under thousands of short requests a second that one loop is the
limit (docs/decisions.md, "Short requests"). With N > 1 the server's first process starts the
engine with N pairs of pipes (``AsyncLLM.start(front_ends=N)``) and N - 1 more front ends in
processes of their own (``python -m detlora.entrypoints.openai.front_end_proc``), each handed its
pipes and the listening socket by descriptor: every process accepts connections on the one
port, and the kernel gives each new connection to one of them. Each front end loads the
tokenizer and the ``--lora-modules`` (the same ids in the same order, so the same
fingerprints); the engine keys requests by front end. ``/metrics`` is each process's own.
Runtime adapter loading needs one front end: an adapter loaded through one would be unknown
to the others.
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import socket
import subprocess
import sys
from pathlib import Path

from detlora.engine.async_llm import AsyncLLM
from detlora.engine_args import EngineArgs
from detlora.entrypoints.openai.server_config import ServerConfig


def unfinished_share(engine_config: EngineArgs, config: ServerConfig) -> int:
    """Each front end's bound on its sequences in flight: the server's (``max_num_seqs`` +
    ``max_queued_requests``) split evenly, so that N front ends together keep it."""
    total = engine_config.max_num_seqs + config.max_queued_requests
    return max(1, -(-total // config.api_server_count))


def spawn_front_ends(llm: AsyncLLM, engine_config: EngineArgs, config: ServerConfig,
                     sock: socket.socket, tokenizer_dir: str | None,
                     timeout: float = 600.0) -> list[subprocess.Popen]:
    """Start a front-end process for each of ``llm.other_front_ends`` (their pipes and the
    listening socket go by descriptor, the rest pickled on stdin), close this process's
    copies of their pipes, and wait until each serves (ValueError when one could not start),
    so that the port opens with every front end taking connections."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[3])  # this detlora, not another install
    env["PYTHONPATH"] = os.pathsep.join(x for x in (root, env.get("PYTHONPATH")) if x)
    procs, ready = [], []
    try:
        for k, (to_engine, from_engine) in enumerate(llm.other_front_ends, 1):
            ready_in, ready_out = os.pipe()  # the front end writes a byte once it serves
            fds = (to_engine, from_engine, sock.fileno(), ready_out)
            proc = subprocess.Popen(
                [sys.executable, "-m", "detlora.entrypoints.openai.front_end_proc"],
                pass_fds=fds, env=env, stdin=subprocess.PIPE)
            os.close(ready_out)
            ready.append(ready_in)
            assert proc.stdin is not None
            proc.stdin.write(pickle.dumps((engine_config, config, tokenizer_dir, *fds, k)))
            proc.stdin.close()
            procs.append(proc)
    finally:
        llm.release_front_end_fds()
    try:
        for k, fd in enumerate(ready, 1):
            readable, _, _ = select.select([fd], [], [], timeout)
            if not readable or not os.read(fd, 1):
                raise ValueError(f"front end {k} of {len(ready) + 1} did not start (see its "
                                 "log lines above)")
    except BaseException:
        stop_front_ends(procs, 5.0)
        raise
    finally:
        for fd in ready:
            os.close(fd)
    return procs


def stop_front_ends(procs: list[subprocess.Popen], timeout: float) -> None:
    """SIGTERM each (they finish their requests, up to the graceful timeout), then wait."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


__all__ = ["spawn_front_ends", "stop_front_ends", "unfinished_share"]

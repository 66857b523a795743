"""A real ``detlora serve`` on a free 127.0.0.1 port, for the server tests."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

SRC = Path(__file__).resolve().parents[2] / "src"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(model: Path, args: list[str], *, api_key: str | None = None,
                   timeout: float = 240.0) -> Iterator[tuple[str, subprocess.Popen]]:
    """Start the server, wait for /health, yield (base url, process); on exit SIGTERM it and
    check it exits 0 (graceful shutdown)."""
    port = free_port()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(SRC), env.get("PYTHONPATH")) if x)
    env["OMP_NUM_THREADS"] = "1"  # tiny matrices: one thread per process on a 2-core box
    if api_key is not None:
        env["DETLORA_API_KEY"] = api_key
    log = open(model.parent / f"server-{port}.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "detlora.entrypoints.cli", "serve", str(model), "--device",
         "cpu", "--port", str(port), *args], env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                log.flush()
                raise RuntimeError("the server exited: " + Path(log.name).read_text()[-3000:])
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not start: "
                                   + Path(log.name).read_text()[-3000:])
            time.sleep(0.3)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()


def server_log(model: Path, url: str) -> str:
    return (model.parent / f"server-{url.rsplit(':', 1)[1]}.log").read_text()

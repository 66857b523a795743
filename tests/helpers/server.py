"""A real ``detlora serve`` on a free 127.0.0.1 port, for the server tests."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

SRC = Path(__file__).resolve().parents[2] / "src"


# The server's start-up line, with the port it bound (``--port 0``: the kernel's choice, so two
# servers started side by side by pytest-xdist workers never race for one port).
_LISTENING = re.compile(r"serving .* on http://127\.0\.0\.1:(\d+) ")


@contextlib.contextmanager
def running_server(model: Path, args: list[str], *, api_key: str | None = None,
                   timeout: float = 240.0) -> Iterator[tuple[str, subprocess.Popen]]:
    """Start the server on a free port, wait for /health, yield (base url, process); on exit
    SIGTERM it and check it exits 0 (graceful shutdown)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(SRC), env.get("PYTHONPATH")) if x)
    env["OMP_NUM_THREADS"] = "1"  # tiny matrices: one thread per process on a 2-core box
    if api_key is not None:
        env["DETLORA_API_KEY"] = api_key
    log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - closed below
        "w", dir=model.parent, prefix="server-", suffix=".log", delete=False)
    proc = subprocess.Popen(
        [sys.executable, "-m", "detlora.entrypoints.cli", "serve", str(model), "--device",
         "cpu", "--port", "0", *args], env=env, stdout=log, stderr=subprocess.STDOUT)
    log_path, url = Path(log.name), None
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                log.flush()
                raise RuntimeError("the server exited: " + log_path.read_text()[-3000:])
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not start: "
                                   + log_path.read_text()[-3000:])
            if url is None:  # the port it bound, from its first line
                found = _LISTENING.search(log_path.read_text())
                if found is None:
                    time.sleep(0.1)
                    continue
                url = f"http://127.0.0.1:{found.group(1)}"
                os.replace(log_path, model.parent / f"server-{found.group(1)}.log")
                log_path = model.parent / f"server-{found.group(1)}.log"  # server_log's name
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
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

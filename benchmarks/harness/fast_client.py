"""A light HTTP/1.1 client for many short JSON requests (decisions, one-token completions),
so that thousands of requests a second measure the server, not the clients.

``serving_load`` (httpx) costs a client a few milliseconds of Python per request on a small
CPU: at thousands of requests a second its processes would be the bottleneck. Here each
worker keeps one keep-alive connection (asyncio streams) and writes the request bytes and
reads a ``Content-Length`` answer itself. Loopback only, a fixed list of requests, a deadline.

    results = run_posts(url, [("/v1/decisions", body), ...], concurrency=64, processes=8)
    results[i].status, results[i].body (parsed JSON), results[i].start / .end (monotonic)
"""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from benchmarks.harness.serving_load import START_DELAY_S, check_loopback


@dataclass
class PostResult:
    index: int
    ok: bool = False
    status: int | None = None
    body: Any = None
    error: str | None = None
    start: float = 0.0
    end: float = 0.0


def _request_bytes(host: str, path: str, body: dict, api_key: str | None) -> bytes:
    data = json.dumps(body).encode()
    auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
    return (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"{auth}Content-Length: {len(data)}\r\n\r\n").encode() + data


async def _read_answer(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    length = None
    chunked = False
    for line in lines[1:]:
        name, _, value = line.partition(":")
        name = name.strip().lower()
        if name == "content-length":
            length = int(value)
        elif name == "transfer-encoding" and "chunked" in value.lower():
            chunked = True
    if length is not None:
        return status, await reader.readexactly(length)
    if not chunked:
        raise ValueError("an answer without Content-Length or chunks")
    parts = []
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        chunk = await reader.readexactly(size + 2)
        if size == 0:
            return status, b"".join(parts)
        parts.append(chunk[:-2])


async def post_all(url: str, items: list[tuple[str, dict]], *, concurrency: int,
                   api_key: str | None = None, deadline_s: float = 600.0,
                   first_index: int = 0) -> list[PostResult]:
    """POST every (path, body) with ``concurrency`` keep-alive connections at a time."""
    check_loopback(url)
    parsed = urlparse(url)
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 80
    results = [PostResult(first_index + i) for i in range(len(items))]
    todo = list(range(len(items)))[::-1]

    async def worker() -> None:
        reader = writer = None
        try:
            while todo:
                i = todo.pop()
                res = results[i]
                path, body = items[i]
                res.start = time.monotonic()
                try:
                    if writer is None:
                        reader, writer = await asyncio.open_connection(host, port)
                    writer.write(_request_bytes(f"{host}:{port}", path, body, api_key))
                    status, data = await _read_answer(reader)
                    res.status = status
                    res.body = json.loads(data) if data else None
                    res.ok = status == 200
                    if not res.ok:
                        res.error = data[:300].decode(errors="replace")
                except (OSError, ValueError, asyncio.IncompleteReadError) as e:
                    res.error = f"{type(e).__name__}: {e}"
                    if writer is not None:
                        writer.close()
                    reader = writer = None
                res.end = time.monotonic()
        finally:
            if writer is not None:
                writer.close()

    workers = [asyncio.create_task(worker()) for _ in range(max(1, concurrency))]
    try:
        await asyncio.wait_for(asyncio.gather(*workers), timeout=deadline_s)
    except asyncio.TimeoutError:
        for r in results:
            if not r.ok and r.error is None:
                r.error = "lost: no answer before the deadline"
    return results


def _slice(url: str, items: list[tuple[str, dict]], concurrency: int, api_key: str | None,
           deadline_s: float, first: int, start_at: float | None) -> tuple[list, float]:
    if start_at is not None:
        time.sleep(max(0.0, start_at - time.time()))
    cpu, wall = time.process_time(), time.perf_counter()
    results = asyncio.run(post_all(url, items, concurrency=concurrency, api_key=api_key,
                                   deadline_s=deadline_s, first_index=first))
    return results, (time.process_time() - cpu) / max(time.perf_counter() - wall, 1e-9)


def run_posts(url: str, items: list[tuple[str, dict]], *, concurrency: int, processes: int = 1,
              api_key: str | None = None, deadline_s: float = 600.0,
              client_cpu: list[float] | None = None) -> list[PostResult]:
    """``post_all`` over ``processes`` client processes that start together (requests split
    into contiguous slices, ``concurrency`` split evenly); results in request order.
    ``client_cpu`` gets each process's busy share of a core (near 1.0: the clients are the
    limit)."""
    check_loopback(url)
    if processes <= 1:
        results, cpu = _slice(url, items, concurrency, api_key, deadline_s, 0, None)
        if client_cpu is not None:
            client_cpu.append(cpu)
        return results
    import multiprocessing as mp

    size = -(-len(items) // processes)
    parts = [(k * size, items[k * size:(k + 1) * size]) for k in range(processes)]
    per = max(1, concurrency // processes)
    out: list[PostResult] = []
    with ProcessPoolExecutor(processes, mp_context=mp.get_context("spawn")) as pool:
        start_at = time.time() + START_DELAY_S
        futures = [pool.submit(_slice, url, part, per, api_key, deadline_s, first, start_at)
                   for first, part in parts if part]
        for f in futures:
            results, cpu = f.result()
            out += results
            if client_cpu is not None:
                client_cpu.append(cpu)
    return out


__all__ = ["PostResult", "post_all", "run_posts"]

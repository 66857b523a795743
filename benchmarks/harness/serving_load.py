"""A bounded load generator for ``detlora serve``: many concurrent clients (asyncio + httpx),
streaming completions and decisions, every response kept for a bit-for-bit check.

Lab code (the serving suite and the CI load test use it): users of the server bring their own
load tools, while this one exists to prove a property (each output equals the same request run
alone offline), which needs the offline engine beside it. It only talks to loopback
addresses, sends a fixed list of requests, and stops by itself: when every request is
answered, or at ``deadline_s`` (requests still open then count as lost).

    results = asyncio.run(run_load(url, requests, concurrency=64, api_key=KEY))
    results = run_load_processes(url, requests, concurrency=256, processes=4)  # big loads

A completion request streams (SSE) with ``return_token_ids`` and logprobs of the chosen tokens,
so ``LoadResult.choices[i]`` holds each choice's token ids and logprobs as sent; a decision
request keeps its answers. Times: ``ttft`` (request sent to first token), ``itl`` (between
token arrivals, each gap divided over the tokens it brought).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import httpx

START_DELAY_S = 3.0  # client processes begin sending this long after they are started


@dataclass(frozen=True)
class LoadRequest:
    kind: str  # "completion" (streamed) or "decision"
    body: dict[str, Any]


@dataclass
class LoadResult:
    index: int
    kind: str
    ok: bool = False
    status: int | None = None
    error: str | None = None
    start: float = 0.0
    end: float = 0.0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    # completion: choice index -> {"token_ids", "logprobs", "finish_reason"}
    choices: dict[int, dict[str, Any]] = field(default_factory=dict)
    answers: dict[str, Any] | None = None  # decision
    fingerprint: str | None = None
    response_id: str | None = None  # the server's id of the answer
    last_token: float | None = None  # when the last token arrived (monotonic)
    client: tuple[int, int] = (0, 0)  # (first request index of its process, worker number)

    @property
    def output_tokens(self) -> int:
        return sum(len(c["token_ids"]) for c in self.choices.values())


def check_loopback(url: str) -> None:
    """Refuse any target but this machine (127.0.0.0/8, ::1, localhost)."""
    host = urlparse(url).hostname or ""
    if host == "localhost":
        return
    try:
        if ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:
        pass
    raise ValueError(f"the load generator only targets loopback addresses, not {host!r}")


async def _completion(client: httpx.AsyncClient, url: str, body: dict, res: LoadResult) -> None:
    body = {**body, "stream": True, "return_token_ids": True}
    body.setdefault("logprobs", 0)
    last = None
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        res.status = r.status_code
        if r.status_code != 200:
            res.error = (await r.aread()).decode(errors="replace")[:300]
            return
        done = False
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                # Read on to the body's end, as the openai client does over HTTP/1.1: the
                # connection then goes back to the pool instead of being closed.
                done = True
                continue
            chunk = json.loads(data)
            if "error" in chunk:
                res.error = chunk["error"].get("message", "error")
                return
            now = time.monotonic()
            res.fingerprint = chunk.get("system_fingerprint")
            res.response_id = chunk.get("id")
            for c in chunk["choices"]:
                ids = c.get("token_ids") or []
                if ids:
                    if res.ttft is None:
                        res.ttft = now - res.start
                    elif last is not None:
                        res.itl.extend([(now - last) / len(ids)] * len(ids))
                    last = res.last_token = now
                slot = res.choices.setdefault(c["index"], {"token_ids": [], "logprobs": [],
                                                           "finish_reason": None})
                slot["token_ids"] += ids
                lp = c.get("logprobs")
                if lp is not None:
                    slot["logprobs"] += lp["token_logprobs"]
                if c.get("finish_reason") is not None:
                    slot["finish_reason"] = c["finish_reason"]
        n = body.get("n", 1)
        res.ok = done and len(res.choices) == n and all(
            c["finish_reason"] is not None for c in res.choices.values())
        if not res.ok and res.error is None:
            res.error = "the stream ended early"


async def _decision(client: httpx.AsyncClient, url: str, body: dict, res: LoadResult) -> None:
    r = await client.post(url + "/v1/decisions", json=body)
    res.status = r.status_code
    if r.status_code != 200:
        res.error = r.text[:300]
        return
    data = r.json()
    res.answers = data["answers"]
    res.fingerprint = data.get("system_fingerprint")
    res.ttft = time.monotonic() - res.start
    res.ok = True


async def run_load(url: str, requests: list[LoadRequest], *, concurrency: int,
                   api_key: str | None = None, deadline_s: float = 600.0,
                   first_index: int = 0) -> list[LoadResult]:
    """Send ``requests`` with ``concurrency`` clients at a time; one result per request, in
    order (``ok`` False for a failed or lost one, with its ``error``)."""
    check_loopback(url)
    results = [LoadResult(first_index + i, r.kind) for i, r in enumerate(requests)]
    todo: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(requests)):
        todo.put_nowait(i)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(deadline_s),
                                 limits=limits, trust_env=False) as client:

        async def worker(number: int) -> None:
            while True:
                try:
                    i = todo.get_nowait()
                except asyncio.QueueEmpty:
                    return
                req, res = requests[i], results[i]
                res.client = (first_index, number)
                res.start = time.monotonic()
                try:
                    if req.kind == "completion":
                        await _completion(client, url, req.body, res)
                    else:
                        await _decision(client, url, req.body, res)
                except (httpx.HTTPError, ValueError, KeyError) as e:
                    res.error = f"{type(e).__name__}: {e}"
                res.end = time.monotonic()

        workers = [asyncio.create_task(worker(k)) for k in range(concurrency)]
        try:
            await asyncio.wait_for(asyncio.gather(*workers), timeout=deadline_s)
        except asyncio.TimeoutError:
            for r in results:
                if not r.ok and r.error is None:
                    r.error = "lost: no answer before the deadline"
    return results


def _run_slice(url: str, requests: list[LoadRequest], concurrency: int, api_key: str | None,
               deadline_s: float, first: int, start_at: float | None = None,
               ) -> tuple[list[LoadResult], float]:
    """One client process's share and the share of a core it kept busy meanwhile; with
    ``start_at`` (a ``time.time()``), it waits until then, so that processes that took
    different times to start begin together."""
    if start_at is not None:
        time.sleep(max(0.0, start_at - time.time()))
    cpu, wall = time.process_time(), time.perf_counter()
    results = asyncio.run(run_load(url, requests, concurrency=concurrency, api_key=api_key,
                                   deadline_s=deadline_s, first_index=first))
    return results, (time.process_time() - cpu) / max(time.perf_counter() - wall, 1e-9)


def run_load_processes(url: str, requests: list[LoadRequest], *, concurrency: int,
                       processes: int, api_key: str | None = None,
                       deadline_s: float = 600.0,
                       client_cpu: list[float] | None = None) -> list[LoadResult]:
    """``run_load`` split over ``processes`` client processes (one Python process cannot parse
    the SSE of hundreds of fast streams without becoming the bottleneck). ``client_cpu``, when
    given, gets each process's busy share of a core (near 1.0: the clients are the limit)."""
    check_loopback(url)
    if processes <= 1:
        results, cpu = _run_slice(url, requests, concurrency, api_key, deadline_s, 0)
        if client_cpu is not None:
            client_cpu.append(cpu)
        return results
    import multiprocessing as mp

    size = -(-len(requests) // processes)
    slices = [(k * size, requests[k * size:(k + 1) * size]) for k in range(processes)]
    per = max(1, concurrency // processes)
    with ProcessPoolExecutor(processes, mp_context=mp.get_context("spawn")) as pool:
        # The processes start (spawn, imports: about a second) at different times; all of
        # them wait for one start time, so the load is ``concurrency`` from its first request.
        start_at = time.time() + START_DELAY_S
        futures = [pool.submit(_run_slice, url, part, per, api_key, deadline_s, first,
                               start_at) for first, part in slices if part]
        out: list[LoadResult] = []
        for f in futures:
            results, cpu = f.result()
            out += results
            if client_cpu is not None:
                client_cpu.append(cpu)
    return out


__all__ = ["LoadRequest", "LoadResult", "check_loopback", "run_load", "run_load_processes"]

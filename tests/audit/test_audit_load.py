"""The audit log under load: 256 concurrent streams through the server's application (in this
process, over ASGI, one engine process for every run), first without the log, then with it.
No line is dropped, every request has its line, and the engine's steps take no longer with the
log: the writer lives in the front end's process, off the step loop. A writer that cannot
write at all holds up no request: lines wait in its queue."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
from tests.helpers.tiny_chat_model import build_tiny_chat_model

from detlora.audit.reader import read_log
from detlora.audit.records import AuditRecorder
from detlora.audit.writer import AuditConfig
from detlora.engine.async_llm import AsyncLLM
from detlora.engine_args import EngineArgs
from detlora.entrypoints.openai.api_server import build_app
from detlora.entrypoints.openai.server_config import ServerConfig
from detlora.entrypoints.openai.serving_models import ServingModels

STREAMS = 256


async def _steps(app) -> tuple[float, float]:
    """(sum of step seconds, steps) of the engine step-time histogram on the app's /metrics."""
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        text = (await client.get("/metrics")).text
    values = {}
    for line in text.splitlines():
        for name in ("detlora:engine_step_seconds_sum", "detlora:engine_step_seconds_count"):
            if line.startswith(name + " "):
                values[name] = float(line.rsplit(" ", 1)[1])
    return (values["detlora:engine_step_seconds_sum"],
            values["detlora:engine_step_seconds_count"])


async def _burst(app, streams: int = STREAMS) -> None:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test",
                                 timeout=300) as client:
        async def one(k: int) -> None:
            r = await client.post("/v1/completions", json={
                "model": "m", "prompt": [5 + k % 40, 6, 7], "max_tokens": 3,
                "ignore_eos": True, "temperature": 0.5, "seed": k, "stream": True,
                "logprobs": 0})
            assert r.status_code == 200 and "[DONE]" in r.text, r.text[-300:]

        await asyncio.gather(*(one(k) for k in range(streams)))


def test_256_streams_drop_no_line_and_delay_no_step(tmp_path):
    model, _ = build_tiny_chat_model(tmp_path / "assets")
    stall = threading.Event()

    def stuck() -> dict:  # holds the writer thread until released
        stall.wait(120)
        return {"v": 1, "kind": "request", "id": "stall"}

    async def run() -> None:
        args = EngineArgs(model=str(model), device="cpu", max_model_len=64,
                          max_num_seqs=STREAMS)
        llm = await AsyncLLM.start(args, max_unfinished=4 * STREAMS)
        try:
            config = ServerConfig(model=str(model), served_model_name="m")
            models = ServingModels(llm, "m")
            plain = build_app(llm, models, config)
            await _burst(plain, 32)  # a fresh engine's first steps are slower
            before = await _steps(plain)
            await _burst(plain)
            without = [a - b for a, b in zip(await _steps(plain), before, strict=True)]
            recorder = AuditRecorder(AuditConfig(str(tmp_path / "log")), model="m",
                                     engine_args=args,
                                     fingerprint_parts=llm.info.fingerprint_parts,
                                     writer="test")
            logged = build_app(llm, models, config, recorder)  # the step hooks move to it
            await _burst(logged)
            with_log = await _steps(logged)
            stats = recorder.stats
            deadline = time.monotonic() + 60
            while stats.lines_written < STREAMS and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert stats.lines_dropped == 0 and stats.lines_written == STREAMS
            # The same requests on the same engine: the log must not slow its steps. The
            # engine's busy seconds for the burst, within a loose bound (this box is shared).
            assert with_log[0] <= 2.0 * without[0] + 0.2, (with_log, without)
            # A writer that cannot write (a stalled disk) holds up no request and no step:
            # the burst ends, its lines wait in the queue, and are written once it can.
            recorder.writer.submit(stuck)
            await _burst(logged, 64)
            assert recorder.writer.queued >= 64 and stats.lines_dropped == 0
            stall.set()
            recorder.close()
            assert stats.lines_written == STREAMS + 65 and stats.lines_dropped == 0
        finally:
            stall.set()
            await llm.shutdown()

    asyncio.run(run())
    entries = [e for e in read_log([tmp_path / "log"]).entries if e.record["id"] != "stall"]
    assert len(entries) == STREAMS + 64
    assert sorted(e.record["outputs"][0]["seed"] for e in entries[:STREAMS]) == list(
        range(STREAMS))

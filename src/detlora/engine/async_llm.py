"""``AsyncLLM``: the engine for asyncio code (a server), shaped like vLLM v1's ``AsyncLLM``.

The engine steps in a process of its own (``core_proc``); this object, in the caller's
process and event loop, sends it requests and aborts and turns what comes back into
``RequestOutput`` deltas (new token ids, logprobs, text that never splits a character, the
finish reason). The pickled messages travel over two pipes that the event loop itself reads
and writes without blocking (asyncio pipe transports): no helper thread, so no message waits
for a thread to win the GIL from a busy loop, and neither a full pipe nor a long step ever
blocks the loop.

    llm = await AsyncLLM.start(EngineArgs(model=...), tokenizer_dir=...)
    stream = await llm.add_request("r1", prompt_ids, SamplingParams(max_tokens=32))
    async for delta in stream:          # RequestOutput with DELTA outputs; the last finished
        ...
    await llm.shutdown()

``add_request`` returns once the engine has accepted the request, and raises ValueError with
the engine's reason when it refuses it (so a server can answer 400 before it streams).
Leaving a stream unfinished (``aclose``, a cancelled task, a client that went away) aborts
the request and frees its KV pages at once. ``max_unfinished`` bounds the sequences in
flight: past it ``add_request`` raises ``EngineOverloadedError`` at once.

Deltas that arrive while the consumer is busy are merged, so a slow consumer gets fewer,
larger deltas and never slows the engine.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import os
import pickle
import struct
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from detlora.config import RequestOutputKind, SamplingParams
from detlora.engine.core_proc import AddRequest, Delta, EngineInfo, EngineStats
from detlora.engine.detokenizer import IncrementalDetokenizer
from detlora.engine.model_files import resolve_model_files
from detlora.engine.outputs import CompletionOutput, RequestOutput
from detlora.engine.sample.stop_strings import match_stop_string
from detlora.engine.tokenizer import Tokenizer, has_tokenizer
from detlora.engine_args import EngineArgs
from detlora.lora.request import LoRARequest


class EngineOverloadedError(RuntimeError):
    """Too many requests in flight: try again later."""


class EngineDeadError(RuntimeError):
    """The engine process stopped."""


@dataclass
class StreamTimes:
    """When a request arrived and read its tokens (for metrics)."""

    arrival: float
    accepted: float | None = None  # the engine process took the request (its clock)
    first_token: float | None = None
    last_token: float | None = None
    inter_token: list[float] = field(default_factory=list)  # seconds between token reads
    first_token_reported: bool = False  # set by whoever reports the time to first token


@dataclass(slots=True)
class StreamDelta:
    """One merged delta of a stream (what a ``RequestOutput`` delta carries, flat): new text,
    token ids and logprobs, the finish and stop reasons (``error``: the engine's message when
    finish_reason is "error"); the prompt's figures in a stream's first delta only."""

    text: str
    token_ids: list[int]
    logprobs: list | None
    finish_reason: str | None
    stop_reason: int | str | None
    error: str | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list | None = None
    label_logprobs: dict[int, float] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestStream:
    """One request's deltas: iterate it (``async for``) until the finished one."""

    def __init__(self, llm: AsyncLLM, req: AddRequest, prompt: str | None,
                 on_delta: Callable[[RequestStream, int], None] | None,
                 detokenize: bool) -> None:
        self.llm = llm
        self.request = req
        self.prompt = prompt
        self.times = StreamTimes(time.monotonic())
        self.accepted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending: list[Delta] = []
        self._event = asyncio.Event()
        self._error: BaseException | None = None
        self._finished = False
        self._ids: list[int] = []  # every output id so far
        self._on_delta = on_delta
        params = req.params
        tok = llm.tokenizer
        self._detok = None
        if tok is not None and detokenize:
            hold = max((len(s) for s in params.stop), default=1) - 1
            self._detok = IncrementalDetokenizer(tok.decode, hold_back=hold,
                                                 decode_one=llm._decode_one)
        self.fingerprint = llm.fingerprint_of(req.lora)
        self.seed: int | None = None  # the sampling seed the engine runs it with, once accepted
        # Called with every delta the engine sends, then once with None if the stream ends
        # unfinished (aborted, failed): an audit log's recorder.
        self.audit: Callable[[RequestStream, Delta | None], None] | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def finished(self) -> bool:
        return self._finished

    # ---- fed by the receiving thread, on the event loop ----

    def _put(self, delta: Delta, now: float) -> None:
        n = len(delta[1])
        if n:
            t = self.times
            if t.first_token is None:
                t.first_token = now
                n -= 1
            elif t.last_token is not None:
                t.inter_token.extend([(now - t.last_token) / n] * n)
            t.last_token = now
        self._pending.append(delta)
        self._event.set()
        if self._on_delta is not None:
            self._on_delta(self, len(delta[1]))
        if self.audit is not None:
            self.audit(self, delta)
            if delta[3] is not None:
                self.audit = None

    def _end_audit(self) -> None:
        """Tell the recorder, once, that the stream ended without finishing."""
        audit, self.audit = self.audit, None
        if audit is not None:
            audit(self, None)

    def _fail(self, error: BaseException) -> None:
        self._end_audit()
        self._error = error
        if not self.accepted.done():
            self.accepted.set_exception(error)
            self.accepted.exception()  # retrieved: no "never retrieved" warning
        self._event.set()

    # ---- the consumer ----

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate(self._output)

    def deltas(self) -> AsyncIterator[StreamDelta]:
        """The same deltas as ``async for``, as ``StreamDelta``: a server's streaming path
        reads these per chunk without building the public output objects."""
        return self._iterate(None)

    async def _iterate(self, convert: Callable[[StreamDelta], Any] | None) -> AsyncIterator[Any]:
        try:
            while not self._finished:
                await self._event.wait()
                self._event.clear()
                if self._pending:
                    merged, self._pending = self._pending, []
                    delta = self._take(merged)
                    yield delta if convert is None else convert(delta)
                elif self._error is not None:
                    raise self._error
        finally:
            if not self._finished:
                self.llm._abort_unfinished(self)

    def _take(self, deltas: list[Delta]) -> StreamDelta:
        """The engine's deltas merged into one, its text detokenized."""
        if len(deltas) == 1:
            d = deltas[0]
            ids = d[1]
            lps = None
            if self.request.params.logprobs is not None:
                lps = d[2] if d[2] is not None else []
            reason, stop_reason, first = d[3], d[4], d[5]
        else:
            ids = [t for d in deltas for t in d[1]]
            lps = None
            if self.request.params.logprobs is not None:
                lps = [lp for d in deltas for lp in (d[2] or ())]
            reason, stop_reason = deltas[-1][3], deltas[-1][4]
            first = next((d[5] for d in deltas if d[5] is not None), None)
        self._ids += ids
        finished = reason is not None
        text = ""
        if self._detok is not None:
            if finished:
                text = self._detok.finish(self._ids, self._text_end(reason, stop_reason))
            else:
                text = self._detok.update(self._ids)
        self._finished = finished
        if finished:
            self.llm._forget(self)
        error = stop_reason if reason == "error" else None
        delta = StreamDelta(text, ids, lps, reason, None if error else stop_reason, error)
        if first is not None:
            delta.num_cached_tokens, delta.prompt_logprobs, delta.label_logprobs = first
        return delta

    def _output(self, delta: StreamDelta) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id, prompt=self.prompt,
            prompt_token_ids=self.request.prompt_token_ids,
            outputs=[CompletionOutput(index=self.request.sample_index, text=delta.text,
                                      token_ids=delta.token_ids, logprobs=delta.logprobs,
                                      finish_reason=delta.finish_reason,
                                      stop_reason=delta.stop_reason, error=delta.error)],
            finished=delta.finished, fingerprint=self.fingerprint,
            prompt_logprobs=delta.prompt_logprobs, num_cached_tokens=delta.num_cached_tokens,
            label_logprobs=delta.label_logprobs)

    def _text_end(self, reason: str | None, stop_reason: Any) -> int | None:
        """Where a stop string cut the text: the engine's own rule on the same ids."""
        params = self.request.params
        if reason != "stop" or not isinstance(stop_reason, str) or self.llm.tokenizer is None:
            return None
        match = match_stop_string(self.llm.tokenizer.decode, self._ids, params.stop,
                                  params.include_stop_str_in_output)
        return None if match is None else match.text_end


class AsyncLLM:
    def __init__(self, config: EngineArgs, tokenizer: Tokenizer | None, info: EngineInfo,
                 process: Any, max_unfinished: int) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.info = info
        self.max_unfinished = max_unfinished
        self.stats: EngineStats | None = None
        self._process = process
        self._to_engine: asyncio.WriteTransport | None = None  # set by _open_pipes
        self._from_engine: asyncio.ReadTransport | None = None
        self._loop = asyncio.get_running_loop()
        self._streams: dict[str, RequestStream] = {}
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = itertools.count()
        self._fingerprints: dict[int, str] = {}
        self._adapter_hashes: dict[int, str | None] = {}
        self._num_unfinished = 0  # sequences added and not finished, aborted or refused
        self._dead: str | None = None
        self.on_delta: Callable[[RequestStream, int], None] | None = None  # metrics hook
        self.on_crash: Callable[[str], None] | None = None
        # Called with the wall time of every engine step, as the engine process measured it.
        self.on_step: Callable[[float], None] | None = None
        # Called with how long the engine process took to hand a step's outputs over (long:
        # the pipe was full), and with the delay from the engine sending a step's outputs to
        # the event loop handling them (long: the loop was busy).
        self.on_send: Callable[[float], None] | None = None
        self.on_dispatch_delay: Callable[[float], None] | None = None
        self._idle_reported = 0.0  # the engine process's waits with nothing to run, so far
        self._idle_since: float | None = None  # and the one going on (monotonic), if any
        self._idle_read = 0.0
        self._decoded: dict[int, str] = {}  # decode([id]) per id, for the streams' detokenizers
        self._outbox: list[tuple] | None = None  # messages of this loop turn, not yet written
        # start(front_ends > 1): the other front ends' pipe descriptors, to hand over.
        self.other_front_ends: list[tuple[int, int]] = []

    def _decode_one(self, token_id: int) -> str:
        """``tokenizer.decode([token_id])``, remembered per id (at most the vocabulary)."""
        text = self._decoded.get(token_id)
        if text is None:
            assert self.tokenizer is not None
            text = self._decoded[token_id] = self.tokenizer.decode([token_id])
        return text

    @classmethod
    async def start(cls, config: EngineArgs, *, tokenizer_dir: str | None = None,
                    max_unfinished: int | None = None,
                    torch_threads: int | None = None, front_ends: int = 1) -> AsyncLLM:
        """Spawn the engine process and wait until its engine is built (ValueError with the
        engine's message when it cannot be). ``front_ends`` > 1: the engine also serves
        that many minus one other front-end processes, each through its own pipes, whose
        descriptors (to the engine, from the engine) are in ``other_front_ends`` for the
        caller to hand to them (``attach``); they are closed in this process by
        ``release_front_end_fds``."""
        # A Hub id or a .gguf file: a local model directory first, as LLM() does.
        files = resolve_model_files(config)
        config = files.args
        tok_dir = tokenizer_dir or files.tokenizer_dir
        tokenizer = None
        if tok_dir is not None and has_tokenizer(tok_dir):
            tokenizer = Tokenizer(tok_dir, mode=config.tokenizer_mode,
                                  trust_remote_code=config.trust_remote_code)
        # A fresh interpreter running core_proc (not multiprocessing's spawn, which would
        # import the caller's __main__ again), with two pipes per front end handed over by
        # descriptor.
        child_fds: list[int] = []
        ours: list[tuple[int, int]] = []  # (to the engine, from the engine) per front end
        for _ in range(front_ends):
            child_in, to_engine = os.pipe()
            from_engine, child_out = os.pipe()
            child_fds += [child_in, child_out]
            ours.append((to_engine, from_engine))
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])  # this detlora, not another install
        env["PYTHONPATH"] = os.pathsep.join(x for x in (root, env.get("PYTHONPATH")) if x)
        process = subprocess.Popen(
            [sys.executable, "-m", "detlora.engine.core_proc", *map(str, child_fds)],
            pass_fds=tuple(child_fds), env=env, stdin=subprocess.DEVNULL)
        for fd in child_fds:
            os.close(fd)
        in_send = Connection(ours[0][0], readable=False)
        out_recv = Connection(ours[0][1], writable=False)
        try:
            in_send.send((config, tok_dir if tokenizer is not None else None, torch_threads))
            msg = await asyncio.to_thread(_recv_or_none, out_recv)
        except BaseException:
            process.kill()
            raise
        if msg is None or msg[0] != "ready":
            await asyncio.to_thread(process.wait, 10)
            reason = msg[1] if msg is not None else "the engine process exited"
            in_send.close()
            out_recv.close()
            for fds in ours[1:]:
                for fd in fds:
                    os.close(fd)
            raise ValueError(f"the engine could not start: {reason}")
        info: EngineInfo = msg[1]
        limit = max_unfinished if max_unfinished is not None else 4 * info.max_num_seqs
        llm = cls(config, tokenizer, info, process, limit)
        llm.other_front_ends = ours[1:]
        # The loop takes the pipes over from the start-up's blocking connections.
        to_engine, from_engine = os.dup(in_send.fileno()), os.dup(out_recv.fileno())
        in_send.close()
        out_recv.close()
        await llm._open_pipes(to_engine, from_engine)
        return llm

    def release_front_end_fds(self) -> None:
        """Close this process's copies of the other front ends' pipes (once they have them)."""
        for fds in self.other_front_ends:
            for fd in fds:
                os.close(fd)
        self.other_front_ends = []

    @classmethod
    async def attach(cls, config: EngineArgs, to_engine: int, from_engine: int, *,
                     tokenizer_dir: str | None = None,
                     max_unfinished: int | None = None) -> AsyncLLM:
        """A further front end over an engine process another one started (``start`` with
        ``front_ends`` > 1), through the pipe descriptors it was handed. It does not own the
        engine: ``shutdown`` leaves the engine running."""
        files = resolve_model_files(config)
        config = files.args
        tok_dir = tokenizer_dir or files.tokenizer_dir
        tokenizer = None
        if tok_dir is not None and has_tokenizer(tok_dir):
            tokenizer = Tokenizer(tok_dir, mode=config.tokenizer_mode,
                                  trust_remote_code=config.trust_remote_code)
        out_recv = Connection(os.dup(from_engine), writable=False)
        msg = await asyncio.to_thread(_recv_or_none, out_recv)
        if msg is None or msg[0] != "ready":
            out_recv.close()
            reason = msg[1] if msg is not None else "the engine process exited"
            raise ValueError(f"the engine could not start: {reason}")
        info: EngineInfo = msg[1]
        limit = max_unfinished if max_unfinished is not None else 4 * info.max_num_seqs
        llm = cls(config, tokenizer, info, None, limit)
        from_fd = os.dup(out_recv.fileno())
        out_recv.close()
        await llm._open_pipes(os.dup(to_engine), from_fd)
        return llm

    async def _open_pipes(self, to_engine: int, from_engine: int) -> None:
        loop = self._loop
        self._to_engine, _ = await loop.connect_write_pipe(
            asyncio.Protocol, os.fdopen(to_engine, "wb", buffering=0))
        self._from_engine, _ = await loop.connect_read_pipe(
            lambda: _MessageReader(self._dispatch, self._engine_gone),
            os.fdopen(from_engine, "rb", buffering=0))

    def _send(self, msg: tuple) -> None:
        """Queue a message to the engine process (never blocks: the transport buffers).
        Messages queued in one turn of the event loop (a wave of arrivals, each request's
        engine requests) travel as one ``("batch", [...])`` message, pickled and written once
        when the loop gets to it, and the engine process takes them all before its next
        step; their order is kept."""
        if self._outbox is None:
            self._outbox = []
            self._loop.call_soon(self._flush)
        self._outbox.append(msg)

    def _flush(self) -> None:
        batch, self._outbox = self._outbox, None
        if not batch or self._to_engine is None or self._to_engine.is_closing():
            return
        msg = batch[0] if len(batch) == 1 else ("batch", batch)
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        self._to_engine.write(struct.pack("!i", len(data)) + data)

    # ---- requests ----

    def fingerprint_of(self, lora: LoRARequest | None) -> str:
        if lora is None:
            return self.info.base_fingerprint
        return self._fingerprints.get(lora.id, "")

    def adapter_hash(self, lora: LoRARequest | None) -> str | None:
        """The content hash of an adapter loaded with ``add_lora`` (None for the base model
        or an adapter not loaded that way)."""
        return None if lora is None else self._adapter_hashes.get(lora.id)

    @property
    def num_unfinished(self) -> int:
        return self._num_unfinished

    def engine_idle_seconds(self) -> float:
        """How long the engine process has waited with no request to run, up to now (under
        load: the clients or this front end, not the engine, were the limit)."""
        since = self._idle_since
        now = self._idle_reported + (time.monotonic() - since if since is not None else 0.0)
        # A wait the engine has ended but not reported yet was read a little too long: never
        # read less than before (it is a counter).
        self._idle_read = max(self._idle_read, now)
        return self._idle_read

    @property
    def is_alive(self) -> bool:
        return self._dead is None

    def check_capacity(self, num_sequences: int) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if self._num_unfinished + num_sequences > self.max_unfinished:
            raise EngineOverloadedError(
                f"the server is at its limit of {self.max_unfinished} sequences in flight")

    async def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        lora: LoRARequest | None = None,
        sample_index: int = 0,
        label_token_ids: Sequence[int] | None = None,
        prompt: str | None = None,
    ) -> RequestStream:
        """Queue a request; returns its stream once the engine accepted it."""
        stream = self.submit(request_id, prompt_token_ids, params, lora=lora,
                             sample_index=sample_index, label_token_ids=label_token_ids,
                             prompt=prompt)
        await self.wait_accepted(stream)
        return stream

    def submit(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        lora: LoRARequest | None = None,
        sample_index: int = 0,
        label_token_ids: Sequence[int] | None = None,
        prompt: str | None = None,
    ) -> RequestStream:
        """``add_request`` without the wait: queue the request now and return its stream;
        ``wait_accepted`` then waits for the engine's answer. A caller adding several requests
        submits them all, then waits, without a task per request."""
        self.check_capacity(1)
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in flight")
        detokenize = params.detokenize
        if params.output_kind is not RequestOutputKind.DELTA or params.detokenize:
            # The engine reports deltas of ids; text is made here, where the tokenizer is.
            params = _engine_params(params)
        req = AddRequest(request_id, list(prompt_token_ids), params, lora, sample_index,
                         None if label_token_ids is None else tuple(label_token_ids))
        stream = RequestStream(self, req, prompt, self.on_delta, detokenize)
        self._streams[request_id] = stream
        self._num_unfinished += 1
        self._send(("add", req))
        return stream

    async def wait_accepted(self, stream: RequestStream) -> None:
        """Wait until the engine accepted ``stream``'s request (ValueError with its reason
        when it refused it; the request is forgotten on any error)."""
        try:
            await stream.accepted
        except BaseException:
            self._forget(stream)
            raise

    async def abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            self._abort_unfinished(stream)

    def _abort_unfinished(self, stream: RequestStream) -> None:
        stream._end_audit()
        if self._streams.get(stream.request_id) is stream:
            self._forget(stream)
            self._send(("abort", [stream.request_id]))

    def _forget(self, stream: RequestStream) -> None:
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]
            self._num_unfinished -= 1

    # ---- calls ----

    async def _call(self, name: str, *args: Any) -> Any:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        call_id = next(self._call_ids)
        fut: asyncio.Future[Any] = self._loop.create_future()
        self._calls[call_id] = fut
        self._send(("call", call_id, name, args))
        return await fut

    async def add_lora(self, lora: LoRARequest) -> str:
        """Load and check an adapter; returns the fingerprint of its requests (ValueError
        with the reason when the adapter is refused)."""
        fingerprint, digest = await self._call("add_lora", lora)
        self._fingerprints[lora.id] = fingerprint
        self._adapter_hashes[lora.id] = digest
        return fingerprint

    async def remove_lora(self, lora_id: int) -> bool:
        self._fingerprints.pop(lora_id, None)
        self._adapter_hashes.pop(lora_id, None)
        return await self._call("remove_lora", lora_id)

    async def reset_prefix_cache(self) -> bool:
        return await self._call("reset_prefix_cache")

    # ---- shutdown ----

    async def shutdown(self, drain: bool = False, timeout: float = 30.0) -> None:
        """Stop the engine process (``drain``: after the requests it runs finish); a front
        end that ``attach``-ed only lets go of its pipes (its unfinished requests are
        aborted by the engine)."""
        if self._process is None:  # attached: the engine is another front end's
            await asyncio.sleep(0)  # what is queued for the engine leaves first
            self._dead = self._dead or "this front end was shut down"
            for transport in (self._to_engine, self._from_engine):
                if transport is not None:
                    transport.close()
            for stream in list(self._streams.values()):
                stream._fail(EngineDeadError(self._dead))
            return
        if self._dead is None:
            self._send(("shutdown", drain))
        try:
            await asyncio.to_thread(self._process.wait, timeout)
        except subprocess.TimeoutExpired:
            self._process.kill()
            await asyncio.to_thread(self._process.wait, 10)
        self._dead = self._dead or "the engine was shut down"
        for transport in (self._to_engine, self._from_engine):
            if transport is not None:
                transport.close()
        for stream in list(self._streams.values()):
            stream._fail(EngineDeadError(self._dead))

    # ---- the engine's messages ----

    def _engine_gone(self) -> None:
        if self._dead is None:
            self._dead = "the engine process exited"
        for stream in list(self._streams.values()):
            self._forget(stream)
            stream._fail(EngineDeadError(self._dead))
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(self._dead))
        self._calls.clear()

    def _dispatch(self, msg: tuple) -> None:
        """Handle one message of the engine process (on the event loop)."""
        kind = msg[0]
        if kind == "step":
            (_, deltas, accepted, rejected, stats, seconds, send_seconds, idle_seconds,
             self._idle_since, sent_at) = msg
            self._idle_reported += idle_seconds
            streams = self._streams
            now = time.monotonic()
            if self.on_dispatch_delay is not None:
                self.on_dispatch_delay(max(0.0, now - sent_at))
            for rid, taken, seed in accepted:
                s = streams.get(rid)
                if s is not None and not s.accepted.done():
                    s.times.accepted = taken
                    s.seed = seed
                    s.accepted.set_result(None)
            for rid, reason in rejected:
                s = streams.get(rid)
                if s is not None:
                    self._forget(s)
                    s._fail(ValueError(reason))
            for d in deltas:
                s = streams.get(d[0])
                if s is not None:
                    s._put(d, now)
            self.stats = stats
            if seconds is not None and self.on_step is not None:
                self.on_step(seconds)
            if send_seconds is not None and self.on_send is not None:
                self.on_send(send_seconds)
        elif kind == "result":
            _, call_id, ok, value = msg
            fut = self._calls.pop(call_id, None)
            if fut is not None and not fut.done():
                if ok:
                    fut.set_result(value)
                else:
                    fut.set_exception(ValueError(value))
        elif kind == "crashed":
            for stream in list(self._streams.values()):
                self._forget(stream)
                stream._fail(RuntimeError("the engine failed a step; the request was dropped"))
            if self.on_crash is not None:
                self.on_crash(msg[1])


class _MessageReader(asyncio.Protocol):
    """Cuts the engine's pipe into ``multiprocessing.Connection`` frames (a 4-byte big-endian
    length, or -1 and an 8-byte length, then the pickle) and hands each message on."""

    def __init__(self, on_message: Callable[[Any], None], on_closed: Callable[[], None]) -> None:
        self._on_message = on_message
        self._on_closed = on_closed
        self._buffer = bytearray()

    def data_received(self, data: bytes) -> None:
        buf = self._buffer
        buf += data
        start = 0
        while len(buf) - start >= 4:
            (size,) = struct.unpack_from("!i", buf, start)
            head = 4
            if size == -1:
                if len(buf) - start < 12:
                    break
                (size,) = struct.unpack_from("!Q", buf, start + 4)
                head = 12
            if len(buf) - start < head + size:
                break
            msg = pickle.loads(bytes(buf[start + head:start + head + size]))
            start += head + size
            self._on_message(msg)
        del buf[:start]

    def connection_lost(self, exc: Exception | None) -> None:
        self._on_closed()


def _engine_params(params: SamplingParams) -> SamplingParams:
    """``params`` as the engine process takes them: DELTA outputs of ids, no text. A copy
    with two fields set, not ``dataclasses.replace``: ``params`` passed its checks when it
    was made, and these two values pass them too, so they are not run again."""
    engine = copy.copy(params)
    object.__setattr__(engine, "output_kind", RequestOutputKind.DELTA)
    object.__setattr__(engine, "detokenize", False)
    return engine


def _recv_or_none(conn: Any) -> Any:
    try:
        return conn.recv()
    except (EOFError, OSError):
        return None


__all__ = ["AsyncLLM", "EngineDeadError", "EngineOverloadedError", "RequestStream",
           "StreamDelta"]

"""The engine loop of a server, in a process of its own (vLLM v1's EngineCore process).

The process owns an ``LLMEngine`` and nothing else: between steps it takes the messages the
front end sent (requests to add, requests to abort, calls such as loading an adapter), then
runs one step and sends back, per request that read tokens, only what is new: token ids,
logprobs, and the finish reason once it ends. Tokenizing, detokenizing and HTTP stay in the
front end's process, so the step loop never waits for Python work on the serving side (the
GIL of one process would serialise both). Messages are pickled tuples over two pipes:

A server may run several front-end processes over one core (``--api-server-count``): each
has its own two pipes; the core takes every front end's messages, answers each on its own
pipe (its requests' deltas, their admission, its calls' results; the stats to all), and keys
a request by its front end and its id. Only the first front end may stop the core; another
that goes away has its requests aborted.

front end -> core
    ("batch", [message, ...]) the messages a front end queued in one turn of its event loop,
                              handled in order
    ("add", AddRequest)       a request; the core answers with (its id, the monotonic time
                              it took it, the sampling seed it runs with) in ``accepted``,
                              or with its id in ``rejected`` (with the ValueError's
                              message), in the next message
    ("abort", [request ids])  drop them now, freeing their KV pages
    ("call", id, name, args)  ``add_lora``, ``remove_lora``, ``reset_prefix_cache``; answered
                              by ("result", id, ok, value)
    ("shutdown", drain)       stop; with ``drain`` after the running requests finish

core -> front end
    ("ready", EngineInfo) or ("failed", message)   once, after the engine is built
    ("step", [Delta], accepted, rejected, EngineStats, step seconds or None,
     send seconds or None, idle seconds, idle since or None, sent at)
                              send: how long handing the previous message over took; idle:
                              how long the loop waited with no request to run since the
                              previous message; idle since: the monotonic time it began
                              waiting, while it still waits; sent at: this message's
                              monotonic time of sending
    ("result", id, ok, value)
    ("crashed", message)      a step raised: every request in flight was dropped
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from detlora.config import SamplingParams
from detlora.engine.frozen_heap import freeze_heap_for_good
from detlora.engine_args import EngineArgs
from detlora.lora.request import LoRARequest


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    lora: LoRARequest | None = None
    sample_index: int = 0
    label_token_ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class EngineInfo:
    """What the front end needs to know about the engine it talks to."""

    base_fingerprint: str
    vocab_size: int
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    max_num_seqs: int
    eos_token_ids: tuple[int, ...]
    determinism: str
    # engine_fingerprint_parts, for an audit log's records (engine/fingerprint.py)
    fingerprint_parts: dict = field(default_factory=dict)


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_kv_blocks: int
    adapter_loads: int
    num_preemptions: int
    num_aborted: int  # unfinished requests dropped on the front end's word, so far
    lora: dict[str, int | float]  # adapter traffic counters (LoRAStats), {} without LoRA


# One request's news in a step: (request_id, new token ids, new logprobs or None, finish reason
# or None, stop reason (for finish reason "error": the error message), first) where ``first``
# is (num_cached_tokens, prompt_logprobs, label_logprobs) in the request's first delta and None
# after it.
Delta = tuple[str, list[int], list | None, str | None, Any, tuple | None]


def _delta(seq: Any) -> Delta:
    num_read = seq.num_output_tokens if seq.is_finished else seq.num_read_output_tokens
    start = seq.num_reported
    p = seq.num_prompt_tokens
    ids = seq.token_ids[p + start: p + num_read]
    lps = seq.logprobs[start:num_read] if seq.params.logprobs is not None else None
    first = None
    if start == 0:
        prompt_lps = None if seq.params.prompt_logprobs is None else [None, *seq.prompt_logprobs]
        first = (seq.num_cached_tokens or 0, prompt_lps, seq.label_logprobs)
    seq.num_reported = num_read
    reason = seq.finish_reason.value if seq.finish_reason is not None else None
    stop = seq.error if reason == "error" else seq.stop_reason
    return (seq.request_id, ids, lps, reason, stop, first)


class EngineCore:
    """The loop around one engine; ``run`` returns when told to shut down or the front end's
    pipe closes."""

    def __init__(self, engine: Any, conn_in: Connection, conn_out: Connection,
                 more: Sequence[tuple[Connection, Connection]] = ()) -> None:
        """``conn_in``/``conn_out``: the first front end's pipes; ``more``: (in, out) of each
        further front end."""
        self.engine = engine
        self.conn_in = conn_in
        self.conn_out = conn_out
        self._ins: list[Connection | None] = [conn_in, *(i for i, _ in more)]
        self._outs: list[Connection | None] = [conn_out, *(o for _, o in more)]
        self._origin = 0  # the front end whose message is being handled
        # Engine id -> (front end, its id) of the unfinished requests of front ends after
        # the first.
        self._owner: dict[str, tuple[int, str]] = {}
        self._accepted_by: dict[int, list[tuple[str, float, int]]] = {}
        self._rejected_by: dict[int, list[tuple[str, str]]] = {}
        self._accepted: list[tuple[str, float, int]] = []
        self._rejected: list[tuple[str, str]] = []
        self._last_stats: EngineStats | None = None
        self._stop = False
        self._drain = False
        self._num_aborted = 0
        self._send_seconds: float | None = None
        self._idle_seconds = 0.0  # waited with nothing to run, not yet reported
        self._idle_since: float | None = None  # waiting with nothing to run since then
        self._sent_idle_since: float | None = None

    def stats(self) -> EngineStats:
        e = self.engine
        return EngineStats(
            num_running=len(e.scheduler.running), num_waiting=len(e.scheduler.waiting),
            num_free_blocks=e.block_manager.num_free, num_kv_blocks=e.num_kv_blocks,
            adapter_loads=e.lora_manager.loads if e.lora_manager is not None else 0,
            num_preemptions=e.scheduler.num_preemptions, num_aborted=self._num_aborted,
            lora={} if e.lora_stats is None else e.lora_stats.as_dict())

    def _engine_id(self, request_id: str) -> str:
        """The engine's id of a front end's request: its own id for the first front end,
        prefixed by the front end's number for the others (their ids may coincide)."""
        return request_id if self._origin == 0 else f"{self._origin}:{request_id}"

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "batch":
            for m in msg[1]:
                self._handle(m)
        elif kind == "add":
            req: AddRequest = msg[1]
            accepted = self._accepted if self._origin == 0 else \
                self._accepted_by.setdefault(self._origin, [])
            rejected = self._rejected if self._origin == 0 else \
                self._rejected_by.setdefault(self._origin, [])
            engine_id = self._engine_id(req.request_id)
            try:
                seq = self.engine.add_request(
                    req.prompt_token_ids, req.params, lora=req.lora, request_id=engine_id,
                    sample_index=req.sample_index, label_token_ids=req.label_token_ids)
            except ValueError as e:
                rejected.append((req.request_id, str(e)))
            else:  # CLOCK_MONOTONIC is the host's: the front end compares it to its own
                accepted.append((req.request_id, time.monotonic(), seq.sample_seed))
                if self._origin:
                    self._owner[engine_id] = (self._origin, req.request_id)
        elif kind == "abort":
            ids = {self._engine_id(rid) for rid in msg[1]}
            for rid in ids:
                self._owner.pop(rid, None)
            sched = self.engine.scheduler
            self._num_aborted += sum(s.request_id in ids for s in [*sched.waiting,
                                                                    *sched.running])
            self.engine.abort_request(list(ids))
        elif kind == "call":
            _, call_id, name, args = msg
            out = self._outs[self._origin]
            assert out is not None
            try:
                value = getattr(self, f"call_{name}")(*args)
            except Exception as e:  # reported to the caller, never fatal to the loop
                out.send(("result", call_id, False, str(e) or type(e).__name__))
            else:
                out.send(("result", call_id, True, value))
        elif kind == "shutdown":
            if self._origin == 0:  # the other front ends go away without stopping the core
                self._stop, self._drain = True, bool(msg[1])
        else:  # pragma: no cover - a front end bug
            raise ValueError(f"unknown message {kind!r}")

    def _front_end_gone(self, k: int) -> None:
        """Front end ``k`` (not the first) closed its pipes: drop its unfinished requests."""
        self._ins[k] = self._outs[k] = None
        self._accepted_by.pop(k, None)
        self._rejected_by.pop(k, None)
        mine = [rid for rid, (owner, _) in self._owner.items() if owner == k]
        for rid in mine:
            del self._owner[rid]
        sched = self.engine.scheduler
        mine = [s.request_id for s in [*sched.waiting, *sched.running] if s.request_id in mine]
        if mine:
            self._num_aborted += len(mine)
            self.engine.abort_request(mine)

    def _receive(self, timeout: float) -> bool:
        """Take the messages every front end sent; False when the first one is gone."""
        if len(self._ins) == 1:  # one front end: its pipe alone
            try:
                while self.conn_in.poll(timeout):
                    self._handle(self.conn_in.recv())
                    timeout = 0.0
            except (EOFError, OSError):
                return False
            return True
        conns = [c for c in self._ins if c is not None]
        for conn in wait(conns, timeout):
            k = self._ins.index(conn)
            self._origin = k
            try:
                while conn.poll(0):
                    self._handle(conn.recv())
            except (EOFError, OSError):
                if k == 0:
                    return False
                self._front_end_gone(k)
            finally:
                self._origin = 0
        return True

    # ---- calls ----

    def call_add_lora(self, lora: LoRARequest) -> tuple[str, str | None]:
        """Register an adapter and read and check it into the host cache ahead of traffic
        (no GPU slot is taken, so no running request's adapter is evicted); its requests'
        fingerprint and its content hash."""
        engine = self.engine
        if engine.lora_manager is None:
            raise ValueError("the engine was started without LoRA (enable_lora)")
        try:
            engine.add_lora(lora)
        except BaseException:
            engine.remove_lora(lora.id)
            raise
        return engine.fingerprint_of(lora), engine.adapter_hash(lora)

    def call_remove_lora(self, lora_id: int) -> bool:
        return self.engine.remove_lora(lora_id)

    def call_reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()

    # ---- the loop ----

    def run(self) -> None:
        engine = self.engine
        while True:
            busy = engine.has_unfinished()
            if not self._receive(0.0 if busy else 1.0):
                return  # the (first) front end is gone
            if self._idle_since is not None and (engine.has_unfinished() or self._stop):
                self._idle_seconds += time.monotonic() - self._idle_since
                self._idle_since = None
            if self._stop and not (self._drain and engine.has_unfinished()):
                engine.abort_all()
                return
            deltas: list[Delta] = []
            seconds = None
            if engine.has_unfinished():
                start = time.perf_counter()
                try:
                    deltas = [_delta(seq) for seq in engine.step_sequences()]
                except Exception as e:  # a bug: drop what runs, keep serving
                    for out in self._outs:
                        if out is not None:
                            out.send(("crashed", _describe(e)))
                    engine.abort_all()
                    self._owner.clear()
                seconds = time.perf_counter() - start
            if self._idle_since is None and not engine.has_unfinished():
                self._idle_since = time.monotonic()  # nothing left: the wait starts now
            stats = self.stats()
            if len(self._outs) > 1:
                deltas = self._send_to_others(deltas, stats, seconds)
            if deltas or self._accepted or self._rejected or stats != self._last_stats \
                    or seconds is not None or self._idle_since != self._sent_idle_since:
                # A send blocks while the pipe is full: the front end reads late.
                sent = time.monotonic()
                try:
                    self.conn_out.send(("step", deltas, self._accepted, self._rejected, stats,
                                        seconds, self._send_seconds, self._idle_seconds,
                                        self._idle_since, sent))
                except OSError:
                    return  # the front end is gone
                self._send_seconds = time.monotonic() - sent
                self._idle_seconds, self._sent_idle_since = 0.0, self._idle_since
                self._accepted, self._rejected, self._last_stats = [], [], stats


    def _send_to_others(self, deltas: list[Delta], stats: EngineStats,
                        seconds: float | None) -> list[Delta]:
        """Send the front ends after the first their step message (their requests' deltas,
        under their own ids, their admissions, the stats and the step's time); the first
        front end's deltas are returned."""
        mine: list[Delta] = []
        theirs: dict[int, list[Delta]] = {}
        owner = self._owner
        for d in deltas:
            who = owner.get(d[0])
            if who is None:
                mine.append(d)
                continue
            theirs.setdefault(who[0], []).append((who[1], *d[1:]))
            if d[3] is not None:  # finished
                del owner[d[0]]
        changed = stats != self._last_stats
        for k in range(1, len(self._outs)):
            out = self._outs[k]
            if out is None:
                continue
            ds = theirs.get(k, [])
            accepted = self._accepted_by.pop(k, [])
            rejected = self._rejected_by.pop(k, [])
            if not (ds or accepted or rejected or changed or seconds is not None):
                continue
            try:
                out.send(("step", ds, accepted, rejected, stats, seconds, None, 0.0,
                          self._idle_since, time.monotonic()))
            except OSError:
                self._front_end_gone(k)
        return mine


def _describe(e: BaseException) -> str:
    """One line for the log: the exception and where it was raised (no full trace)."""
    frame = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
    where = f" at {os.path.basename(frame.filename)}:{frame.lineno}" if frame else ""
    return f"{type(e).__name__}: {e}{where}"


def run_engine_core(conn_in: Connection, conn_out: Connection, config: EngineArgs,
                    tokenizer_dir: str | None, torch_threads: int | None = None,
                    more: Sequence[tuple[Connection, Connection]] = ()) -> None:
    """Process entry point: build the engine, say ready (or why not) to every front end
    (``more``: the pipes of those after the first), run the loop."""
    try:
        import torch

        if not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")
        if torch_threads:
            torch.set_num_threads(torch_threads)
        from detlora.config import Determinism
        from detlora.engine.llm_engine import LLMEngine
        from detlora.engine.tokenizer import Tokenizer, has_tokenizer

        tokenizer = None
        if tokenizer_dir is not None and has_tokenizer(tokenizer_dir):
            tokenizer = Tokenizer(tokenizer_dir)
        engine = LLMEngine(config, tokenizer=tokenizer,
                           extra_eos_token_ids=tokenizer.eos_token_ids if tokenizer else ())
        info = EngineInfo(
            base_fingerprint=engine.fingerprint_of(None), vocab_size=engine.spec.vocab_size,
            max_model_len=engine.max_model_len, num_kv_blocks=engine.num_kv_blocks,
            block_size=config.block_size, max_num_seqs=config.max_num_seqs,
            eos_token_ids=engine.eos_token_ids,
            determinism=Determinism(engine.determinism).value,
            fingerprint_parts=engine.fingerprint_parts)
    except Exception as e:  # e.g. a bad model directory: the front end reports it
        for out in (conn_out, *(o for _, o in more)):
            out.send(("failed", f"{type(e).__name__}: {e}"))
        return
    freeze_heap_for_good()  # full collections over the engine's objects stop pausing the loop
    for out in (conn_out, *(o for _, o in more)):
        out.send(("ready", info))
    EngineCore(engine, conn_in, conn_out, more).run()


def main(argv: list[str]) -> None:
    """``python -m detlora.engine.core_proc FD_IN FD_OUT [FD_IN FD_OUT ...]``: the pipes'
    descriptors, a pair per front end; the first message on the first FD_IN is (EngineArgs,
    tokenizer dir, torch threads)."""
    import signal

    # A terminal's Ctrl-C or a SIGTERM to the group reaches this process too: the front end
    # decides when it stops (after its in-flight requests), or its pipe closing does.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    pairs = [(Connection(int(argv[i]), writable=False), Connection(int(argv[i + 1]),
                                                                   readable=False))
             for i in range(0, len(argv), 2)]
    conn_in, conn_out = pairs[0]
    try:
        config, tokenizer_dir, torch_threads = conn_in.recv()
    except (EOFError, OSError):
        return
    run_engine_core(conn_in, conn_out, config, tokenizer_dir, torch_threads, pairs[1:])


if __name__ == "__main__":
    import sys

    # Run the importable module, not this __main__ copy: what it pickles must name
    # detlora.engine.core_proc's classes.
    from detlora.engine import core_proc

    core_proc.main(sys.argv[1:])


__all__ = ["AddRequest", "Delta", "EngineCore", "EngineInfo", "EngineStats", "run_engine_core"]

"""What the completion, chat and decision routes share: the model a request names, its
sampling parameters, its prompts' checks, opening its engine requests, logprobs and usage.

``n`` completions of a prompt are n engine requests with ``sample_index`` 0..n-1 (completion
0 scores the prompt), exactly as ``LLM.generate`` runs them, so a server response and an
offline run with equal fingerprints, requests and seeds give equal bits.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from starlette.requests import Request

from detlora.audit.records import AuditEntry, AuditRecorder
from detlora.config import SamplingParams, StructuredOutputsParams
from detlora.engine.async_llm import (
    AsyncLLM,
    EngineDeadError,
    EngineOverloadedError,
    RequestStream,
    StreamDelta,
)
from detlora.engine.outputs import RequestOutput
from detlora.entrypoints.openai.errors import OpenAIError, bad_request, overloaded
from detlora.entrypoints.openai.metrics import ServerMetrics
from detlora.entrypoints.openai.protocol import SamplingFields
from detlora.entrypoints.openai.server_config import ServerConfig
from detlora.entrypoints.openai.serving_models import ServingModels
from detlora.lora.request import LoRARequest

logger = logging.getLogger("detlora.server")


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIServing:
    def __init__(self, llm: AsyncLLM, models: ServingModels, config: ServerConfig,
                 metrics: ServerMetrics, audit: AuditRecorder | None = None) -> None:
        self.llm = llm
        self.models = models
        self.config = config
        self.metrics = metrics
        self.audit = audit
        self.tokenizer = llm.tokenizer
        self.max_model_len = llm.info.max_model_len
        self.vocab_size = llm.info.vocab_size
        self._token_texts: dict[int, str] = {}  # at most one entry per vocabulary id

    # ---- request -> engine ----

    def fingerprint(self, lora: LoRARequest | None) -> str:
        return self.llm.fingerprint_of(lora)

    def audit_entry(self, route: str, request_id: str, lora: LoRARequest | None,
                    prompts: Sequence[tuple[list[int], str | None]], params: SamplingParams,
                    **extra: Any) -> AuditEntry | None:
        """The audit log's entry for a request (None without ``--audit-log``): handed to
        ``open_streams``, written when its last choice ends."""
        if self.audit is None:
            return None
        return self.audit.entry(route, request_id, lora=lora,
                                adapter_hash=self.llm.adapter_hash(lora),
                                fingerprint_value=self.fingerprint(lora), prompts=prompts,
                                params=params, **extra)

    def check_prompt(self, ids: Sequence[int], where: str = "prompt") -> None:
        if not ids:
            raise bad_request(f"{where} is empty", "prompt")
        limit = self.max_model_len - 1
        if self.config.max_prompt_tokens is not None:
            limit = min(limit, self.config.max_prompt_tokens)
        if len(ids) > limit:
            raise bad_request(f"{where} has {len(ids)} tokens; this server takes at most "
                              f"{limit}", "prompt")
        if all_plain_ints(ids) and min(ids) >= 0 and max(ids) < self.vocab_size:
            return
        for t in ids:  # the first one that is wrong, for the message
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise bad_request(f"{where}: token id {t!r} is outside the vocabulary "
                                  f"[0, {self.vocab_size})", "prompt")

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise bad_request("this model has no tokenizer: send token ids", "prompt")
        try:
            return self.tokenizer.encode(text)
        except ValueError as e:  # text the tokenizer cannot take (a lone surrogate)
            raise bad_request(str(e), "prompt") from None

    def sampling_params(self, req: SamplingFields, *, max_tokens: int | None,
                        prompt_len: int, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """The engine's parameters for an OpenAI request (400 naming what is wrong)."""
        cfg = self.config
        if not 1 <= req.n <= cfg.max_n:
            raise bad_request(f"n must be in [1, {cfg.max_n}], got {req.n}", "n")
        for name, value in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
            if value is not None and not 0 <= value <= cfg.max_logprobs:
                raise bad_request(f"{name} must be in [0, {cfg.max_logprobs}], got {value}",
                                  name)
        room = self.max_model_len - prompt_len
        cap = room if cfg.max_tokens is None else min(room, cfg.max_tokens)
        if max_tokens is None:
            max_tokens = cap
        elif max_tokens > cap:
            raise bad_request(f"max_tokens={max_tokens} is more than this server allows for "
                              f"this prompt ({cap})", "max_tokens")
        bias = None
        if req.logit_bias:
            try:
                bias = {int(k): float(v) for k, v in req.logit_bias.items()}
            except ValueError:
                raise bad_request("logit_bias keys must be token ids", "logit_bias") from None
            bad = [t for t in bias if not 0 <= t < self.vocab_size]
            if bad:
                raise bad_request(f"logit_bias token ids outside the vocabulary: {bad[:5]}",
                                  "logit_bias")
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        try:
            return SamplingParams(
                max_tokens=max_tokens, n=req.n,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=-1 if req.top_k is None else req.top_k,
                min_p=0.0 if req.min_p is None else req.min_p,
                seed=req.seed, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                stop=stop, stop_token_ids=tuple(req.stop_token_ids or ()),
                include_stop_str_in_output=req.include_stop_str_in_output,
                ignore_eos=req.ignore_eos, min_tokens=req.min_tokens,
                presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
                repetition_penalty=1.0 if req.repetition_penalty is None
                else req.repetition_penalty,
                logit_bias=bias,
                allowed_token_ids=tuple(req.allowed_token_ids) if req.allowed_token_ids
                else None,
                structured_outputs=self._structured(req),
            )
        except ValueError as e:
            raise bad_request(str(e)) from None

    @staticmethod
    def _structured(req: SamplingFields) -> StructuredOutputsParams | None:
        fmt = req.response_format
        if fmt is None or fmt.type == "text":
            return None
        try:
            if fmt.type == "json_object":
                return StructuredOutputsParams(json_object=True)
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise bad_request("response_format json_schema needs json_schema.schema",
                                  "response_format")
            return StructuredOutputsParams(json=fmt.json_schema.schema_)
        except ValueError as e:
            raise bad_request(str(e), "response_format") from None

    async def open_streams(
        self, prompts: Sequence[tuple[list[int], str | None]], params: SamplingParams,
        lora: LoRARequest | None, request_id: str,
        label_token_ids: Sequence[Sequence[int]] | None = None,
        score_every_prompt: bool = False,
        audit: AuditEntry | None = None,
    ) -> list[RequestStream]:
        """Add ``n`` engine requests per prompt (prompt-major order); 503 when the server is
        full, 400 when the engine refuses one. All or nothing: on an error the ones added
        are aborted. Completion 0 of a prompt scores it (``prompt_logprobs``), or with
        ``score_every_prompt`` each of the n (equal bits: the engine is batch-invariant).
        ``audit``: each stream feeds one choice of this entry."""
        total = len(prompts) * params.n
        try:
            self.llm.check_capacity(total)
        except EngineOverloadedError as e:
            raise overloaded(str(e)) from None
        except EngineDeadError:
            raise OpenAIError(503, "the engine is not running") from None
        later = params if params.prompt_logprobs is None or params.n == 1 \
            or score_every_prompt else dataclasses.replace(params, prompt_logprobs=None)
        streams: list[RequestStream] = []
        try:
            # All of them queued at once (one message each), then their answers awaited: no
            # task per engine request.
            for p, (ids, text) in enumerate(prompts):
                labels = None if label_token_ids is None else label_token_ids[p]
                for i in range(params.n):
                    stream = self.llm.submit(
                        f"{request_id}-{p}-{i}", ids, params if i == 0 else later, lora=lora,
                        sample_index=i, label_token_ids=labels, prompt=text)
                    if audit is not None:
                        stream.audit = audit.choice(p, p * params.n + i, labels,
                                                    scores_prompt=i == 0 or score_every_prompt)
                    streams.append(stream)
            if audit is not None:
                audit.seal()
            for stream in streams:
                await self.llm.wait_accepted(stream)
        except ValueError as e:
            await self._abort_all(streams)
            raise bad_request(str(e)) from None
        except EngineOverloadedError as e:
            await self._abort_all(streams)
            raise overloaded(str(e)) from None
        except BaseException:
            await self._abort_all(streams)
            raise
        self.metrics.prompt_tokens.inc(sum(len(ids) for ids, _ in prompts))
        return streams

    async def _abort_all(self, streams: Sequence[RequestStream]) -> None:
        for s in streams:
            await self.llm.abort(s.request_id)

    # ---- engine -> response ----

    async def collect(self, streams: Sequence[RequestStream]) -> list[RequestOutput]:
        """Every stream to its end: one merged output each (token ids, logprobs, text)."""
        return list(await asyncio.gather(*(self._collect_one(s) for s in streams)))

    async def _collect_one(self, stream: RequestStream) -> RequestOutput:
        parts: list[RequestOutput] = []
        async with contextlib.aclosing(stream.__aiter__()) as it:
            async for out in it:
                parts.append(out)
        self.metrics.observe_finish(parts[-1].outputs[0].finish_reason or "abort")
        raise_if_failed(parts[-1])
        return merge_outputs(parts)

    @staticmethod
    async def merged(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, StreamDelta]]:
        """The deltas of several streams as they come: (stream index, delta)."""
        if len(streams) == 1:
            async with contextlib.aclosing(streams[0].deltas()) as it:
                async for delta in it:
                    yield 0, delta
            return
        queue: asyncio.Queue[tuple[int, StreamDelta | BaseException | None]] = asyncio.Queue()

        async def pump(i: int, stream: RequestStream) -> None:
            try:
                async with contextlib.aclosing(stream.deltas()) as it:
                    async for delta in it:
                        queue.put_nowait((i, delta))
                queue.put_nowait((i, None))
            except BaseException as e:  # reported to the consumer, which ends the others
                queue.put_nowait((i, e))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        try:
            left = len(streams)
            while left:
                i, item = await queue.get()
                if item is None:
                    left -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def token_text(self, token_id: int, as_ids: bool) -> str:
        """A logprob entry's token: its text (decoded once per id), or ``token_id:N``."""
        if as_ids or self.tokenizer is None:
            return f"token_id:{token_id}"
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.hf.decode([token_id])
        return text

    @staticmethod
    def top_entries(entry: dict[int, Any], k: int) -> list[tuple[int, float]]:
        """The ``k`` best of an engine logprobs entry (chosen token first, then the top k,
        the chosen one not repeated), as (token id, logprob) pairs."""
        items = [(t, logprob_value(v)) for t, v in entry.items()]
        return items[1:] if len(items) > k else sorted(items, key=lambda x: -x[1])

    @staticmethod
    def usage(prompt_tokens: int, completion_tokens: int, cached: int = 0) -> dict[str, Any]:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached}}

    @staticmethod
    def now() -> int:
        return int(time.time())


ROW_FAILED = ("the engine stopped this request (finish_reason 'error': its logits were not "
              "finite, or its adapter could not be loaded); other requests were not affected")


def raise_if_failed(out: RequestOutput) -> None:
    """A row the engine ended with finish_reason "error" fails its request alone (500; the
    engine's own message, which may name adapter paths, goes to the server log only)."""
    comp = out.outputs[0]
    if comp.finish_reason == "error":
        logger.warning("request %s failed: %s", out.request_id, comp.error)
        raise OpenAIError(500, ROW_FAILED, code="row_failed")


def raise_if_delta_failed(stream: RequestStream, delta: StreamDelta) -> None:
    """``raise_if_failed`` for a streamed delta."""
    if delta.finish_reason == "error":
        logger.warning("request %s failed: %s", stream.request_id, delta.error)
        raise OpenAIError(500, ROW_FAILED, code="row_failed")


def all_plain_ints(items: Sequence[Any]) -> bool:
    """Whether every item is an ``int`` itself (not a bool or another subclass), checked in
    C rather than by a Python loop over a prompt's ids."""
    return set(map(type, items)) == {int}


def logprob_value(value: Any) -> float:
    """A logprobs entry's value as a float (a float, or an object with ``.logprob``)."""
    return value if isinstance(value, float) else float(value.logprob)


def merge_outputs(parts: Sequence[RequestOutput]) -> RequestOutput:
    """Deltas of one request -> its whole output."""
    last = parts[-1]
    first = parts[0]
    comp = last.outputs[0]
    lps = None if comp.logprobs is None else [lp for p in parts for lp in p.outputs[0].logprobs]
    merged = dataclasses.replace(
        comp, text="".join(p.outputs[0].text for p in parts),
        token_ids=[t for p in parts for t in p.outputs[0].token_ids], logprobs=lps,
        cumulative_logprob=None if lps is None
        else sum(logprob_value(next(iter(d.values()))) for d in lps))
    return dataclasses.replace(last, outputs=[merged], prompt_logprobs=first.prompt_logprobs,
                               num_cached_tokens=first.num_cached_tokens,
                               label_logprobs=first.label_logprobs)


async def run_until_disconnect(request: Request, coro: Any) -> Any:
    """Run ``coro`` unless the client goes away first: then cancel it (its streams abort
    and free their pages) and return None."""
    task = asyncio.ensure_future(coro)

    async def disconnected() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    return None


__all__ = ["ROW_FAILED", "OpenAIServing", "all_plain_ints", "logprob_value", "merge_outputs",
           "raise_if_delta_failed", "raise_if_failed", "random_id", "run_until_disconnect"]

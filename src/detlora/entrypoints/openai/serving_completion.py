"""``POST /v1/completions``: text or token-id prompts (one or a list), ``n`` completions each,
streamed as server-sent events or answered whole. Choice ``i * n + j`` is completion j of
prompt i, as OpenAI numbers them."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from detlora.engine.async_llm import RequestStream
from detlora.engine.outputs import RequestOutput
from detlora.entrypoints.openai.echo import EchoPlan, clamp_logprob, echoed, no_tokenizer_echo, plan
from detlora.entrypoints.openai.errors import OpenAIError, bad_request
from detlora.entrypoints.openai.protocol import CompletionRequest
from detlora.entrypoints.openai.serving_engine import (
    OpenAIServing,
    all_plain_ints,
    logprob_value,
    raise_if_delta_failed,
    random_id,
    run_until_disconnect,
)
from detlora.entrypoints.openai.sse import DONE, CompletionChunks, SSEResponse, event


class ServingCompletion(OpenAIServing):
    def _prompts(self, req: CompletionRequest) -> list[tuple[list[int], str | None]]:
        p = req.prompt
        if isinstance(p, str):
            items: list[Any] = [p]
        elif p and (all_plain_ints(p) or all(isinstance(x, int) for x in p)):
            items = [list(p)]
        else:
            items = list(p)
        if not items:
            raise bad_request("prompt is empty", "prompt")
        prompts = []
        for k, item in enumerate(items):
            where = f"prompt[{k}]" if len(items) > 1 else "prompt"
            if isinstance(item, str):
                ids, text = self.encode(item), item
            else:
                ids, text = list(item), None
            self.check_prompt(ids, where)
            prompts.append((ids, text))
        return prompts

    async def create(self, req: CompletionRequest, request: Request) -> Response:
        lora = self.models.resolve(req.model)
        if req.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("best_of must equal n (or be left out)", "best_of")
        echo = plan(req)
        no_tokenizer_echo(self.tokenizer, echo)
        prompts = self._prompts(req)
        params = self.sampling_params(
            req, max_tokens=echo.max_tokens, prompt_len=max(len(ids) for ids, _ in prompts),
            logprobs=req.logprobs, prompt_logprobs=echo.prompt_logprobs)
        rid = random_id("cmpl")
        model = req.model or self.models.base_name
        # Echo shows every choice its prompt's logprobs: each completion scores its prompt.
        streams = await self.open_streams(
            prompts, params, lora, rid, score_every_prompt=echo.echo,
            audit=self.audit_entry("completions", rid, lora, prompts, params))
        fingerprint = self.fingerprint(lora)
        texts = [self._prompt_text(ids, text) if echo.echo else "" for ids, text in prompts]
        if req.stream:
            return SSEResponse(self._stream(req, streams, rid, model, fingerprint, prompts,
                                            echo, texts))
        outs = await run_until_disconnect(request, self.collect(streams))
        if outs is None:
            return Response(status_code=499)
        choices = [self._choice(i, o, req, echo, texts[i // params.n])
                   for i, o in enumerate(outs)]
        completion = 0 if echo.prompt_only else sum(len(o.outputs[0].token_ids) for o in outs)
        cached = sum(o.num_cached_tokens for o in outs[:: params.n])
        body = {"id": rid, "object": "text_completion", "created": self.now(), "model": model,
                "choices": choices, "system_fingerprint": fingerprint,
                "usage": self.usage(sum(len(ids) for ids, _ in prompts), completion, cached)}
        return JSONResponse(body)

    def _prompt_text(self, ids: list[int], text: str | None) -> str:
        """The prompt as echo shows it: its text, or its token ids decoded (special tokens
        kept, as vLLM decodes them)."""
        return text if text is not None else self.tokenizer.hf.decode(ids)

    def _choice(self, index: int, out: RequestOutput, req: CompletionRequest,
                echo: EchoPlan, prompt_text: str) -> dict:
        comp = out.outputs[0]
        text, ids, entries = echoed(echo, prompt_text, out.prompt_token_ids,
                                    out.prompt_logprobs, comp.text, comp.token_ids,
                                    comp.logprobs)
        choice: dict[str, Any] = {
            "index": index, "text": text,
            "logprobs": self._logprobs(ids, entries, req, 0)
            if req.logprobs is not None else None,
            "finish_reason": comp.finish_reason, "stop_reason": comp.stop_reason}
        if req.return_token_ids:
            choice["token_ids"] = [] if echo.prompt_only else comp.token_ids
            choice["prompt_token_ids"] = out.prompt_token_ids
        if req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = _prompt_logprobs(out.prompt_logprobs)
        return choice

    async def _stream(self, req: CompletionRequest, streams: list[RequestStream], rid: str,
                      model: str, fingerprint: str,
                      prompts: list[tuple[list[int], str | None]], echo: EchoPlan,
                      texts: list[str]) -> AsyncIterator[str]:
        """The SSE events: one per delta of each choice (with echo, a choice's first delta
        starts with its prompt; with ``max_tokens=0`` the prompt is all it shows); the last
        choice's last delta carries the usage event (if asked) and ``[DONE]`` with it."""
        chunks = CompletionChunks(rid, self.now(), model, fingerprint)
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        want_logprobs = req.logprobs is not None
        want_ids = req.return_token_ids
        completion_tokens = 0
        cached = 0
        offsets = [0] * len(streams)
        seen: set[int] = set()
        left = len(streams)
        try:
            async for i, d in self.merged(streams):
                raise_if_delta_failed(streams[i], d)
                text, ids, entries = d.text, d.token_ids, d.logprobs
                if echo.prompt_only:
                    text, ids, entries = "", [], [] if entries is not None else None
                first = i not in seen
                if first:  # a stream's first delta: completion 0 counts the cache
                    seen.add(i)
                    cached += d.num_cached_tokens if i % req.n == 0 else 0
                    p = i // req.n
                    text, _, entries = echoed(echo, texts[p], prompts[p][0],
                                              d.prompt_logprobs, text, ids, entries)
                elif echo.prompt_only and d.finish_reason is None:
                    continue  # the token read beyond the prompt is not shown
                completion_tokens += len(ids)
                lps = self._logprobs([*prompts[i // req.n][0], *ids]
                                     if first and echo.echo else ids, entries, req,
                                     offsets[i]) if want_logprobs else None
                chunk = chunks.choice(i, text, lps, d.finish_reason, d.stop_reason,
                                      ids if want_ids else None)
                offsets[i] += len(text)
                if d.finish_reason is not None:
                    self.metrics.observe_finish(d.finish_reason)
                    left -= 1
                    if not left:  # the response's last event: the rest go with it
                        if include_usage:
                            chunk += chunks.usage(self.usage(
                                sum(len(ids) for ids, _ in prompts), completion_tokens, cached))
                        chunk += DONE
                yield chunk
            if left:  # the streams ended without finishing (cannot happen; end the answer)
                yield DONE
        except Exception as e:  # the engine died or failed the request: tell the client
            yield event(_stream_error(e)) + DONE

    def _logprobs(self, token_ids: list[int], entries: list | None, req: CompletionRequest,
                  text_offset: int) -> dict[str, list]:
        """``logprobs`` of these tokens (their text, logprobs, top ones, text offsets)."""
        as_ids = req.return_tokens_as_token_ids
        k = req.logprobs or 0
        token_text = self.token_text
        tokens, token_lps, tops, offsets = [], [], [], []
        offset = text_offset
        for tid, entry in zip(token_ids, entries or (), strict=True):
            tok = token_text(tid, as_ids)
            tokens.append(tok)
            if entry is None:  # the prompt's first token (echo): nothing predicts it
                token_lps.append(None)
                tops.append(None)
            else:
                token_lps.append(clamp_logprob(logprob_value(entry[tid])))
                tops.append({token_text(t, as_ids): clamp_logprob(lp)
                             for t, lp in self.top_entries(entry, k)} if k else None)
            offsets.append(offset)
            offset += len(tok)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
                "text_offset": offsets}


def _prompt_logprobs(entries: list | None) -> list | None:
    if entries is None:
        return None
    return [None if e is None else {str(t): lp for t, lp in e.items()} for e in entries]


def _stream_error(e: Exception) -> dict:
    """The SSE error event of a stream that cannot go on (OpenAI-shaped, no trace)."""
    if isinstance(e, OpenAIError):
        return e.body()
    return {"error": {"message": f"the request failed: {type(e).__name__}",
                      "type": "server_error", "param": None, "code": None}}


__all__ = ["ServingCompletion"]

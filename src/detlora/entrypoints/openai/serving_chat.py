"""``POST /v1/chat/completions``: messages rendered through the model's chat template, ``n``
choices, streamed as ``chat.completion.chunk`` events or answered whole."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from detlora.engine.async_llm import RequestStream
from detlora.entrypoints.openai.errors import bad_request
from detlora.entrypoints.openai.protocol import ChatCompletionRequest
from detlora.entrypoints.openai.serving_completion import _stream_error
from detlora.entrypoints.openai.serving_engine import (
    OpenAIServing,
    logprob_value,
    raise_if_delta_failed,
    random_id,
    run_until_disconnect,
)
from detlora.entrypoints.openai.sse import DONE, ChatChunks, SSEResponse, event


class ServingChat(OpenAIServing):
    def _messages(self, req: ChatCompletionRequest) -> list[dict[str, str]]:
        if not req.messages:
            raise bad_request("messages is empty", "messages")
        out = []
        for k, m in enumerate(req.messages):
            content = m.content
            if isinstance(content, list):
                parts = []
                for part in content:
                    if part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise bad_request(f"messages[{k}]: only text content parts are "
                                          "supported", "messages")
                    parts.append(part["text"])
                content = "".join(parts)
            out.append({"role": m.role, "content": content or ""})
        return out

    async def create(self, req: ChatCompletionRequest, request: Request) -> Response:
        lora = self.models.resolve(req.model)
        if req.tools:
            raise bad_request("tools are not supported", "tools")
        if self.tokenizer is None:
            raise bad_request("this model has no tokenizer, so chat is not available")
        messages = self._messages(req)
        try:
            ids = self.tokenizer.encode_chat(messages, req.add_generation_prompt)
        except ValueError as e:
            raise bad_request(str(e), "messages") from None
        except Exception as e:  # a template that fails on these messages
            raise bad_request(f"the chat template failed on these messages: "
                              f"{type(e).__name__}", "messages") from None
        self.check_prompt(ids, "the rendered chat")
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
            else req.max_tokens
        params = self.sampling_params(req, max_tokens=max_tokens, prompt_len=len(ids),
                                      logprobs=(req.top_logprobs or 0) if req.logprobs else None)
        rid = random_id("chatcmpl")
        model = req.model or self.models.base_name
        streams = await self.open_streams(
            [(ids, None)], params, lora, rid,
            audit=self.audit_entry("chat", rid, lora, [(ids, None)], params, messages=messages))
        fingerprint = self.fingerprint(lora)
        if req.stream:
            return SSEResponse(self._stream(req, streams, rid, model, fingerprint, len(ids)))
        outs = await run_until_disconnect(request, self.collect(streams))
        if outs is None:
            return Response(status_code=499)
        choices = []
        for i, o in enumerate(outs):
            comp = o.outputs[0]
            choice: dict[str, Any] = {
                "index": i, "message": {"role": "assistant", "content": comp.text},
                "logprobs": self._logprobs(comp.token_ids, comp.logprobs, req)
                if req.logprobs else None,
                "finish_reason": comp.finish_reason, "stop_reason": comp.stop_reason}
            if req.return_token_ids:
                choice["token_ids"] = comp.token_ids
            choices.append(choice)
        completion = sum(len(o.outputs[0].token_ids) for o in outs)
        body = {"id": rid, "object": "chat.completion", "created": self.now(), "model": model,
                "choices": choices, "system_fingerprint": fingerprint,
                "usage": self.usage(len(ids), completion, outs[0].num_cached_tokens)}
        if req.return_token_ids:
            body["prompt_token_ids"] = ids
        return JSONResponse(body)

    def _logprobs(self, token_ids: list[int], entries: list | None,
                  req: ChatCompletionRequest) -> dict[str, list]:
        """``logprobs`` of these tokens: one ``content`` entry each, with its top ones."""
        as_ids = req.return_tokens_as_token_ids
        k = req.top_logprobs or 0
        content = []
        for tid, entry in zip(token_ids, entries or (), strict=True):
            tok = self.token_text(tid, as_ids)
            content.append({
                "token": tok, "logprob": logprob_value(entry[tid]),
                "bytes": list(tok.encode()),
                "top_logprobs": [
                    {"token": (t := self.token_text(x, as_ids)), "logprob": lp,
                     "bytes": list(t.encode())}
                    for x, lp in (self.top_entries(entry, k) if k else ())]})
        return {"content": content}

    async def _stream(self, req: ChatCompletionRequest, streams: list[RequestStream], rid: str,
                      model: str, fingerprint: str, prompt_len: int) -> AsyncIterator[str]:
        """The SSE events: each choice's role, then one per delta of each choice; the last
        choice's last delta carries the usage event (if asked) and ``[DONE]`` with it."""
        chunks = ChatChunks(rid, self.now(), model, fingerprint)
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        want_ids = req.return_token_ids
        completion_tokens = 0
        cached = 0
        left = len(streams)
        try:
            # The roles first, as OpenAI sends them.
            yield "".join(chunks.role(i) for i in range(len(streams)))
            async for i, d in self.merged(streams):
                raise_if_delta_failed(streams[i], d)
                completion_tokens += len(d.token_ids)
                if i == 0 and d.num_cached_tokens:
                    cached = d.num_cached_tokens
                finished = d.finish_reason is not None
                chunk = chunks.choice(
                    i, d.text if d.text or not finished else None,
                    self._logprobs(d.token_ids, d.logprobs, req) if req.logprobs else None,
                    d.finish_reason, d.stop_reason, finished, d.token_ids if want_ids else None)
                if finished:
                    self.metrics.observe_finish(d.finish_reason or "abort")
                    left -= 1
                    if not left:  # the response's last event: the rest go with it
                        if include_usage:
                            chunk += chunks.usage(self.usage(prompt_len, completion_tokens,
                                                             cached))
                        chunk += DONE
                yield chunk
            if left:  # the streams ended without finishing (cannot happen; end the answer)
                yield DONE
        except Exception as e:
            yield event(_stream_error(e)) + DONE


__all__ = ["ServingChat"]

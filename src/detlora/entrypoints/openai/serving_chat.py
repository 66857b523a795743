"""``POST /v1/chat/completions``: messages rendered through the model's chat template, ``n``
choices, streamed as ``chat.completion.chunk`` events or answered whole."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from detlora.engine.outputs import RequestOutput
from detlora.entrypoints.openai.errors import bad_request
from detlora.entrypoints.openai.protocol import ChatCompletionRequest
from detlora.entrypoints.openai.serving_completion import _stream_error
from detlora.entrypoints.openai.serving_engine import (
    OpenAIServing,
    logprob_value,
    raise_if_failed,
    random_id,
    run_until_disconnect,
)


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
        try:
            ids = self.tokenizer.encode_chat(self._messages(req), req.add_generation_prompt)
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
        streams = await self.open_streams([(ids, None)], params, lora, rid)
        fingerprint = self.fingerprint(lora)
        if req.stream:
            return StreamingResponse(self._stream(req, streams, rid, model, fingerprint,
                                                  len(ids)), media_type="text/event-stream")
        outs = await run_until_disconnect(request, self.collect(streams))
        if outs is None:
            return Response(status_code=499)
        choices = []
        for i, o in enumerate(outs):
            comp = o.outputs[0]
            choice: dict[str, Any] = {
                "index": i, "message": {"role": "assistant", "content": comp.text},
                "logprobs": self._logprobs(o, req) if req.logprobs else None,
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

    def _logprobs(self, out: RequestOutput, req: ChatCompletionRequest) -> dict:
        comp = out.outputs[0]
        as_ids = req.return_tokens_as_token_ids
        k = req.top_logprobs or 0
        content = []
        for tid, entry in zip(comp.token_ids, comp.logprobs or (), strict=True):
            tok = self.token_text(tid, as_ids)
            content.append({
                "token": tok, "logprob": logprob_value(entry[tid]),
                "bytes": list(tok.encode()),
                "top_logprobs": [
                    {"token": (t := self.token_text(x, as_ids)), "logprob": lp,
                     "bytes": list(t.encode())}
                    for x, lp in (self.top_entries(entry, k) if k else ())]})
        return {"content": content}

    async def _stream(self, req: ChatCompletionRequest, streams: list, rid: str, model: str,
                      fingerprint: str, prompt_len: int) -> AsyncIterator[str]:
        created = self.now()
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        head = {"id": rid, "object": "chat.completion.chunk", "created": created,
                "model": model, "system_fingerprint": fingerprint}
        completion_tokens = 0
        cached = 0
        try:
            for i in range(len(streams)):  # the role first, as OpenAI sends it
                first = {"index": i, "delta": {"role": "assistant", "content": ""},
                         "logprobs": None, "finish_reason": None}
                yield f"data: {json.dumps({**head, 'choices': [first]})}\n\n"
            async for i, out in self.merged(streams):
                comp = out.outputs[0]
                raise_if_failed(out)
                completion_tokens += len(comp.token_ids)
                if i == 0 and out.num_cached_tokens:
                    cached = out.num_cached_tokens
                choice: dict[str, Any] = {
                    "index": i, "delta": {"content": comp.text} if comp.text or not
                    out.finished else {},
                    "logprobs": self._logprobs(out, req) if req.logprobs else None,
                    "finish_reason": comp.finish_reason}
                if out.finished:
                    choice["stop_reason"] = comp.stop_reason
                    self.metrics.observe_finish(comp.finish_reason or "abort")
                if req.return_token_ids:
                    choice["token_ids"] = comp.token_ids
                yield f"data: {json.dumps({**head, 'choices': [choice]})}\n\n"
            if include_usage:
                usage = self.usage(prompt_len, completion_tokens, cached)
                yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage})}\n\n"
        except Exception as e:
            yield f"data: {json.dumps(_stream_error(e))}\n\n"
        yield "data: [DONE]\n\n"


__all__ = ["ServingChat"]

"""``POST /v1/decisions`` and ``POST /v1/systemone``: typed questions about a state, one read
per question (``detlora.decisions``), all of a request's questions sent together so they share
the state's prefix pages. The two routes differ in shape only: ``/v1/decisions`` takes shared
``instructions`` and returns ``id``, ``object`` and ``system_fingerprint`` beside the answers;
``/v1/systemone`` (TypeSafe's) puts the instructions in each question."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from detlora.config import SamplingParams
from detlora.decisions import answer, parse_questions, plan_reads
from detlora.entrypoints.openai.errors import bad_request
from detlora.entrypoints.openai.protocol import DecisionsRequest, SystemOneRequest
from detlora.entrypoints.openai.serving_engine import (
    OpenAIServing,
    random_id,
    run_until_disconnect,
)

_READ = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)


class ServingDecisions(OpenAIServing):
    async def decide(self, req: DecisionsRequest | SystemOneRequest, request: Request,
                     *, systemone: bool) -> Response:
        lora = self.models.resolve(req.model)
        questions = {k: q.model_dump(exclude_none=True) for k, q in req.questions.items()}
        instructions = None if systemone else req.instructions
        try:
            reads = plan_reads(self.tokenizer, req.state,
                               parse_questions(questions, self.config.max_questions),
                               instructions)
        except ValueError as e:
            raise bad_request(str(e), "questions") from None
        for r in reads:
            self.check_prompt(r.prompt_token_ids, f"question {r.question.id!r}")
        rid = random_id("decision")
        prompts = [(r.prompt_token_ids, None) for r in reads]
        audit = self.audit_entry("systemone" if systemone else "decisions", rid, lora, prompts,
                                 _READ, decision={"reads": reads, "state": req.state,
                                                  "instructions": instructions})
        streams = await self.open_streams(
            prompts, _READ, lora, rid, label_token_ids=[r.label_token_ids for r in reads],
            audit=audit)
        outs = await run_until_disconnect(request, self.collect(streams))
        if outs is None:
            return Response(status_code=499)
        answers: dict[str, Any] = {}
        for r, out in zip(reads, outs, strict=True):
            if out.label_logprobs is None:
                raise bad_request(f"question {r.question.id!r} could not be read")
            try:
                answers[r.question.id] = answer(r, out.label_logprobs)
            except ValueError as e:
                raise bad_request(f"question {r.question.id!r}: {e}") from None
        prompt_tokens = sum(len(r.prompt_token_ids) for r in reads)
        cached = sum(o.num_cached_tokens for o in outs)
        model = req.model or self.models.base_name
        fingerprint = self.fingerprint(lora)
        if systemone:
            body = {"model": model, "answers": answers, "system_fingerprint": fingerprint,
                    "usage": {"input_tokens": prompt_tokens, "output_tokens": 0,
                              "cached_tokens": cached}}
        else:
            body = {"id": rid, "object": "decision", "created": self.now(), "model": model,
                    "answers": answers, "system_fingerprint": fingerprint,
                    "usage": self.usage(prompt_tokens, 0, cached)}
        return JSONResponse(body)


__all__ = ["ServingDecisions"]

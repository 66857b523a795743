"""Audit entries: what a request was and what the engine answered, turned into a log line.

``AuditRecorder`` owns the writer and what every line shares (the served model, the engine's
fingerprint parts). A server or ``LLM`` opens an ``AuditEntry`` per request or decision and a
``ChoiceLog`` per engine request in it (each of ``n`` choices, each question): the server's
streams feed a ``ChoiceLog`` delta by delta (it is their ``audit`` hook), ``LLM`` fills it
from finished outputs. When its last choice ends the entry goes to the writer, whose thread
builds the line (hashes, JSON): the caller only appends to lists.
"""

from __future__ import annotations

import dataclasses
import os
import time
import uuid
from collections.abc import Mapping, Sequence
from enum import Enum
from typing import Any

from detlora.audit.format import (
    REQUEST,
    VERSION,
    ids_sha256,
    logprobs_sha256,
    params_to_json,
    utc_time,
    value_of,
)
from detlora.audit.writer import AuditConfig, AuditStats, AuditWriter
from detlora.config import SamplingParams
from detlora.decisions.reads import DecisionRead, softmax
from detlora.engine.fingerprint import fingerprint, fingerprint_fields
from detlora.lora.request import LoRARequest


def engine_args_json(args: Any) -> dict[str, Any]:
    """An ``EngineArgs`` as JSON values (enums by value)."""
    out = {}
    for f in dataclasses.fields(args):
        value = getattr(args, f.name)
        out[f.name] = value.value if isinstance(value, Enum) else value
    return out


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class AuditRecorder:
    """The log of one engine (see the module doc). ``model``: the name it is served under;
    ``engine_args``: the arguments it was built with (what ``detlora verify`` builds again)."""

    def __init__(self, config: AuditConfig, *, model: str, engine_args: Any,
                 fingerprint_parts: Mapping[str, Any], writer: str) -> None:
        self.config = config
        self.hash_only = config.hash_only
        self.model = model
        self.parts = dict(fingerprint_parts)
        self.engine_id = fingerprint(self.parts, None)
        self._fields: dict[str | None, dict[str, str]] = {}
        args = engine_args_json(engine_args)
        for name in ("model", "tokenizer"):  # a local path as an absolute one
            if isinstance(args.get(name), str) and os.path.exists(args[name]):
                args[name] = os.path.abspath(args[name])
        self.writer = AuditWriter(config, {
            "id": self.engine_id, "model": model, "engine_args": args,
            "fingerprint_parts": self.parts, "fingerprint_fields": self.fields(None),
            "hash_only": config.hash_only, "writer": writer, "pid": os.getpid()})

    @property
    def stats(self) -> AuditStats:
        return self.writer.stats

    def fields(self, adapter_hash: str | None) -> dict[str, str]:
        known = self._fields.get(adapter_hash)
        if known is None:
            known = self._fields[adapter_hash] = fingerprint_fields(self.parts, adapter_hash)
        return known

    def entry(self, route: str, request_id: str, *, lora: LoRARequest | None,
              adapter_hash: str | None, fingerprint_value: str,
              prompts: Sequence[tuple[Sequence[int], str | None]], params: SamplingParams,
              messages: Any = None, decision: Mapping[str, Any] | None = None) -> AuditEntry:
        return AuditEntry(self, route, request_id, lora, adapter_hash, fingerprint_value,
                          prompts, params, messages, decision)

    def close(self) -> None:
        self.writer.close()


class ChoiceLog:
    """One engine request of an entry: its seed, tokens, logprobs, how it ended. As a
    stream's ``audit`` hook it is called with each engine delta, then (if the stream ends
    unfinished) with None."""

    __slots__ = ("entry", "finish_reason", "got_first", "index", "label_logprobs",
                 "label_token_ids", "logprobs", "prompt", "prompt_logprobs", "scores_prompt",
                 "seed", "token_ids")

    def __init__(self, entry: AuditEntry, prompt: int, index: int,
                 label_token_ids: Sequence[int] | None, scores_prompt: bool) -> None:
        self.entry = entry
        self.prompt = prompt
        self.index = index
        self.scores_prompt = scores_prompt  # ran with the request's prompt_logprobs
        self.label_token_ids = None if label_token_ids is None else list(label_token_ids)
        self.seed: int | None = None
        self.token_ids: list[int] = []
        self.logprobs: list[Any] = []
        self.prompt_logprobs: list[Any] | None = None
        self.label_logprobs: Mapping[int, float] | None = None
        self.finish_reason: str | None = None
        self.got_first = False  # the engine's first report (prompt and label logprobs) came

    def __call__(self, stream: Any, delta: tuple | None) -> None:
        if delta is None:  # ended unfinished: aborted, or refused before it ran
            if stream.seed is None:
                self.entry.discard()
            else:
                self.finish(stream.seed, "abort")
            return
        ids, lps, reason, first = delta[1], delta[2], delta[3], delta[5]
        if ids:
            self.token_ids += ids
        if lps:
            self.logprobs += lps
        if first is not None:
            self.got_first = True
            self.prompt_logprobs, self.label_logprobs = first[1], first[2]
        if reason is not None:
            self.finish(stream.seed, reason)

    def fill(self, seed: int, token_ids: Sequence[int], finish_reason: str | None,
             logprobs: Sequence[Any] | None, prompt_logprobs: Sequence[Any] | None = None,
             label_logprobs: Mapping[int, float] | None = None) -> None:
        """A finished output at once (``LLM``)."""
        self.token_ids = list(token_ids)
        self.logprobs = list(logprobs or ())
        self.prompt_logprobs = None if prompt_logprobs is None else list(prompt_logprobs)
        self.label_logprobs = label_logprobs
        self.got_first = True
        self.finish(seed, finish_reason or "abort")

    def finish(self, seed: int | None, reason: str) -> None:
        if self.finish_reason is not None:
            return
        self.seed = seed
        self.finish_reason = reason
        self.entry._choice_done()

    def record(self, params: SamplingParams, hash_only: bool) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index, "prompt": self.prompt, "seed": self.seed,
                               "finish_reason": self.finish_reason,
                               "num_tokens": len(self.token_ids)}
        if params.prompt_logprobs is not None:
            out["scores_prompt"] = self.scores_prompt
        if hash_only:
            out["token_ids_sha256"] = ids_sha256(self.token_ids)
        else:
            out["token_ids"] = self.token_ids
            if params.logprobs is not None:  # the chosen tokens' values, for the report
                out["logprobs"] = [value_of(e[t]) for e, t in
                                   zip(self.logprobs, self.token_ids, strict=False)]
        first = self.got_first
        labels = self.label_logprobs if first else None
        out["logprobs_sha256"] = logprobs_sha256(
            self.logprobs, self.prompt_logprobs if first else None, self.label_token_ids,
            labels)
        if self.label_token_ids is not None and labels is not None and not hash_only:
            values = [labels[t] for t in self.label_token_ids]
            out["label_logprobs"] = values
            try:
                out["probabilities"] = softmax(values)
            except ValueError:  # every label at probability 0
                out["probabilities"] = None
        return out


class AuditEntry:
    """One request or decision: its choices, and its line once they all ended (an entry
    with a choice the engine refused is never written: the request was answered 400)."""

    def __init__(self, recorder: AuditRecorder, route: str, request_id: str,
                 lora: LoRARequest | None, adapter_hash: str | None, fingerprint_value: str,
                 prompts: Sequence[tuple[Sequence[int], str | None]], params: SamplingParams,
                 messages: Any, decision: Mapping[str, Any] | None) -> None:
        self.recorder = recorder
        self.route = route
        self.id = request_id
        self.lora = lora
        self.adapter_hash = adapter_hash
        self.fingerprint = fingerprint_value
        self.prompts = prompts
        self.params = params
        self.messages = messages
        self.decision = decision
        self.choices: list[ChoiceLog] = []
        self._left = 0
        self._sealed = False  # every choice is known (so 0 left means done)
        self._discarded = False
        self.time = 0.0

    def choice(self, prompt: int, index: int, label_token_ids: Sequence[int] | None = None,
               *, scores_prompt: bool = True) -> ChoiceLog:
        """Open the next choice: ``scores_prompt``, whether it runs with the request's
        ``prompt_logprobs`` (completion 0 of a prompt does; with echo, all of them)."""
        c = ChoiceLog(self, prompt, index, label_token_ids, scores_prompt)
        self.choices.append(c)
        self._left += 1
        return c

    def seal(self) -> None:
        """Every choice has been opened: the entry is written once they have all ended."""
        self._sealed = True
        self._maybe_submit()

    def discard(self) -> None:
        self._discarded = True

    def _choice_done(self) -> None:
        self._left -= 1
        self._maybe_submit()

    def _maybe_submit(self) -> None:
        if self._sealed and self._left == 0 and not self._discarded:
            self._discarded = True  # once
            self.time = time.time()
            self.recorder.writer.submit(self.record)

    def record(self) -> dict[str, Any]:
        """The line (built on the writer thread)."""
        rec = self.recorder
        hash_only = rec.hash_only
        request: dict[str, Any] = {}
        if hash_only:
            request["prompts"] = [{"token_ids_sha256": ids_sha256(ids)} for ids, _ in self.prompts]
        else:
            request["prompts"] = [{"token_ids": list(ids), **({"text": text} if text else {})}
                                  for ids, text in self.prompts]
            if self.messages is not None:
                request["messages"] = self.messages
        request["sampling_params"] = params_to_json(self.params)
        if self.decision is not None:
            request["questions"] = [_question(r, hash_only) for r in self.decision["reads"]]
            if not hash_only:
                request["state"] = self.decision.get("state")
                request["instructions"] = self.decision.get("instructions")
        outputs = [c.record(self.params, hash_only) for c in self.choices]
        if self.decision is not None:
            for out, r in zip(outputs, self.decision["reads"], strict=True):
                out["question"] = r.question.id
        adapter = None
        if self.lora is not None:
            adapter = {"name": self.lora.name, "path": self.lora.real_path,
                       "sha256": self.adapter_hash}
        return {"v": VERSION, "kind": REQUEST, "id": self.id, "time": utc_time(self.time),
                "route": self.route, "model": rec.model, "engine": rec.engine_id,
                "adapter": adapter, "request": request, "outputs": outputs,
                "fingerprint": {"value": self.fingerprint,
                                "fields": rec.fields(self.adapter_hash)}}


def _question(read: DecisionRead, hash_only: bool) -> dict[str, Any]:
    q = read.question
    out: dict[str, Any] = {"id": q.id, "type": q.type, "labels": list(q.labels),
                           "label_token_ids": list(read.label_token_ids)}
    if not hash_only:
        out |= {"text": q.text, "options": list(q.options),
                "descriptions": list(q.descriptions)}
    return out


__all__ = ["AuditEntry", "AuditRecorder", "ChoiceLog", "engine_args_json", "new_id"]

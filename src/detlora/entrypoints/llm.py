"""``LLM``: the offline API, shaped like vLLM's.

    llm = LLM("path/to/model", enable_lora=True, determinism="batch_invariant")
    outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(max_tokens=32, logprobs=0),
                        lora_request=[LoRARequest("tox", 1, "path/to/adapter"), None])
    outs[0].outputs[0].token_ids, .text, .logprobs[0][token].logprob, outs[0].fingerprint

Its keyword arguments are the fields of ``detlora.EngineArgs`` (vLLM's names where vLLM has
the option).
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from detlora.config import RequestOutputKind, SamplingParams
from detlora.decisions import answer, parse_questions, plan_reads
from detlora.engine.frozen_heap import frozen_heap
from detlora.engine.llm_engine import LLMEngine
from detlora.engine.model_files import resolve_model_files
from detlora.engine.outputs import RequestOutput
from detlora.engine.prompts import Prompt, parse_prompts, per_prompt
from detlora.engine.tokenizer import Tokenizer
from detlora.engine_args import EngineArgs
from detlora.lora.request import LoRARequest


@dataclasses.dataclass(frozen=True)
class Decision:
    """``LLM.decide``'s result: one answer per question id (the wire shape of
    ``/v1/decisions``), token counts, and the fingerprint of the engine and adapter."""

    answers: dict[str, dict]
    prompt_tokens: int
    cached_tokens: int
    fingerprint: str


class LLM:
    def __init__(self, model: str | Path, *, audit_log: str | Path | None = None,
                 audit_log_hash_only: bool = False, **kwargs: Any) -> None:
        """``audit_log``: a directory that gets one JSON line per finished prompt of
        ``generate``/``chat`` and per ``decide`` call (``detlora verify`` replays it);
        ``audit_log_hash_only``: hashes instead of token ids and texts there."""
        args = EngineArgs.from_kwargs("LLM()", model=str(model), **kwargs)
        self.engine_args = args
        # A Hub id or a .gguf file becomes a local model directory (downloaded or converted
        # once); the engine then reads that directory.
        files = resolve_model_files(args)
        local = files.args
        # detlora's own wrapper (encode, chat, decode); get_tokenizer() is Hugging Face's.
        self.tokenizer: Tokenizer | None = None
        if files.tokenizer_dir is not None:
            self.tokenizer = Tokenizer(files.tokenizer_dir, mode=args.tokenizer_mode,
                                       trust_remote_code=args.trust_remote_code)
        tok = self.tokenizer
        self.engine = LLMEngine(
            local,
            detokenize=tok.decode if tok else None,
            token_text=tok.token_text if tok else None,
            extra_eos_token_ids=tok.eos_token_ids if tok else (),
            tokenizer=tok,
        )
        self._audit = None
        if audit_log is not None:
            from detlora.audit.records import AuditRecorder
            from detlora.audit.writer import AuditConfig

            self._audit = AuditRecorder(
                AuditConfig(str(audit_log), hash_only=audit_log_hash_only), model=args.model,
                engine_args=args, fingerprint_parts=self.engine.fingerprint_parts, writer="LLM")
        elif audit_log_hash_only:
            raise ValueError("audit_log_hash_only needs audit_log=DIR")

    @property
    def config(self) -> EngineArgs:
        """The engine arguments this LLM was built with."""
        return self.engine_args

    def get_tokenizer(self) -> Any:
        """The Hugging Face tokenizer (None with ``skip_tokenizer_init`` or a model directory
        without one)."""
        return self.tokenizer.hf if self.tokenizer is not None else None

    def register_lora(self, lora_request: LoRARequest) -> None:
        """Register an adapter by path without reading it (``LLMEngine.register_lora``)."""
        self.engine.register_lora(lora_request)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Register an adapter and read it into the host cache now (``LLMEngine.add_lora``)."""
        return self.engine.add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        """Forget an adapter; its id may name another directory afterwards."""
        return self.engine.remove_lora(lora_id)

    def list_loras(self) -> set[int]:
        """Ids of the registered adapters."""
        return self.engine.list_loras()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached KV page; later prompts compute their prefixes again."""
        return self.engine.reset_prefix_cache()

    # ---- lifetime ----

    def shutdown(self) -> None:
        """Release the engine's model, KV cache and graphs now (vLLM's ``shutdown``); the
        LLM cannot generate afterwards. The audit log, if any, is written out and closed."""
        self.engine.shutdown()
        if getattr(self, "_audit", None) is not None:
            self._audit.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- generation ----

    def _token_ids(self, p: Prompt, where: str,
                   chat: Mapping[str, Any]) -> tuple[list[int], str | None]:
        if p.token_ids is not None:
            return list(p.token_ids), p.text
        if self.tokenizer is None:
            raise ValueError(f"{where} is text or chat, but the engine has no tokenizer: pass "
                             "token ids")
        if p.messages is not None:
            return self.tokenizer.encode_chat(p.messages, **chat), None
        assert p.text is not None
        return self.tokenizer.encode(p.text), p.text

    def generate(
        self,
        prompts: object,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for one prompt or a list; outputs come back in prompt order.
        ``sampling_params=None`` takes ``SamplingParams()`` (vLLM's defaults: temperature 1,
        16 tokens)."""
        return self._generate(prompts, sampling_params, lora_request, use_tqdm, {})

    def _generate(self, prompts: object, sampling_params: object, lora_request: object,
                  use_tqdm: bool, chat: Mapping[str, Any]) -> list[RequestOutput]:
        parsed = parse_prompts(prompts)
        n = len(parsed)
        params = per_prompt(sampling_params if sampling_params is not None else SamplingParams(),
                            n, "sampling_params", lambda x: isinstance(x, SamplingParams))
        loras = per_prompt(lora_request, n, "lora_request",
                           lambda x: x is None or isinstance(x, LoRARequest))
        # Check every request before adding any, so a bad one leaves the engine untouched.
        encoded = [self._token_ids(p, f"prompts[{i}]", chat) for i, p in enumerate(parsed)]
        for (ids, _), sp, lr in zip(encoded, params, loras, strict=True):
            self.engine.check_request(ids, sp, lr)
        # Completion 0 scores the prompt (prompt_logprobs) for all n of them; each request
        # is reported once, when it finishes.
        final = [sp if sp.output_kind is RequestOutputKind.FINAL_ONLY
                 else dataclasses.replace(sp, output_kind=RequestOutputKind.FINAL_ONLY)
                 for sp in params]
        groups = [
            [self.engine.add_request(
                ids, sp if i == 0 else dataclasses.replace(sp, prompt_logprobs=None), lora=lr,
                prompt=text, sample_index=i) for i in range(sp.n)]
            for (ids, text), sp, lr in zip(encoded, final, loras, strict=True)
        ]
        outs = self._run([s for g in groups for s in g], use_tqdm)
        if self._audit is not None:
            self._audit_generate(parsed, encoded, params, loras, groups, outs)
        merged, at = [], 0
        for g in groups:  # one RequestOutput per prompt, its n completions indexed 0..n-1
            first, *rest = outs[at: at + len(g)]
            at += len(g)
            merged.append(first if not rest else dataclasses.replace(
                first, outputs=[dataclasses.replace(o.outputs[0], index=i)
                                for i, o in enumerate([first, *rest])]))
        return merged

    def chat(
        self,
        messages: object,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        use_tqdm: bool = True,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or a list of conversations, rendered by the
        tokenizer's chat template (or ``chat_template``), vLLM's arguments."""
        if isinstance(messages, (list, tuple)) and messages and all(
            isinstance(m, dict) for m in messages
        ):
            messages = [messages]
        if not isinstance(messages, (list, tuple)) or not messages or not all(
            isinstance(c, (list, tuple)) and c and all(isinstance(m, dict) and "role" in m
                                                        for m in c)
            for c in messages
        ):
            raise ValueError("chat takes a list of {'role', 'content'} messages, or a list of "
                             "such conversations")
        if chat_template is not None and not isinstance(chat_template, str):
            raise ValueError(f"chat_template must be a template string, got "
                             f"{type(chat_template).__name__}")
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, Mapping):
            raise ValueError("chat_template_kwargs must be a dict")
        for name, flag in (("add_generation_prompt", add_generation_prompt),
                           ("continue_final_message", continue_final_message)):
            if not isinstance(flag, bool):
                raise ValueError(f"{name} must be a bool, got {flag!r}")
        chat = {"chat_template": chat_template, "add_generation_prompt": add_generation_prompt,
                "continue_final_message": continue_final_message,
                "chat_template_kwargs": chat_template_kwargs, "tools": tools}
        return self._generate(list(messages), sampling_params, lora_request, use_tqdm, chat)

    def decide(
        self,
        state: object,
        questions: dict,
        *,
        instructions: object = None,
        lora_request: LoRARequest | None = None,
    ) -> Decision:
        """Answer typed questions about ``state`` with probabilities (``detlora.decisions``):
        ``questions`` maps ids to {"type": "noul" | "choice" | "score", "criteria": ...,
        "instructions"?: ...}. One read per question, all questions in one batch (they share
        the state's prefix pages); equal fingerprints give equal probabilities."""
        reads = plan_reads(self.tokenizer, state, parse_questions(questions), instructions)
        sp = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                            output_kind=RequestOutputKind.FINAL_ONLY)
        for r in reads:
            self.engine.check_request(r.prompt_token_ids, sp, lora_request, r.label_token_ids)
        seqs = [self.engine.add_request(r.prompt_token_ids, sp, lora=lora_request,
                                        label_token_ids=r.label_token_ids) for r in reads]
        outs = self._run(seqs, use_tqdm=False)
        if self._audit is not None:
            entry = self._audit.entry(
                "decide", _new_id("decide"), lora=lora_request,
                adapter_hash=self._adapter_hash(lora_request),
                fingerprint_value=outs[0].fingerprint,
                prompts=[(r.prompt_token_ids, None) for r in reads], params=sp,
                decision={"reads": reads, "state": state, "instructions": instructions})
            for q, (r, seq, out) in enumerate(zip(reads, seqs, outs, strict=True)):
                comp = out.outputs[0]
                entry.choice(q, q, r.label_token_ids).fill(
                    seq.sample_seed, comp.token_ids, comp.finish_reason, None,
                    label_logprobs=out.label_logprobs)
            entry.seal()
        answers = {}
        for r, out in zip(reads, outs, strict=True):
            if out.outputs[0].finish_reason == "error":  # non-finite logits, a bad adapter
                raise RuntimeError(f"question {r.question.id!r} could not be read: "
                                   f"{out.outputs[0].error}")
            assert out.label_logprobs is not None
            answers[r.question.id] = answer(r, out.label_logprobs)
        prompt_tokens = sum(len(r.prompt_token_ids) for r in reads)
        cached = sum(o.num_cached_tokens for o in outs)
        return Decision(answers=answers, prompt_tokens=prompt_tokens, cached_tokens=cached,
                        fingerprint=outs[0].fingerprint)

    def _adapter_hash(self, lora: LoRARequest | None) -> str | None:
        try:
            return self.engine.adapter_hash(lora)
        except ValueError:  # never loaded: its requests failed
            return None

    def _audit_generate(self, parsed: list[Prompt], encoded: list[tuple[list[int], str | None]],
                        params: list[SamplingParams], loras: list[LoRARequest | None],
                        groups: list[list[Any]], outs: list[RequestOutput]) -> None:
        """One audit line per prompt, its n completions as its outputs."""
        assert self._audit is not None
        at = 0
        for p, (ids, text), sp, lr, group in zip(parsed, encoded, params, loras, groups,
                                                  strict=True):
            route = "chat" if p.messages is not None else "generate"
            mine = outs[at: at + len(group)]
            at += len(group)
            entry = self._audit.entry(route, _new_id(route), lora=lr,
                                      adapter_hash=self._adapter_hash(lr),
                                      fingerprint_value=mine[0].fingerprint,
                                      prompts=[(ids, text)], params=sp, messages=p.messages)
            for i, (seq, out) in enumerate(zip(group, mine, strict=True)):
                comp = out.outputs[0]
                entry.choice(0, i, scores_prompt=i == 0).fill(
                    seq.sample_seed, comp.token_ids, comp.finish_reason, comp.logprobs,
                    out.prompt_logprobs)
            entry.seal()

    def _run(self, seqs: list, use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        bar = _Progress(seqs, enabled=use_tqdm)
        by_id: dict[str, RequestOutput] = {}
        try:
            with frozen_heap():  # collections in the loop skip what existed before it
                while engine.has_unfinished():
                    finished = 0
                    for out in engine.step():
                        if out.finished:
                            by_id[out.request_id] = out
                            finished += 1
                    bar.step(finished)
        except BaseException:
            engine.abort_all()  # leave no half-run request behind for the next call
            raise
        finally:
            bar.close()
        return [by_id[s.request_id] for s in seqs]


class _Progress:
    """vLLM's bar for ``generate``: finished requests out of all, and the prompt and output
    tokens per second, refreshed after every step (tqdm, on stderr; off when stderr is not a
    terminal)."""

    def __init__(self, seqs: list, *, enabled: bool) -> None:
        import sys

        from tqdm import tqdm

        self.seqs = seqs
        self.bar = tqdm(total=len(seqs), desc="Processed prompts", unit="req",
                        disable=not (enabled and sys.stderr.isatty()), dynamic_ncols=True,
                        mininterval=0.2)
        self.started = self.shown = time.monotonic()

    def step(self, finished: int) -> None:
        if self.bar.disable:
            return
        now = time.monotonic()
        if now - self.shown >= 0.2 or self.bar.n + finished >= self.bar.total:
            self.shown = now
            elapsed = max(now - self.started, 1e-9)
            computed = sum(min(s.num_computed, s.num_prompt_tokens) for s in self.seqs)
            out = sum(s.num_output_tokens for s in self.seqs)
            self.bar.set_postfix_str(f"input: {computed / elapsed:.0f} tok/s, "
                                     f"output: {out / elapsed:.0f} tok/s", refresh=False)
            self.bar.update(finished)
            self.bar.refresh()
        elif finished:
            self.bar.update(finished)

    def close(self) -> None:
        self.bar.close()


def _new_id(prefix: str) -> str:
    import uuid

    return f"{prefix}-{uuid.uuid4().hex}"


def _signature() -> inspect.Signature:
    """``LLM.__init__``'s signature as ``help()`` and editors show it: the engine arguments
    and the audit log's."""
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
              inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                annotation="str | Path"),
              inspect.Parameter("audit_log", inspect.Parameter.KEYWORD_ONLY, default=None,
                                annotation="str | Path | None"),
              inspect.Parameter("audit_log_hash_only", inspect.Parameter.KEYWORD_ONLY,
                                default=False, annotation="bool")]
    for f in dataclasses.fields(EngineArgs):
        if f.name != "model":
            params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY,
                                            default=f.default, annotation=f.type))
    return inspect.Signature(params, return_annotation=None)


LLM.__init__.__signature__ = _signature()  # type: ignore[attr-defined]

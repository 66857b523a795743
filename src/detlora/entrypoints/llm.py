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
from detlora.decisions import DecisionRead, ReadPlanner, answer, parse_questions
from detlora.engine.frozen_heap import frozen_heap
from detlora.engine.llm_engine import LLMEngine
from detlora.engine.model_files import resolve_model_files
from detlora.engine.outputs import RequestOutput
from detlora.engine.prompts import Prompt, parse_prompts, per_prompt
from detlora.engine.tokenizer import Tokenizer, check_text
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

    def _encode_all(self, parsed: Sequence[Prompt],
                    chat: Mapping[str, Any]) -> list[tuple[list[int], str | None]]:
        """Each prompt's token ids (and its text, for a text prompt): token ids as they are,
        text and rendered chats encoded together in one tokenizer call."""
        out: list[tuple[list[int], str | None]] = [([], None)] * len(parsed)
        texts: list[tuple[int, str]] = []
        chats: list[tuple[int, str]] = []
        for i, p in enumerate(parsed):
            if p.token_ids is not None:
                out[i] = (list(p.token_ids), p.text)
                continue
            if self.tokenizer is None:
                raise ValueError(f"prompts[{i}] is text or chat, but the engine has no "
                                 "tokenizer: pass token ids")
            if p.messages is not None:
                chats.append((i, self.tokenizer.render_chat(p.messages, **chat)))
            else:
                assert p.text is not None
                check_text(p.text, f"prompts[{i}]")
                texts.append((i, p.text))
        for items, special in ((texts, True), (chats, False)):
            if items:
                ids = self.tokenizer.encode_many([t for _, t in items],
                                                 add_special_tokens=special, checked=True)
                for (i, text), row in zip(items, ids, strict=True):
                    out[i] = (row, text if special else None)
        return out

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
        encoded = self._encode_all(parsed, chat)
        checked = self.engine.check_requests([(ids, sp, lr, None) for (ids, _), sp, lr
                                              in zip(encoded, params, loras, strict=True)])
        # Completion 0 scores the prompt (prompt_logprobs) for all n of them; each request
        # is reported once, when it finishes. Params shared by many prompts are copied once.
        final = _per_object(params, lambda sp: sp if sp.output_kind is RequestOutputKind.FINAL_ONLY
                            else dataclasses.replace(sp, output_kind=RequestOutputKind.FINAL_ONLY))
        later = _per_object(final, lambda sp: sp if sp.n == 1 or sp.prompt_logprobs is None
                            else dataclasses.replace(sp, prompt_logprobs=None))
        add = self.engine.add_request
        groups = [
            [add(ids, sp if i == 0 else sl, lora=lr, prompt=text, sample_index=i, checked=True)
             for i in range(sp.n)]
            for ids, (_, text), sp, sl, lr in zip(checked, encoded, final, later, loras,
                                                  strict=True)
        ]
        outs = self._run([s for g in groups for s in g], use_tqdm)
        if self._audit is not None:
            self._audit_generate(parsed, encoded, params, loras, groups, outs)
        if len(outs) == len(groups):  # one completion per prompt: the outputs as they are
            return outs
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
        questions: dict | Sequence[dict],
        *,
        instructions: object = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        use_tqdm: bool | None = None,
    ) -> Decision | list[Decision]:
        """Answer typed questions about ``state`` with probabilities (``detlora.decisions``):
        ``questions`` maps ids to {"type": "noul" | "choice" | "score", "criteria": ...,
        "instructions"?: ...}. One read per question, all questions in one batch (they share
        the state's prefix pages); equal fingerprints give equal probabilities.

        ``state`` a list: many states in one call, one ``Decision`` each, in order (a state
        that is itself a JSON array goes in a list of one). ``questions`` (and
        ``lora_request``) are then one for every state or a list with one per state; every
        read of the call runs together, the instructions' and question template's shared
        prefix pages computed once (prefix caching), with a progress bar (``use_tqdm``, on by
        default for a list). A state's answers are the bits it gets alone."""
        many = isinstance(state, list)
        states = list(state) if many else [state]
        if not states:
            raise ValueError("decide got an empty list of states")
        n = len(states)
        qsets = _per_state(questions, n, "questions", lambda x: isinstance(x, dict))
        loras = _per_state(lora_request, n, "lora_request",
                           lambda x: x is None or isinstance(x, LoRARequest))
        reads = self._plan_decisions(states, qsets, instructions)
        add = self.engine.add_request
        checked = iter(self.engine.check_requests(
            [(r.prompt_token_ids, _READ, lr, r.label_token_ids)
             for rs, lr in zip(reads, loras, strict=True) for r in rs]))
        seqs = [add(next(checked), _READ, lora=lr, label_token_ids=r.label_token_ids,
                    checked=True) for rs, lr in zip(reads, loras, strict=True) for r in rs]
        outs = self._run(seqs, use_tqdm=many if use_tqdm is None else use_tqdm,
                         desc="Decisions (reads)")
        if self._audit is not None:  # one line per state, as a call of its own would write
            self._audit_decide(states, reads, loras, seqs, outs, instructions)
        decisions, at = [], 0
        for k, rs in enumerate(reads):
            part = outs[at: at + len(rs)]
            at += len(rs)
            answers = {}
            for r, out in zip(rs, part, strict=True):
                if out.outputs[0].finish_reason == "error":  # non-finite logits, a bad adapter
                    where = f"states[{k}] " if many else ""
                    raise RuntimeError(f"{where}question {r.question.id!r} could not be read: "
                                       f"{out.outputs[0].error}")
                assert out.label_logprobs is not None
                answers[r.question.id] = answer(r, out.label_logprobs)
            decisions.append(Decision(
                answers=answers, prompt_tokens=sum(len(r.prompt_token_ids) for r in rs),
                cached_tokens=sum(o.num_cached_tokens for o in part),
                fingerprint=part[0].fingerprint))
        return decisions if many else decisions[0]

    def _plan_decisions(self, states: list, qsets: list[dict],
                        instructions: object) -> list[list[DecisionRead]]:
        """Every state's reads; states sharing one questions object are planned together
        (one template split and one tokenizer call for them all)."""
        groups: dict[int, list[int]] = {}
        for k, q in enumerate(qsets):
            groups.setdefault(id(q), []).append(k)
        reads: list[list[DecisionRead]] = [[] for _ in states]
        for ks in groups.values():
            planner = ReadPlanner.of(self.tokenizer, parse_questions(qsets[ks[0]]),
                                     instructions)
            sub = [states[k] for k in ks]
            try:
                planned = planner.plan(sub)
            except ValueError as e:
                if len(states) > 1 and len(ks) == 1:
                    raise ValueError(f"states[{ks[0]}]: {e}") from None
                raise
            for k, rs in zip(ks, planned, strict=True):
                reads[k] = rs
        return reads

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

    def _audit_decide(self, states: list, reads: list[list[DecisionRead]],
                      loras: list[LoRARequest | None], seqs: list, outs: list[RequestOutput],
                      instructions: object) -> None:
        assert self._audit is not None
        at = 0
        for state, rs, lr in zip(states, reads, loras, strict=True):
            mine = list(zip(rs, seqs[at: at + len(rs)], outs[at: at + len(rs)], strict=True))
            at += len(rs)
            entry = self._audit.entry(
                "decide", _new_id("decide"), lora=lr, adapter_hash=self._adapter_hash(lr),
                fingerprint_value=mine[0][2].fingerprint,
                prompts=[(r.prompt_token_ids, None) for r in rs], params=_READ,
                decision={"reads": rs, "state": state, "instructions": instructions})
            for q, (r, seq, out) in enumerate(mine):
                comp = out.outputs[0]
                entry.choice(q, q, r.label_token_ids).fill(
                    seq.sample_seed, comp.token_ids, comp.finish_reason, None,
                    label_logprobs=out.label_logprobs)
            entry.seal()

    def _run(self, seqs: list, use_tqdm: bool,
             desc: str = "Processed prompts") -> list[RequestOutput]:
        engine = self.engine
        bar = _Progress(seqs, enabled=use_tqdm, desc=desc)
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

    def __init__(self, seqs: list, *, enabled: bool, desc: str = "Processed prompts") -> None:
        import sys

        from tqdm import tqdm

        self.seqs = seqs
        self.bar = tqdm(total=len(seqs), desc=desc, unit="req",
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


# A decision's read: the first reply position's label logprobs, no text.
_READ = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                       output_kind=RequestOutputKind.FINAL_ONLY)


def _per_state(value: object, n: int, name: str, check: Any) -> list:
    """``value`` for every state, or a list with one per state."""
    return per_prompt(value, n, name, check, unit="state")


def _per_object(items: Sequence[Any], make: Any) -> list[Any]:
    """``[make(x) for x in items]``, calling ``make`` once per distinct object: thousands of
    prompts usually share one SamplingParams."""
    made: dict[int, Any] = {}
    out = []
    for x in items:
        y = made.get(id(x))
        if y is None:
            y = made[id(x)] = make(x)
        out.append(y)
    return out


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

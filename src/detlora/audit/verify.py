"""``detlora verify LOG...``: replay an audit log and check every answer bit for bit.

The engine is built from the log's engine line (its model and the arguments that decide bits:
dtype, level, LoRA reduction, logprobs mode, model length, adapter rank), or from what the
caller overrides; each adapter is loaded from the path the log names (or ``lora_modules``).
Every request of the log then runs as one engine request per choice or question, with the
seed the log recorded, all of them batched together as the engine likes: at
``batch_invariant`` a request's bits do not depend on its batch, so a month of traffic replays
at offline throughput. Per request the report says:

* ``identical``: every choice's token ids, finish reason, logprobs hash (and a decision's
  label logprobs and probabilities) equal the log's;
* ``differs``: the first choice and position that differ, with both sides;
* ``not_comparable``: the fingerprint field that differs (level, device, versions, source,
  dtype, kernels, settings, weights, adapter), or why the request cannot be replayed (a
  ``run_to_run`` or ``fast`` log: their bits hold for an equal batch only, and the log does
  not record batches; a hash-only log without ``inputs``).

The exit status is 0 only when every comparable request is identical, at least one was
compared, and no request names weights or an adapter whose content differs from the files
loaded (the evidence does not match the artifacts: such requests count as failures).
"""

from __future__ import annotations

import dataclasses
import json
import random
import struct
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from detlora.audit.format import (
    ids_sha256,
    logprobs_sha256,
    params_from_json,
    record_time,
    value_of,
)
from detlora.audit.reader import LogEntry, SkippedLine, read_log
from detlora.config import RequestOutputKind, SamplingParams
from detlora.decisions.reads import softmax
from detlora.engine.fingerprint import FIELDS, fingerprint, fingerprint_fields
from detlora.engine.frozen_heap import frozen_heap
from detlora.engine_args import EngineArgs
from detlora.lora.request import LoRARequest

IDENTICAL, DIFFERS, NOT_COMPARABLE = "identical", "differs", "not_comparable"
# Engine arguments that decide bits (or whether a request fits): taken from the log's engine
# line. The rest (batch shapes, memory, device) are this machine's: at batch_invariant they
# change no bit.
FROM_LOG = ("model", "tokenizer", "tokenizer_mode", "skip_tokenizer_init", "trust_remote_code",
            "revision", "tokenizer_revision", "download_dir", "dtype", "determinism",
            "lora_reduction", "logprobs_mode", "max_model_len", "enable_lora", "max_loras",
            "max_lora_rank")
# Fingerprint fields whose mismatch means the files loaded are not those that answered.
ARTIFACTS = ("weights", "adapter", "fingerprint", "prompt")
WINDOW = 6  # tokens shown from the first differing position


@dataclass
class Outcome:
    """One request's verdict."""

    id: str
    route: str
    time: str
    file: str
    line: int
    status: str = IDENTICAL
    field: str | None = None  # what differs, or why it cannot be compared
    detail: str = ""
    choice: int | None = None  # the output (choice or question) that differs first
    position: int | None = None  # its first differing token position
    logged: dict[str, Any] | None = None
    replayed: dict[str, Any] | None = None

    @property
    def fails(self) -> bool:
        """Counts against the exit status."""
        return self.status == DIFFERS or (self.status == NOT_COMPARABLE
                                          and self.field in ARTIFACTS)

    def as_json(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclass
class VerifyReport:
    outcomes: list[Outcome]
    skipped: list[SkippedLine]
    files: list[str]
    seconds: float = 0.0  # the replay's wall time (engine building excluded)
    engine_requests: int = 0  # choices and questions replayed

    def count(self, status: str) -> int:
        return sum(o.status == status for o in self.outcomes)

    @property
    def compared(self) -> int:
        return sum(o.status != NOT_COMPARABLE for o in self.outcomes)

    @property
    def exit_status(self) -> int:
        """0 when every comparable request is identical, at least one was compared and no
        artifact differs; else 1."""
        if any(o.fails for o in self.outcomes) or self.compared == 0:
            return 1
        return 0

    def summary(self) -> dict[str, Any]:
        reasons: dict[str, int] = {}
        for o in self.outcomes:
            if o.status == NOT_COMPARABLE:
                reasons[str(o.field)] = reasons.get(str(o.field), 0) + 1
        skipped: dict[str, int] = {}
        for s in self.skipped:
            skipped[s.reason] = skipped.get(s.reason, 0) + 1
        return {"requests": len(self.outcomes), "identical": self.count(IDENTICAL),
                "differing": self.count(DIFFERS), "not_comparable": self.count(NOT_COMPARABLE),
                "not_comparable_by_field": reasons, "skipped_lines": skipped,
                "files": len(self.files), "engine_requests": self.engine_requests,
                "seconds": round(self.seconds, 3),
                "per_s": round(self.compared / self.seconds, 2) if self.seconds else None,
                "exit_status": self.exit_status}

    def as_json(self) -> dict[str, Any]:
        return {"summary": self.summary(), "requests": [o.as_json() for o in self.outcomes],
                "skipped_lines": [{"file": str(s.path), "line": s.line, "reason": s.reason,
                                   "detail": s.detail} for s in self.skipped]}

    def render(self, limit: int = 20) -> str:
        """The summary table, then the first ``limit`` requests that differ or cannot be
        compared."""
        s = self.summary()
        lines = [f"detlora verify: {s['requests']:,} requests in {s['files']} file(s)"]
        for name, key in (("identical", "identical"), ("differs", "differing"),
                          ("not comparable", "not_comparable")):
            extra = ""
            if key == "not_comparable" and s["not_comparable_by_field"]:
                extra = "   (" + ", ".join(f"{k}: {v}" for k, v in
                                           sorted(s["not_comparable_by_field"].items())) + ")"
            lines.append(f"  {name:<16}{s[key]:>10,}{extra}")
        if self.skipped:
            lines.append(f"  {'lines skipped':<16}{len(self.skipped):>10,}   (" + ", ".join(
                f"{k}: {v}" for k, v in sorted(s["skipped_lines"].items())) + ")")
        for s_ in self.skipped[:limit]:
            lines.append(f"    {s_.path.name}:{s_.line}: {s_.reason} ({s_.detail})")
        for status, title in ((DIFFERS, "differs"), (NOT_COMPARABLE, "not comparable")):
            shown = [o for o in self.outcomes if o.status == status]
            if shown:
                lines.append(f"{title}:")
            for o in shown[:limit]:
                lines.append(f"  {o.id} ({o.route}, {o.time}, {Path(o.file).name}:{o.line}): "
                             f"{o.field}: {o.detail}")
            if len(shown) > limit:
                lines.append(f"  ... and {len(shown) - limit:,} more (see --json)")
        if self.seconds:
            lines.append(f"replayed {self.compared:,} requests ({self.engine_requests:,} engine "
                         f"requests) in {self.seconds:.2f} s: {s['per_s']:,} requests/s")
        verdict = ("OK: every comparable request is identical" if self.exit_status == 0 else
                   "FAILED: nothing could be compared" if self.compared == 0
                   and not any(o.fails for o in self.outcomes) else
                   "FAILED: some answers do not replay")
        lines.append(verdict)
        return "\n".join(lines)


@dataclass(frozen=True)
class VerifyOptions:
    """``model``: the model to load instead of the log's; ``engine``: engine arguments that
    override the log's; ``lora_modules``: adapter name -> directory, instead of the log's
    paths; ``inputs``: for a hash-only log, a JSONL file of {"id", "prompts": [[token ids],
    ...]}; ``sample``: check that many requests, drawn at random (``sample_seed``);
    ``since``/``until``: requests that finished in [since, until); ``batch_size``: engine
    requests in flight at once (None: all, the engine batches them)."""

    model: str | None = None
    engine: Mapping[str, Any] = field(default_factory=dict)
    lora_modules: Mapping[str, str] = field(default_factory=dict)
    inputs: str | None = None
    sample: int | None = None
    sample_seed: int = 0
    since: datetime | None = None
    until: datetime | None = None
    batch_size: int | None = None
    progress: bool | None = None  # None: when stderr is a terminal


def verify(paths: Sequence[str | Path], options: VerifyOptions = VerifyOptions(),
           *, llm_factory: Callable[..., Any] | None = None) -> VerifyReport:
    """Replay the logs at ``paths`` (files or directories) and compare (see the module doc).
    ``llm_factory(model, **engine_args)`` builds the engine (default: ``LLM``)."""
    log = read_log(paths)
    entries = _select(log.entries, options)
    report = VerifyReport([], log.skipped, [str(f) for f in log.files])
    inputs = _read_inputs(options.inputs) if options.inputs else None
    groups: dict[str, list[tuple[LogEntry, Outcome]]] = {}
    for entry in entries:
        r = entry.record
        outcome = Outcome(str(r.get("id")), str(r.get("route")), str(r.get("time")),
                          str(entry.path), entry.line)
        report.outcomes.append(outcome)
        engine = entry.engine if entry.engine is not None else log.engines.get(
            str(r.get("engine")))
        if engine is None:
            _not_comparable(outcome, "engine", "the log has no engine line for this request")
            continue
        groups.setdefault(str(engine.get("id")), []).append((entry, outcome))
    for engine_id, members in groups.items():
        engine_line = members[0][0].engine or log.engines[engine_id]
        _verify_group(engine_line, members, options, inputs, report, llm_factory)
    return report


def _select(entries: list[LogEntry], options: VerifyOptions) -> list[LogEntry]:
    out = []
    for e in entries:
        if options.since is not None or options.until is not None:
            try:
                when = record_time(e.record)
            except (KeyError, ValueError, TypeError):
                continue
            if options.since is not None and when < options.since:
                continue
            if options.until is not None and when >= options.until:
                continue
        out.append(e)
    if options.sample is not None and options.sample < len(out):
        keep = sorted(random.Random(options.sample_seed).sample(range(len(out)),
                                                                options.sample))
        out = [out[k] for k in keep]
    return out


def _read_inputs(path: str) -> dict[str, list[list[int]]]:
    """--inputs: {"id": ..., "prompts": [[token ids], ...]} per line (ValueError naming the
    line that is not)."""
    source = Path(path)
    if not source.is_file():
        raise ValueError(f"--inputs file {path} does not exist")
    known: dict[str, list[list[int]]] = {}
    for n, line in enumerate(source.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not valid JSON ({e})") from None
        prompts = row.get("prompts") if isinstance(row, dict) else None
        if not isinstance(row, dict) or not isinstance(row.get("id"), str) \
                or not isinstance(prompts, list) or not all(
                    isinstance(p, list) and all(isinstance(t, int) for t in p)
                    for p in prompts):
            raise ValueError(f'{path}:{n}: each line must be {{"id": ..., "prompts": '
                             '[[token ids], ...]}')
        known[row["id"]] = prompts
    return known


def _not_comparable(o: Outcome, what: str, detail: str) -> None:
    o.status, o.field, o.detail = NOT_COMPARABLE, what, detail


_LEVELS = {
    "run_to_run": "the log was written at run_to_run, whose bits are equal for an equal batch "
                  "only: it is replayable batch for batch, and an audit log does not record "
                  "batches (serve at batch_invariant to verify)",
    "fast": "the log was written at fast, which promises no equal bits",
}


def engine_args_for(engine_line: Mapping[str, Any], options: VerifyOptions) -> dict[str, Any]:
    """The engine arguments a replay of this engine's requests runs with."""
    logged = engine_line.get("engine_args") or {}
    args = {k: logged[k] for k in FROM_LOG if k in logged}
    if options.model is not None:
        args["model"] = options.model
    args.update(options.engine)
    return args


def _verify_group(engine_line: Mapping[str, Any], members: list[tuple[LogEntry, Outcome]],
                  options: VerifyOptions, inputs: dict[str, list[list[int]]] | None,
                  report: VerifyReport, llm_factory: Callable[..., Any] | None) -> None:
    level = (engine_line.get("fingerprint_fields") or {}).get("level")
    todo = []
    for entry, outcome in members:
        logged_level = entry.record.get("fingerprint", {}).get("fields", {}).get("level", level)
        if logged_level != "batch_invariant":
            _not_comparable(outcome, "level", _LEVELS.get(
                logged_level, f"the log's level is {logged_level!r}"))
        elif engine_line.get("hash_only") and (inputs is None or outcome.id not in inputs):
            _not_comparable(outcome, "hash_only", "a hash-only log keeps no token ids: give "
                            "the request's prompts with --inputs" if inputs is None else
                            "--inputs has no line for this request")
        else:
            todo.append((entry, outcome))
    if not todo:
        return
    args = engine_args_for(engine_line, options)
    adapters = {(r["adapter"]["name"], r["adapter"]["path"]) for r in
                (e.record for e, _ in todo) if r.get("adapter")}
    if adapters and "max_loras" not in options.engine:
        args["max_loras"] = max(int(args.get("max_loras") or 1), min(8, len(adapters)))
    if adapters:
        args["enable_lora"] = True
    try:
        if llm_factory is None:
            from detlora.entrypoints.llm import LLM

            llm_factory = LLM
        model = args.pop("model")
        llm = llm_factory(model, **args)
    except Exception as e:  # a model that is not there, arguments this detlora refuses
        for _, outcome in todo:
            _not_comparable(outcome, "model", f"the engine could not be built: "
                            f"{type(e).__name__}: {e}")
        return
    try:
        _replay_group(llm, todo, options, inputs, report)
    finally:
        shutdown = getattr(llm, "shutdown", None)
        if shutdown is not None:
            shutdown()


@dataclass
class _Job:
    outcome: Outcome
    index: int  # the output's place in the record's outputs
    logged: dict[str, Any]
    prompt_ids: list[int]
    params: SamplingParams
    lora: LoRARequest | None
    label_token_ids: list[int] | None


@dataclass
class _Pending:
    left: int
    done: Callable[[], None]


def _replay_group(llm: Any, todo: list[tuple[LogEntry, Outcome]], options: VerifyOptions,
                  inputs: dict[str, list[list[int]]] | None, report: VerifyReport) -> None:
    engine = llm.engine
    parts = engine.fingerprint_parts
    loaded: dict[tuple[str, str], tuple[LoRARequest | None, str | None, str | None]] = {}
    jobs: list[_Job] = []
    for entry, outcome in todo:
        rec = entry.record
        adapter = rec.get("adapter")
        lora, digest = None, None
        if adapter:
            key = (adapter["name"], adapter["path"])
            if key not in loaded:
                loaded[key] = _load_adapter(llm, key, len(loaded) + 1, options)
            lora, digest, error = loaded[key]
            if error is not None:
                _not_comparable(outcome, "adapter", error)
                continue
        fields = fingerprint_fields(parts, digest)
        if not _fingerprint_matches(outcome, rec, fields, fingerprint(parts, digest)):
            continue
        try:
            jobs += _jobs_of(rec, outcome, lora, inputs)
        except (KeyError, TypeError, ValueError) as e:
            _not_comparable(outcome, "record", f"the request line cannot be read: "
                            f"{type(e).__name__}: {e}")
    _run_jobs(engine, jobs, options, report)


def _load_adapter(llm: Any, key: tuple[str, str], lora_id: int, options: VerifyOptions
                  ) -> tuple[LoRARequest | None, str | None, str | None]:
    """(request, content hash, error) of a logged adapter, from its path or the override."""
    name, path = key
    path = options.lora_modules.get(name, path)
    try:
        # Names are for people: one per id, as the registry wants, whatever the log reused.
        request = LoRARequest(f"{name}#{lora_id}", lora_id, path)
        llm.add_lora(request)
        return request, llm.engine.adapter_hash(request), None
    except Exception as e:  # missing, unreadable, refused by its checks
        return None, None, f"the adapter at {path} could not be loaded: {type(e).__name__}: {e}"


def _fingerprint_matches(o: Outcome, rec: Mapping[str, Any], here: Mapping[str, str],
                         value: str) -> bool:
    fp = rec.get("fingerprint") or {}
    logged = fp.get("fields") or {}
    differ = [f for f in FIELDS if logged.get(f) != here.get(f)]
    if differ:
        what = differ[0]
        if what == "adapter":
            detail = (f"adapter content differs: logged sha256 {logged.get('adapter')}, the "
                      f"file loaded has {here.get('adapter')}")
        else:
            detail = "; ".join(f"{f}: logged {logged.get(f)!r}, here {here.get(f)!r}"
                               for f in differ)
        _not_comparable(o, what, detail)
        return False
    if fp.get("value") != value:
        _not_comparable(o, "fingerprint", f"the fingerprint fields match but the value does "
                        f"not (logged {fp.get('value')}, here {value}): the line was altered")
        return False
    return True


def _jobs_of(rec: Mapping[str, Any], outcome: Outcome, lora: LoRARequest | None,
             inputs: dict[str, list[list[int]]] | None) -> list[_Job]:
    request = rec["request"]
    params = params_from_json(request["sampling_params"])
    prompts = request["prompts"]
    given = inputs.get(outcome.id) if inputs is not None else None
    ids_of: list[list[int]] = []
    for p, prompt in enumerate(prompts):
        if "token_ids" in prompt:
            ids_of.append(list(prompt["token_ids"]))
            continue
        if given is None or p >= len(given):
            raise ValueError(f"prompt {p} is logged as a hash only and --inputs does not give it")
        if ids_sha256(given[p]) != prompt["token_ids_sha256"]:
            _not_comparable(outcome, "prompt", f"--inputs' prompt {p} does not hash to the "
                            "logged prompt's sha256")
            return []
        ids_of.append(list(given[p]))
    questions = request.get("questions")
    jobs = []
    n = params.n
    for k, out in enumerate(rec["outputs"]):
        p = int(out["prompt"])
        labels = None
        if questions is not None:
            labels = list(questions[int(out["index"])]["label_token_ids"])
        scores = out.get("scores_prompt", int(out["index"]) - p * n == 0)
        jp = dataclasses.replace(
            params, n=1, seed=int(out["seed"]), output_kind=RequestOutputKind.FINAL_ONLY,
            prompt_logprobs=params.prompt_logprobs if scores else None)
        jobs.append(_Job(outcome, k, out, ids_of[p], jp, lora, labels))
    return jobs


def _run_jobs(engine: Any, jobs: list[_Job], options: VerifyOptions,
              report: VerifyReport) -> None:
    """Every job through the engine, ``options.batch_size`` at a time (all by default), each
    compared with its log line when it finishes."""
    from tqdm import tqdm

    per_outcome: dict[int, int] = {}
    for job in jobs:
        per_outcome[id(job.outcome)] = per_outcome.get(id(job.outcome), 0) + 1
    show = options.progress if options.progress is not None else sys.stderr.isatty()
    bar = tqdm(total=len(per_outcome), desc="Verified", unit="req", disable=not show,
               dynamic_ncols=True, mininterval=0.2)
    limit = options.batch_size or len(jobs) or 1
    inflight: dict[str, _Job] = {}
    at = 0
    started = time.perf_counter()

    def finish_job(job: _Job) -> None:
        key = id(job.outcome)
        per_outcome[key] -= 1
        if per_outcome[key] == 0:
            bar.update(1)

    try:
        with frozen_heap():
            while True:
                while len(inflight) < limit and at < len(jobs):
                    job = jobs[at]
                    at += 1
                    if job.outcome.status != IDENTICAL:  # another choice already differs
                        finish_job(job)
                        continue
                    try:
                        seq = engine.add_request(job.prompt_ids, job.params, lora=job.lora,
                                                 label_token_ids=job.label_token_ids,
                                                 request_id=f"verify-{at}")
                    except (ValueError, FileNotFoundError) as e:
                        _not_comparable(job.outcome, "request", f"this engine refuses the "
                                        f"request: {e}")
                        finish_job(job)
                        continue
                    inflight[seq.request_id] = job
                if not inflight:
                    break
                for out in engine.step():
                    if out.finished:
                        job = inflight.pop(out.request_id)
                        report.engine_requests += 1
                        if job.outcome.status == IDENTICAL:
                            _compare(job, out)
                        finish_job(job)
    except BaseException:
        engine.abort_all()
        raise
    finally:
        bar.close()
    report.seconds += time.perf_counter() - started


def _bits(values: Sequence[float]) -> bytes:
    return struct.pack(f"<{len(values)}d", *values)


def _first_difference(a: Sequence[Any], b: Sequence[Any]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def _first_bits_difference(a: Sequence[float], b: Sequence[float]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if _bits([x]) != _bits([y]):
            return i
    return min(len(a), len(b))


def _differs(job: _Job, what: str, detail: str, position: int | None = None,
             logged: dict[str, Any] | None = None, replayed: dict[str, Any] | None = None
             ) -> None:
    o = job.outcome
    o.status, o.field, o.detail = DIFFERS, what, detail
    o.choice, o.position, o.logged, o.replayed = job.index, position, logged, replayed


def _compare(job: _Job, out: Any) -> None:
    """Set ``job.outcome`` to differs at the first thing that does not match the log."""
    c = job.logged
    comp = out.outputs[0]
    abort = c.get("finish_reason") == "abort"
    k = int(c.get("num_tokens", 0))
    ids = list(comp.token_ids)
    lps = list(comp.logprobs or [])
    if abort:  # the log holds what came before the abort: compare that prefix
        ids, lps = ids[:k], lps[:k]
    first = k > 0 if abort else True
    chosen = [value_of(e[t]) for e, t in zip(lps, ids, strict=False)]
    where = f"choice {job.index}"
    if "token_ids" in c:
        logged_ids = list(c["token_ids"])
        if logged_ids != ids:
            pos = _first_difference(logged_ids, ids)
            lg = c.get("logprobs")
            _differs(job, "tokens", _position_text(where, pos, logged_ids, lg, ids, chosen), pos,
                     _window(logged_ids, lg, pos), _window(ids, chosen if lg else None, pos))
            return
    elif ids_sha256(ids) != c.get("token_ids_sha256"):
        _differs(job, "tokens", f"{where}: the replayed token ids do not hash to the logged "
                 "token_ids_sha256", None, None, {"token_ids": ids})
        return
    if not abort and comp.finish_reason != c.get("finish_reason"):
        _differs(job, "finish_reason", f"{where}: logged {c.get('finish_reason')!r}, replayed "
                 f"{comp.finish_reason!r}", len(ids))
        return
    if "logprobs" in c:
        logged_lps = [float(x) for x in c["logprobs"]]
        if _bits(logged_lps) != _bits(chosen):
            pos = _first_bits_difference(logged_lps, chosen)
            _differs(job, "logprobs", _position_text(where, pos, ids, logged_lps, ids, chosen),
                     pos, _window(ids, logged_lps, pos), _window(ids, chosen, pos))
            return
    labels = job.label_token_ids
    label_lps = out.label_logprobs if first else None
    if labels is not None and "label_logprobs" in c and label_lps is not None:
        mine = [label_lps[t] for t in labels]
        theirs = [float(x) for x in c["label_logprobs"]]
        probs = softmax(mine) if max(mine) > float("-inf") else None
        if _bits(theirs) != _bits(mine) or (c.get("probabilities") is not None and probs
                                            is not None and _bits(c["probabilities"])
                                            != _bits(probs)):
            _differs(job, "probabilities", f"{where}: label logprobs logged {theirs}, "
                     f"replayed {mine}; probabilities logged {c.get('probabilities')}, "
                     f"replayed {probs}", None,
                     {"label_logprobs": theirs, "probabilities": c.get("probabilities")},
                     {"label_logprobs": mine, "probabilities": probs})
            return
    digest = logprobs_sha256(lps, out.prompt_logprobs if first else None, labels, label_lps)
    if digest != c.get("logprobs_sha256"):
        _differs(job, "logprobs", f"{where}: logprobs_sha256 differs (logged "
                 f"{c.get('logprobs_sha256')}, replayed {digest})"
                 + ("; the chosen tokens' logprobs are equal, so a top-k, prompt or label "
                    "logprob differs" if "logprobs" in c else ""), None,
                 {"logprobs_sha256": c.get("logprobs_sha256")}, {"logprobs_sha256": digest})


def _window(ids: Sequence[int], lps: Sequence[float] | None, pos: int) -> dict[str, Any]:
    out: dict[str, Any] = {"token_ids": list(ids[pos: pos + WINDOW])}
    if lps is not None:
        out["logprobs"] = [float(x) for x in lps[pos: pos + WINDOW]]
    return out


def _position_text(where: str, pos: int, a_ids: Sequence[int], a_lps: Sequence[float] | None,
                   b_ids: Sequence[int], b_lps: Sequence[float] | None) -> str:
    def side(ids: Sequence[int], lps: Sequence[float] | None) -> str:
        if pos >= len(ids):
            return f"ended after {len(ids)} tokens"
        lp = f" (logprob {lps[pos]!r})" if lps is not None and pos < len(lps) else ""
        return f"token {ids[pos]}{lp}"

    return f"{where}, position {pos}: logged {side(a_ids, a_lps)}, replayed {side(b_ids, b_lps)}"


def engine_overrides(values: Mapping[str, Any]) -> dict[str, Any]:
    """The engine options among ``values`` that differ from ``EngineArgs``' defaults (what a
    command line set)."""
    out = {}
    for f in dataclasses.fields(EngineArgs):
        if f.name == "model" or f.name not in values:
            continue
        default = f.default if f.default is not dataclasses.MISSING else None
        value = values[f.name]
        shown_default = getattr(default, "value", default)
        if value != shown_default and value != default:
            out[f.name] = value
    return out


def write_json(report: VerifyReport, path: str) -> None:
    text = json.dumps(report.as_json(), indent=1)
    if path == "-":
        print(text)
    else:
        Path(path).write_text(text + "\n")


__all__ = ["DIFFERS", "IDENTICAL", "NOT_COMPARABLE", "Outcome", "VerifyOptions", "VerifyReport",
           "engine_args_for", "engine_overrides", "verify", "write_json"]

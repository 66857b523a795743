"""``detlora study``: the paper's study on a model and adapter, as one call.

    run_study(["path/to/model"], out="study-out", quick=True)

writes ``study.json``, ``study.md`` and PNG figures into ``out``. ``study.json``:

    {"meta": {..., "model": [labels], "adapter": {label: description},
              "fingerprint": {label: {"level/reduction": fingerprint}}},
     "replay": [{"model", "reduction", "comparisons", "differing", "shape", "M", ...}],
     "repeat": [{"model", "level", "reduction", "task", "comparisons", "changed",
                 "answers_changed", "bits_changed", "correctness_flips", ...}],
     "cross_batch": [{"model", "level", "check", "comparisons", "changed", "bits_changed"}],
     "decisions": [{"model", "level", "reduction", "comparisons", "changed", "mean_abs_drift",
                    "max_abs_drift", "flips", "check", "accuracy", ...}],
     "trace": {...}, "performance": [{"model", "level", "reduction", "batch", "tpot_ms",
                                      "output_tok_per_s", ...}]}

Per model: the replay (kernel level), then one engine per configuration (repeat, decisions,
performance, and for each level's default configuration the cross-batch checks that run in
it), the cross-batch variant engines per level, and the trace. A section that fails is
recorded in ``meta.errors`` and the study goes on. Runs of separate models or sections merge
into one study with ``detlora study --merge`` (``detlora.study.merge``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

import detlora
from detlora import SamplingParams
from detlora.engine.tokenizer import Tokenizer, has_tokenizer
from detlora.models.spec import ModelSpec
from detlora.study import cross_batch, decisions, performance, repeat, shrink_replay, trace
from detlora.study.comments import study_comments
from detlora.study.default_adapter import adapter_rank, write_default_adapter
from detlora.study.engines import StudyModel, build_llm, release
from detlora.study.plan import (
    LEVEL_DEFAULTS,
    SECTIONS,
    EngineSetup,
    StudyPlan,
    is_level_default,
    study_setups,
)
from detlora.study.sandbox import isolation
from detlora.study.tasks import Task, load_prompts_file, study_tasks

TINY = "tiny"  # the random tiny model of ``detlora demo``: CI and first tries


@dataclasses.dataclass
class StudyResult:
    meta: dict
    replay: list = dataclasses.field(default_factory=list)
    repeat: list = dataclasses.field(default_factory=list)
    cross_batch: list = dataclasses.field(default_factory=list)
    decisions: list = dataclasses.field(default_factory=list)
    trace: dict = dataclasses.field(default_factory=dict)
    performance: list = dataclasses.field(default_factory=list)

    def as_json(self) -> dict:
        return {"meta": self.meta, "replay": self.replay, "repeat": self.repeat,
                "cross_batch": self.cross_batch, "decisions": self.decisions,
                "trace": self.trace, "performance": self.performance}


# ----------------------------------------------------------------------------- models


EMBEDDED = "smollm2"  # the embedded real model, SmolLM2-135M-Instruct (the default MODEL)


def resolve_model(name: str | None, work: Path, device: torch.device | None = None
                  ) -> tuple[str, str, str | None]:
    """(model directory, label, tokenizer directory or None) for a MODEL argument: None or
    'smollm2' (the embedded model), 'tiny', a model directory, a Hub id or a .gguf file."""
    from detlora.models.embedded import NAME, smollm2_model_dir
    from detlora.models.sources import resolve_model as local_dir

    name = name or EMBEDDED
    dtype = torch.bfloat16 if device is not None and device.type == "cuda" else torch.float32
    if name == TINY:
        from detlora.entrypoints.demo import build_demo_assets

        model_dir, _ = build_demo_assets(work / "tiny")
        return str(model_dir), "tiny-demo (random weights)", None
    if name == EMBEDDED:
        return str(smollm2_model_dir(dtype)), NAME, None
    path = local_dir(name, dtype=dtype)
    label = Path(name).name if Path(name).expanduser().exists() else name
    return str(path), label or str(path), None


def prepare_model(name: str | None, adapters: Sequence[str], work: Path, *,
                  tokenizer: str | None, seed: int, default_rank: int = 16,
                  device: torch.device | None = None) -> StudyModel:
    path, label, tok = resolve_model(name, work, device)
    if tok is None and not has_tokenizer(path) and tokenizer is not None:
        # A model directory without a tokenizer of its own borrows one (a directory, or a
        # MODEL name such as smollm2).
        tok = (tokenizer if Path(tokenizer).is_dir()
               else resolve_model(tokenizer, work, device)[0])
    spec = ModelSpec.from_dir(path)
    if adapters:
        for a in adapters:
            if not Path(a).is_dir():
                raise FileNotFoundError(f"adapter directory {a} does not exist")
        dirs = tuple(str(a) for a in adapters)
        desc = ", ".join(Path(a).name for a in adapters)
    else:
        slug = "".join(c if c.isalnum() else "-" for c in label)[:40]
        out = write_default_adapter(path, work / "adapters" / slug, rank=default_rank,
                                    seed=seed)
        dirs = (str(out),)
        where = ("all seven projections" if spec.hybrid is None else
                 "q/k/v/o, up/down and the Mamba in_proj")
        desc = (f"default: rank {default_rank}, alpha {2 * default_rank}, {where}, seeded "
                f"random A and B (seed {seed})")
    rank = max(adapter_rank(d) for d in dirs)
    return StudyModel(path=path, label=label, adapters=dirs, adapter_label=desc,
                      max_rank=rank, tokenizer=tok, max_model_len=spec.max_position_embeddings)


def _tokenizer_of(model: StudyModel) -> Tokenizer:
    where = model.tokenizer or model.path
    if not has_tokenizer(where):
        raise ValueError(f"the study writes its prompts as text, and {where} has no tokenizer: "
                         "pass --tokenizer DIR")
    return Tokenizer(where)


def encode(tokenizer: Tokenizer, text: str) -> list[int]:
    """A user message through the chat template when there is one, else plain text."""
    if getattr(tokenizer.hf, "chat_template", None):
        return tokenizer.encode_chat([{"role": "user", "content": text}])
    return tokenizer.encode(text)


# ----------------------------------------------------------------------------- the study


class _Progress:
    def __init__(self, enabled: bool) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(total=0, desc="study", unit="step", disable=not enabled,
                        dynamic_ncols=True)

    def add(self, n: int) -> None:
        self.bar.total += n
        self.bar.refresh()

    def tick(self) -> None:
        self.bar.update(1)

    def describe(self, text: str) -> None:
        self.bar.set_description_str(text[:60])

    def write(self, text: str) -> None:
        self.bar.write(text)

    def close(self) -> None:
        self.bar.close()


def _meta(argv: Sequence[str] | None, quick: bool, plan: StudyPlan, sections: Sequence[str],
          device: torch.device) -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:  # pragma: no cover - triton is a dependency on Linux
        triton_version = None
    commit = os.environ.get("DETLORA_COMMIT")  # a checkout copied without .git
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        commit = commit or subprocess.run(
            ["git", "-C", str(Path(detlora.__file__).parent), "rev-parse", "HEAD"],
            capture_output=True, text=True, timeout=10, check=True).stdout.strip() or None
    driver = None
    if device.type == "cuda":
        with contextlib.suppress(OSError, subprocess.SubprocessError, IndexError):
            driver = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=30, check=True,
            ).stdout.strip().splitlines()[0]
    return {
        "study": "detlora study",
        "command": " ".join(["detlora", "study", *(argv or [])]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": "cuda" if device.type == "cuda" else "cpu",
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "driver": driver,
        "cuda": torch.version.cuda if device.type == "cuda" else None,
        "torch": torch.__version__, "triton": triton_version, "detlora": detlora.__version__,
        "commit": commit, "quick": quick,
        "plan": json.loads(json.dumps(dataclasses.asdict(plan))),  # as study.json holds it
        "sections": list(sections), "model": [], "adapter": {}, "fingerprint": {},
        "models": [], "tasks": None, "sandbox": isolation(), "timing": {}, "errors": [],
        "notes": [],
    }


def run_study(
    models: Sequence[str | None], *, out: str | Path, adapters: Sequence[str] = (),
    quick: bool = False, prompts_file: str | None = None, sections: Sequence[str] = SECTIONS,
    reductions: Sequence[str] | None = None, device: str = "auto", tokenizer: str | None = None,
    plan: StudyPlan | None = None, progress: bool | None = None, argv: Sequence[str] | None = None,
    log: Callable[[str], None] | None = None, engine: Mapping[str, Any] | None = None,
) -> StudyResult:
    """Run the study on every model; write study.json, study.md and figures into ``out``.
    ``progress=None`` shows a progress bar when stderr is a terminal; ``engine``: further
    ``LLM`` arguments for every engine (dtype, gpu_memory_utilization, ...)."""
    from detlora.study.report import write_report

    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        raise ValueError(f"unknown sections {unknown} (known: {list(SECTIONS)})")
    if adapters and len(models) > 1:
        raise ValueError("--adapter goes with one MODEL: the adapter must fit the model")
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available()
                       else "cpu" if device == "auto" else device)
    plan = plan or (StudyPlan.quick() if quick else StudyPlan.full())
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    result = StudyResult(_meta(argv, quick, plan, sections, dev))
    meta = result.meta
    user_tasks = load_prompts_file(prompts_file) if prompts_file else None
    meta["tasks"] = (f"from {Path(prompts_file).name} ({len(user_tasks)} prompts)"
                     if user_tasks else "generated by the study, seeded (arithmetic word "
                     "problems and Python functions); no dataset is downloaded")
    bar = _Progress(sys.stderr.isatty() if progress is None else progress)
    say = log or bar.write
    started = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="detlora-study-") as tmp:
            for name in models:
                model = prepare_model(name, adapters, Path(tmp), tokenizer=tokenizer,
                                      seed=plan.seed, device=dev)
                _ModelStudy(result, model, plan, sections, dev, user_tasks, bar, say,
                            dict(engine or {})).run(
                    study_setups(tuple(reductions) if reductions else None))
                _write_json(out, result)
    finally:
        bar.close()
    meta["seconds"] = round(time.perf_counter() - started, 1)
    if dev.type == "cpu":
        meta["notes"].append(
            "CPU run: atomic has no real atomics here (the Triton interpreter runs one CTA "
            "after another, and the engine's CPU path is torch code), so every reduction "
            "repeats at a fixed batch and no divergence can be traced: the GPU is where atomic "
            "diverges. Below batch_invariant the CPU's whole-batch BLAS calls still move bits "
            "with the batch (sections 3 and 4). Performance is measured on a GPU only.")
    _write_json(out, result)
    write_report(result, out)
    return result


def load_study(where: str | Path) -> StudyResult:
    """The study a study.json holds: ``where`` is the file, or a directory holding it."""
    path = Path(where)
    if path.is_dir():
        path = path / "study.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from None
    fields = [f.name for f in dataclasses.fields(StudyResult)]
    if not isinstance(data, dict) or set(data) != set(fields):
        raise ValueError(f"{path} is not a study result (keys {fields})")
    return StudyResult(**data)


def render_study(out: str | Path) -> StudyResult:
    """Write study.md and the figures again from ``out``/study.json (say, on a machine with
    matplotlib, after a GPU run on one without)."""
    from detlora.study.report import write_report

    result = load_study(Path(out) / "study.json")
    write_report(result, Path(out))
    return result


def _write_json(out: Path, result: StudyResult) -> None:
    (out / "study.json").write_text(json.dumps(result.as_json(), indent=1) + "\n")


def _section(result: StudyResult, name: str, model: str, say: Callable[[str], None],
             fn: Callable[[], None]) -> None:
    """Run one section of one model; time it; record a failure and go on."""
    t0 = time.perf_counter()
    try:
        fn()
    except Exception as e:
        result.meta["errors"].append({"model": model, "section": name,
                                      "error": f"{type(e).__name__}: {e}"})
        say(f"study: {name} failed on {model}: {type(e).__name__}: {e}")
        traceback.print_exc(file=sys.stderr)
    timing = result.meta["timing"].setdefault(model, {})
    timing[name] = round(timing.get(name, 0.0) + time.perf_counter() - t0, 2)


class _ModelStudy:
    """The study of one model: its prompts, adapters and the sections' shared state."""

    def __init__(self, result: StudyResult, model: StudyModel, plan: StudyPlan,
                 sections: Sequence[str], dev: torch.device, user_tasks: list[Task] | None,
                 bar: _Progress, say: Callable[[str], None], engine: dict[str, Any]) -> None:
        self.result, self.plan, self.sections, self.bar, self.say = (
            result, plan, sections, bar, say)
        self.engine = engine
        self.meta = result.meta
        self.label = model.label
        self.spec = ModelSpec.from_dir(model.path)
        self.tok = _tokenizer_of(model)
        n = max(plan.prompts, plan.cross_prompts)
        tasks = user_tasks or study_tasks(n, plan.seed)
        self.tasks = [tasks[i % len(tasks)] for i in range(n)]  # a user's file is cycled
        self.prompts = [encode(self.tok, t.prompt) for t in self.tasks]
        self.comments = study_comments(plan.comments, plan.seed)
        self.reads = (decisions.decision_reads(self.tok, self.comments)
                      if "decisions" in sections else [])
        longest = max(len(p) for p in self.prompts + [r.prompt_token_ids for r in self.reads])
        gen_len = max(plan.max_tokens, plan.cross_tokens, plan.perf_tokens)
        if longest + gen_len > self.spec.max_position_embeddings:
            raise ValueError(f"{self.label}: prompts of up to {longest} tokens plus {gen_len} "
                             "generated exceed max_position_embeddings="
                             f"{self.spec.max_position_embeddings}")
        self.model = dataclasses.replace(model, max_model_len=longest + gen_len + 1)
        self.loras = [self.model.lora_for(k) for k in range(n)]
        self.comment_loras = [self.model.lora_for(k) for k in range(len(self.comments))]
        self.on_gpu = dev.type == "cuda"
        self.dev = dev
        self.device = "cuda" if self.on_gpu else "cpu"
        # Greedy, with each chosen token's logprob (the bits compared beside the tokens).
        self.gen = SamplingParams(max_tokens=plan.max_tokens, logprobs=0, temperature=0.0)
        self.cross_params = SamplingParams(max_tokens=plan.cross_tokens, logprobs=0,
                                           temperature=0.0)
        self.grades: dict = {}  # (task, text) -> Outcome, shared by every configuration
        self.alone: dict[str, list] = {}  # level -> the cross-batch prompts run alone
        self.atomic_runs: list = []  # the repeat section's atomic runs, for the trace
        info = {"label": self.label, "architecture": self.spec.architecture,
                "hidden": self.spec.hidden_size, "layers": self.spec.num_layers,
                "vocab": self.spec.vocab_size, "adapters": len(model.adapters),
                "max_rank": model.max_rank, "max_model_len": self.model.max_model_len,
                "longest_prompt": longest,
                "chat_template": bool(getattr(self.tok.hf, "chat_template", None))}
        self.meta["model"].append(self.label)
        self.meta["adapter"][self.label] = model.adapter_label
        self.meta["fingerprint"][self.label] = {}
        self.meta["models"].append(info)

    def build(self, setup: EngineSetup, variant: str = "main") -> Any:
        return build_llm(self.model, setup, self.plan, variant=variant, device=self.device,
                         engine=self.engine)

    def section(self, name: str, fn: Callable[[], None]) -> None:
        _section(self.result, name, self.label, self.say, fn)

    def run(self, setups: list[EngineSetup]) -> None:
        if "replay" in self.sections:
            self.replay()
        for setup in setups:
            self.engine_sections(setup)
        if "performance" in self.sections:
            if self.on_gpu:
                performance.add_ratios(self.result.performance)
            elif (note := "performance skipped: it is measured on a GPU") not in self.meta[
                    "notes"]:
                self.meta["notes"].append(note)
        if "cross_batch" in self.sections:
            for level in [lv for lv in LEVEL_DEFAULTS if lv in self.alone]:
                for variant in ("chunked", "preempt", "cache"):
                    self.section("cross_batch", lambda lv=level, v=variant: self.variant(lv, v))
        if "trace" in self.sections:
            self.bar.add(self.plan.trace_runs + 1)
            self.bar.describe(f"{self.label}: trace")
            self.section("trace", self.trace)

    def replay(self) -> None:
        plan = self.plan
        if not shrink_replay.replay_available(self.dev):
            self.meta["notes"].append("replay skipped: the kernels need a GPU or "
                                      "TRITON_INTERPRET=1")
            return
        self.bar.add(2 * len(plan.replay_rows) * (len(shrink_replay.SHRINK_REDUCTIONS) + 1))
        self.bar.describe(f"{self.label}: replay")
        self.section("replay", lambda: self.result.replay.extend(
            shrink_replay.shrink_replay_rows(self.label, self.spec, self.model.max_rank,
                                             plan.replay_rows, plan.replay_executions,
                                             self.dev, plan.seed, tick=self.bar.tick)))

    def engine_sections(self, setup: EngineSetup) -> None:
        """Every section that runs in the configuration's main engine."""
        plan, sections = self.plan, self.sections
        self.bar.add(1 + ("repeat" in sections) * plan.repetitions
                     + ("decisions" in sections) * (plan.repetitions + 1)
                     + ("performance" in sections and self.on_gpu) * len(plan.perf_batches)
                     + ("cross_batch" in sections and is_level_default(setup))
                     * (len(plan.cross_batches) + 2))
        self.bar.describe(f"{self.label}: {setup.name}")
        llm = self.build(setup)
        self.bar.tick()
        try:
            if "repeat" in sections:
                self.section("repeat", lambda: self.repeat(llm, setup))
            if "decisions" in sections:
                self.section("decisions", lambda: self.decide(llm, setup))
            if "cross_batch" in sections and is_level_default(setup):
                self.section("cross_batch", lambda: self.cross_main(llm, setup))
            if "performance" in sections and self.on_gpu:
                self.section("performance", lambda: self.performance(llm, setup))
            self.meta["fingerprint"][self.label][setup.name] = _fingerprint(
                llm, self.prompts[0], self.loras[0])
        finally:
            llm = None  # the sections' closures hold the name, not the engine
            release()

    def repeat(self, llm: Any, setup: EngineSetup) -> None:
        n = self.plan.prompts
        runs = []
        for _ in range(self.plan.repetitions):
            runs += repeat.repeat_runs(llm, self.prompts[:n], self.loras[:n], self.gen, 1)
            self.bar.tick()
        tasks = self.tasks[:n]
        outcomes = repeat.grade_runs(tasks, runs, workers=self.plan.grade_workers,
                                     cache=self.grades)
        self.result.repeat.extend(repeat.repeat_rows(self.label, setup.level, setup.reduction,
                                                     tasks, runs, outcomes))
        if setup.reduction == "atomic":
            self.atomic_runs = runs

    def decide(self, llm: Any, setup: EngineSetup) -> None:
        ps, ls = self.reads, self.comment_loras
        truth = [c.toxic for c in self.comments]
        runs = []
        for _ in range(self.plan.repetitions):
            llm.reset_prefix_cache()
            runs.append(decisions.read_probabilities(llm, ps, ls))
            self.bar.tick()
        rows = [decisions.decision_row(self.label, setup.level, setup.reduction, "repeat",
                                       runs[0], runs[1:], truth)]
        alone = []
        for p, lr in zip(ps, ls, strict=True):
            llm.reset_prefix_cache()
            alone += decisions.read_probabilities(llm, [p], [lr])
        batched = []
        for size in self.plan.decision_batches:
            llm.reset_prefix_cache()
            batched.append(decisions.read_probabilities(llm, ps, ls, size))
        rows.append(decisions.decision_row(self.label, setup.level, setup.reduction,
                                           "batch_sizes", alone, batched, truth))
        self.bar.tick()
        self.result.decisions.extend(rows)

    def cross_main(self, llm: Any, setup: EngineSetup) -> None:
        n = self.plan.cross_prompts
        ref, rows = cross_batch.main_engine_checks(
            llm, self.label, setup.level, self.prompts[:n], self.loras[:n], self.cross_params,
            self.plan.cross_batches, self.bar.tick)
        self.alone[setup.level] = ref
        self.result.cross_batch.extend(rows)

    def performance(self, llm: Any, setup: EngineSetup) -> None:
        for b in self.plan.perf_batches:
            self.result.performance.append(performance.measure(
                llm, self.label, setup.level, setup.reduction, self.prompts, self.loras, b,
                self.plan.perf_tokens, self.plan.perf_trials))
            self.bar.tick()

    def variant(self, level: str, variant: str) -> None:
        """The cross-batch checks of one variant engine of ``level``."""
        self.bar.add(1)
        self.bar.describe(f"{self.label}: {level} {variant}")
        setup = EngineSetup(level, LEVEL_DEFAULTS[level])
        n = self.plan.cross_prompts
        llm = self.build(setup, variant)
        try:
            self.result.cross_batch.extend(cross_batch.variant_rows(
                llm, variant, self.label, level, self.prompts[:n], self.loras[:n],
                self.cross_params, self.alone[level]))
        finally:
            del llm
            release()
        self.bar.tick()

    def trace(self) -> None:
        n = self.plan.prompts
        _trace(self.result, self.model, self.plan, self.build, self.prompts[:n],
               self.loras[:n], self.tasks[:n], self.atomic_runs, self.tok, self.bar)


def _fingerprint(llm, prompt: list[int], lora) -> str:
    """What decided the bits of this engine's outputs with the study's (first) adapter."""
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(max_tokens=1, temperature=0.0), lora, use_tqdm=False)
    return out[0].fingerprint


def _trace(result: StudyResult, model: StudyModel, plan: StudyPlan,
           build: Callable[[EngineSetup, str], Any],
           prompts: list[list[int]], loras: list, tasks: list[Task], atomic_runs: list,
           tok: Tokenizer, bar: _Progress) -> None:
    label = model.label
    changed = repeat.changed_prompts(atomic_runs) if atomic_runs else []
    params = SamplingParams(max_tokens=plan.max_tokens, temperature=0.0)
    atomic = EngineSetup("fast", "atomic")
    llm = build(atomic, "eager")
    entry: dict[str, Any] = {"model": label, "level": atomic.level,
                             "reduction": atomic.reduction, "prompts": len(prompts),
                             # None: the repeat section's atomic runs are not in this run
                             "prompts_changed_in_repeat": len(changed) if atomic_runs else None}
    try:
        div, runs = trace.find_divergence(llm, prompts, loras, params,
                                          repetitions=plan.trace_runs,
                                          time_limit_s=plan.trace_time_s, tick=bar.tick)
        entry["repetitions"] = runs
        entry["found"] = div is not None
        if div is None:
            entry["note"] = (f"no divergence in {runs} repetitions of the batch of "
                             f"{len(prompts)} prompts")
            return
        entry["prompt_index"] = div.prompt_index
        entry["prompt"] = tasks[div.prompt_index].prompt
        spec = llm.engine.spec
        kv_layers = (None if spec.hybrid is None else
                     [i for i, t in enumerate(spec.hybrid.layer_types) if t == "*"])
        entry.update(trace.describe_divergence(div, spec.num_layers, tok.decode, kv_layers))
        stop_ids = llm.engine.eos_token_ids
    finally:
        result.trace.setdefault("per_model", []).append(entry)
        del llm
        release()
    if kv_layers is not None:
        entry["controlled"] = {"skipped": "a hybrid model's Mamba-2 states are not in its KV "
                                          "cache: a run cannot be continued from its K/V alone"}
        bar.tick()
        return
    det = EngineSetup("run_to_run", "unsplit")
    det_llm = build(det, "eager")
    try:
        entry["controlled"] = {"level": det.level, "reduction": det.reduction,
                               **trace.controlled_experiment(
                                   det_llm, div, prompts[div.prompt_index],
                                   loras[div.prompt_index], plan.max_tokens, stop_ids,
                                   tok.decode, tasks[div.prompt_index])}
    finally:
        del det_llm
        release()
        bar.tick()

"""Section 5, the trace of a divergence (the paper's section 6.2): two runs of one prompt under
``atomic`` that choose different tokens, followed back into the layers.

1. Search: prompts (those whose output changed in the repeat section first) run alone in an
   eager ``fast``/``atomic`` engine, every LoRA shrink output and every K/V written recorded
   (``detlora.engine.introspect``), until a run's tokens differ from the prompt's first run.
2. The divergence: the first differing token, both runs' logits of the two candidates there
   (the margin), the first shrink output that differs (step, layer, element, both values),
   and per layer the largest shrink and K/V differences up to that token.
3. The controlled experiment: a deterministic engine continues from each run's KV cache
   (every position before the last shared token), greedy to the end; whether the two caches
   alone choose different tokens, repeated twice.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from detlora import LoRARequest, SamplingParams
from detlora.engine.introspect import continue_from_kv, observe, read_kv
from detlora.study.generation import first_difference
from detlora.study.grading import grade
from detlora.study.tasks import Task


@dataclass
class TracedRun:
    token_ids: list[int]
    text: str
    step_names: list[list[str]] = field(default_factory=list)  # per step, in forward order
    shrinks: list[dict[str, torch.Tensor]] = field(default_factory=list)  # per step
    step_positions: list[list[int]] = field(default_factory=list)
    k: list[torch.Tensor] = field(default_factory=list)  # per step [L, T, Hk, D], on device
    v: list[torch.Tensor] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)  # per sampled token, fp32 [V]
    sample_steps: list[int] = field(default_factory=list)  # the step of each sampled token

    def kv_until(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions [0, end): [L, end, Hk, D] each."""
        pos = [p for ps in self.step_positions for p in ps]
        k, v = torch.cat(self.k, dim=1), torch.cat(self.v, dim=1)
        order = sorted(range(len(pos)), key=lambda i: pos[i])
        if [pos[i] for i in order[:end]] != list(range(end)):
            raise ValueError(f"the run did not record every position below {end}")
        idx = torch.tensor(order[:end], dtype=torch.int64, device=k.device)
        return k.index_select(1, idx), v.index_select(1, idx)


def traced_generate(llm, prompt: Sequence[int], lora: LoRARequest | None,
                    params: SamplingParams) -> TracedRun:
    """One prompt alone, with every shrink output, K/V and logits row recorded (logits on the
    CPU, the rest on the engine's device)."""
    engine = llm.engine
    run = TracedRun([], "")
    start = engine.num_steps

    def on_shrink(name: str, h: torch.Tensor) -> None:
        s = engine.num_steps - start - 1
        while len(run.shrinks) <= s:
            run.shrinks.append({})
            run.step_names.append([])
        run.shrinks[s][name] = h  # a copy, left on the device until compared
        run.step_names[s].append(name)

    def on_step(step, logits) -> None:
        k, v = read_kv(engine, step.slot_mapping)
        run.step_positions.append(list(step.positions))
        run.k.append(k)
        run.v.append(v)
        if logits is not None:
            run.logits.append(logits[0].float().cpu())
            run.sample_steps.append(len(run.step_positions) - 1)

    with observe(engine, on_shrink=on_shrink, on_step=on_step):
        out = llm.generate([{"prompt_token_ids": list(prompt)}], params, lora,
                           use_tqdm=False)[0]
    run.token_ids = list(out.outputs[0].token_ids)
    run.text = out.outputs[0].text
    return run


@dataclass(frozen=True)
class Divergence:
    prompt_index: int
    run_a: TracedRun
    run_b: TracedRun
    pair: tuple[int, int]  # run numbers of the prompt: 0 and the first that differed
    token_index: int  # the first differing output token


def find_divergence(llm, prompts: Sequence[Sequence[int]], loras: Sequence[LoRARequest | None],
                    candidates: Sequence[int], params: SamplingParams, *, max_runs: int,
                    time_limit_s: float = float("inf"),
                    before_run: Callable[[int, int], None] | None = None,
                    tick: Callable[[], None] = lambda: None) -> tuple[Divergence | None, int]:
    """(the first divergence found, runs made). Candidates take turns (one run each per
    round) until ``max_runs`` runs or ``time_limit_s``. ``before_run(prompt, run)`` is
    called before each run (tests plant a difference with it)."""
    firsts: dict[int, TracedRun] = {}
    counts: dict[int, int] = {}
    runs = 0
    t0 = time.perf_counter()
    while runs < max_runs and candidates and time.perf_counter() - t0 < time_limit_s:
        for i in candidates:
            if runs >= max_runs or time.perf_counter() - t0 >= time_limit_s:
                break
            n = counts.get(i, 0)
            if before_run is not None:
                before_run(i, n)
            run = traced_generate(llm, prompts[i], loras[i], params)
            runs += 1
            counts[i] = n + 1
            tick()
            if i not in firsts:
                firsts[i] = run
                continue
            j = first_difference(firsts[i].token_ids, run.token_ids)
            if j is not None:
                return Divergence(i, firsts[i], run, (0, n), j), runs
    return None, runs


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> tuple[float, int]:
    d = (a.double() - b.double()).abs()
    return float(d.max()) if d.numel() else 0.0, int((a != b).sum())


def _layer_of(name: str) -> int:
    parts = name.split(".")
    return int(parts[parts.index("layers") + 1])


def describe_divergence(div: Divergence, num_layers: int,
                        decode: Callable[[list[int]], str]) -> dict:
    """Where the two runs part: token, logits margin, first shrink difference, per-layer
    shrink and K/V differences up to the token (JSON-ready)."""
    a, b, j = div.run_a, div.run_b, div.token_index
    tok_a = a.token_ids[j] if j < len(a.token_ids) else None
    tok_b = b.token_ids[j] if j < len(b.token_ids) else None
    step = a.sample_steps[j] if j < len(a.sample_steps) else len(a.step_positions) - 1
    layers = [{"layer": i, "shrink_max_abs": 0.0, "shrink_differing": 0, "k_max_abs": 0.0,
               "k_differing": 0, "v_max_abs": 0.0, "v_differing": 0} for i in range(num_layers)]
    first = None
    for s in range(min(step + 1, len(a.shrinks), len(b.shrinks))):
        for name in a.step_names[s]:
            ha, hb = a.shrinks[s][name], b.shrinks[s].get(name)
            if hb is None or ha.shape != hb.shape:
                continue
            m, count = _max_diff(ha, hb)
            row = layers[_layer_of(name)]
            row["shrink_max_abs"] = max(row["shrink_max_abs"], m)
            row["shrink_differing"] += count
            if count and first is None:
                at = (ha != hb).nonzero()[0].tolist()  # [slice, row, rank]
                first = {"step": s, "layer_name": name, "layer": _layer_of(name),
                         "position": a.step_positions[s][at[1]], "element": at,
                         "value_a": float(ha[tuple(at)]), "value_b": float(hb[tuple(at)]),
                         "abs_diff": abs(float(ha[tuple(at)]) - float(hb[tuple(at)]))}
    prompt_len = _prompt_len(a)
    end = prompt_len + j  # the positions whose K/V the differing token was chosen with
    ka, va = a.kv_until(end)
    kb, vb = b.kv_until(end)
    for i in range(num_layers):
        layers[i]["k_max_abs"], layers[i]["k_differing"] = _max_diff(ka[i], kb[i])
        layers[i]["v_max_abs"], layers[i]["v_differing"] = _max_diff(va[i], vb[i])

    def logits_at(run: TracedRun) -> dict | None:
        if j >= len(run.logits) or tok_a is None or tok_b is None:
            return None
        z = run.logits[j]
        return {"logit_a": float(z[tok_a]), "logit_b": float(z[tok_b]),
                "margin": float(z[tok_a] - z[tok_b]), "chosen": int(torch.argmax(z))}

    return {
        "pair": list(div.pair), "first_differing_token": j, "position": prompt_len + j,
        "shared_prefix": decode(a.token_ids[:j])[-200:],
        "token_a": None if tok_a is None else {"id": tok_a, "text": decode([tok_a])},
        "token_b": None if tok_b is None else {"id": tok_b, "text": decode([tok_b])},
        "logits_run_a": logits_at(a), "logits_run_b": logits_at(b),
        "first_shrink_difference": first, "kv_positions_compared": end, "layers": layers,
        "output_a": a.text, "output_b": b.text,
    }


def _prompt_len(run: TracedRun) -> int:
    """Positions computed before the first sampled token (the prompt)."""
    if not run.sample_steps:
        return 0
    last = run.step_positions[run.sample_steps[0]]
    return last[-1] + 1


def controlled_experiment(det_llm, div: Divergence, prompt: Sequence[int],
                          lora: LoRARequest | None, max_tokens: int, stop_ids: Sequence[int],
                          decode: Callable[[list[int]], str], task: Task | None,
                          trials: int = 2) -> dict:
    """Continue from each run's KV cache in ``det_llm`` (a deterministic reduction)."""
    a, b, j = div.run_a, div.run_b, div.token_index
    context = list(prompt) + a.token_ids[:j]
    n = len(context) - 1  # the incoming cache: every position before the last shared token
    tok_a = a.token_ids[j] if j < len(a.token_ids) else None
    tok_b = b.token_ids[j] if j < len(b.token_ids) else None
    result: dict = {}
    for name, run in (("from_cache_a", a), ("from_cache_b", b)):
        k, v = run.kv_until(n)
        outs = [continue_from_kv(det_llm.engine, context, k, v, lora=lora,
                                 max_tokens=max(1, max_tokens - j), stop_token_ids=stop_ids)
                for _ in range(trials)]
        first = outs[0]
        z = first[0].logits
        tokens = [t.token_id for t in first]
        text = decode(a.token_ids[:j] + tokens)
        entry = {
            "token": {"id": tokens[0], "text": decode(tokens[:1])},
            "logit_a": None if tok_a is None else float(z[tok_a]),
            "logit_b": None if tok_b is None else float(z[tok_b]),
            "repeatable": all([t.token_id for t in o] == tokens
                              and all(torch.equal(x.logits, y.logits) for x, y in zip(o, first,
                                                                                      strict=True))
                              for o in outs[1:]),
            "continuation": text[-400:],
        }
        if task is not None:
            outcome = grade(task, text)
            entry["answer"], entry["correct"] = outcome.answer, outcome.correct
        result[name] = entry
    result["token_changed_by_cache"] = (result["from_cache_a"]["token"]["id"]
                                        != result["from_cache_b"]["token"]["id"])
    result["trials"] = trials
    return result

"""Section 5, the trace of a divergence (the paper's section 6.2): two runs of one prompt under
``atomic`` that choose different tokens, followed back into the layers.

1. Search: the repeat section's workload (its prompts in one batch) runs again in an eager
   ``fast``/``atomic`` engine, every LoRA shrink output, every K/V written and the best logits
   of every sampled row recorded per sequence (``detlora.engine.introspect``), until a
   repetition's tokens differ from the first's for some prompt.
2. The divergence: the first differing token, both runs' logits of the two candidates there
   (the margin), the first shrink output that differs (step, layer, element, both values),
   and per layer the largest shrink and K/V differences up to that token.
3. The controlled experiment: a deterministic engine continues from each run's KV cache
   (every position before the last shared token), greedy to the end; whether the two caches
   alone choose different tokens, repeated twice. Not for hybrid models: their Mamba layers'
   states are not in the KV cache (the search and the divergence are traced as for others).
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

TOP_LOGITS = 8  # logits kept per sampled row: the candidates of a close race are among them


@dataclass
class TracedRun:
    """What one sequence of a traced batch computed, per engine step that included it."""

    token_ids: list[int]
    text: str
    step_names: list[list[str]] = field(default_factory=list)  # per step, in forward order
    shrinks: list[dict[str, torch.Tensor]] = field(default_factory=list)  # [S, rows, R] each
    step_positions: list[list[int]] = field(default_factory=list)
    k: list[torch.Tensor] = field(default_factory=list)  # per step [L, rows, Hk, D], on device
    v: list[torch.Tensor] = field(default_factory=list)
    top: list[dict[int, float]] = field(default_factory=list)  # per sampled token: id -> logit
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


def traced_batch(llm, prompts: Sequence[Sequence[int]], loras: Sequence[LoRARequest | None],
                 params: SamplingParams) -> list[TracedRun]:
    """All ``prompts`` in one batch, each sequence's shrink rows, K/V and best logits recorded
    (logits on the CPU, the rest on the engine's device). Needs an eager engine without a
    prefix cache (so that no two live sequences share a page)."""
    engine = llm.engine
    seqs = [engine.add_request(list(p), params, lora=lr)
            for p, lr in zip(prompts, loras, strict=True)]
    runs = [TracedRun([], "") for _ in seqs]
    pending: dict[str, torch.Tensor] = {}

    def on_shrink(name: str, h: torch.Tensor) -> None:
        pending[name] = h

    def on_step(step, logits) -> None:
        k_all, v_all = read_kv(engine, step.slot_mapping, step.group_slot_mapping)
        where = {tuple(table): k for k, table in enumerate(step.block_tables)}
        sampled = {row: j for j, row in enumerate(step.logits_indices)}
        top = None
        if logits is not None:
            values, ids = torch.topk(logits.float(), min(TOP_LOGITS, logits.shape[-1]), dim=-1)
            top = (ids.cpu().tolist(), values.cpu().tolist())
        for seq, run in zip(seqs, runs, strict=True):
            k = where.get(tuple(seq.block_table))
            if k is None:
                continue
            lo, hi = step.query_start_loc[k], step.query_start_loc[k + 1]
            run.step_positions.append(list(step.positions[lo:hi]))
            run.k.append(k_all[:, lo:hi])
            run.v.append(v_all[:, lo:hi])
            run.shrinks.append({n: h[:, lo:hi] for n, h in pending.items()})
            run.step_names.append(list(pending))
            j = sampled.get(hi - 1)
            if j is not None and top is not None:
                run.top.append(dict(zip(top[0][j], top[1][j], strict=True)))
                run.sample_steps.append(len(run.step_positions) - 1)
        pending.clear()

    done = {}
    with observe(engine, on_shrink=on_shrink, on_step=on_step):
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
    for seq, run in zip(seqs, runs, strict=True):
        out = done[seq.request_id].outputs[0]
        run.token_ids, run.text = list(out.token_ids), out.text
    return runs


@dataclass(frozen=True)
class Divergence:
    prompt_index: int
    run_a: TracedRun
    run_b: TracedRun
    pair: tuple[int, int]  # the repetitions compared: 0 and the first that differed
    token_index: int  # the first differing output token


def find_divergence(llm, prompts: Sequence[Sequence[int]], loras: Sequence[LoRARequest | None],
                    params: SamplingParams, *, repetitions: int,
                    time_limit_s: float = float("inf"),
                    before_run: Callable[[int], None] | None = None,
                    tick: Callable[[], None] = lambda: None) -> tuple[Divergence | None, int]:
    """(the first divergence found, repetitions run): the batch again until some prompt's
    tokens differ from repetition 0, for at most ``repetitions`` runs or ``time_limit_s``.
    ``before_run(r)`` is called before repetition r (tests plant a difference with it)."""
    t0 = time.perf_counter()
    first: list[TracedRun] = []
    for r in range(repetitions):
        if r > 1 and time.perf_counter() - t0 >= time_limit_s:
            return None, r
        if before_run is not None:
            before_run(r)
        runs = traced_batch(llm, prompts, loras, params)
        tick()
        if r == 0:
            first = runs
            continue
        for i, (a, b) in enumerate(zip(first, runs, strict=True)):
            j = first_difference(a.token_ids, b.token_ids)
            if j is not None:
                return Divergence(i, a, b, (0, r), j), r + 1
    return None, repetitions


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> tuple[float, int]:
    d = (a.double() - b.double()).abs()
    return float(d.max()) if d.numel() else 0.0, int((a != b).sum())


def _layer_of(name: str) -> int:
    parts = name.split(".")
    return int(parts[parts.index("layers") + 1])


def describe_divergence(div: Divergence, num_layers: int,
                        decode: Callable[[list[int]], str],
                        kv_layers: Sequence[int] | None = None) -> dict:
    """Where the two runs part: token, logits margin, first shrink difference, per-layer
    shrink and K/V differences up to the token (JSON-ready). ``kv_layers``: the layer of
    each KV cache layer (default: every layer has one; a hybrid's attention layers only)."""
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
    for c, i in enumerate(range(num_layers) if kv_layers is None else kv_layers):
        layers[i]["k_max_abs"], layers[i]["k_differing"] = _max_diff(ka[c], kb[c])
        layers[i]["v_max_abs"], layers[i]["v_differing"] = _max_diff(va[c], vb[c])

    def logits_at(run: TracedRun) -> dict | None:
        if j >= len(run.top) or tok_a is None or tok_b is None:
            return None
        z = run.top[j]  # the best logits of the row, best first
        za, zb = z.get(tok_a), z.get(tok_b)
        return {"logit_a": za, "logit_b": zb,
                "margin": None if za is None or zb is None else za - zb, "chosen": next(iter(z))}

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

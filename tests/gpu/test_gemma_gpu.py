"""Gemma on CUDA in bf16: the sliding-window and head_dim 512 attention kernels, and Gemma 4 /
Gemma 3 engines at batch_invariant with CUDA graphs.

Kernels: a window of 512 (Gemma's) over contexts past it, head_dim 256 and 512, GQA 4 and 2:
close to a float64 oracle, and a query row bit-identical (torch.equal) in one prefill, in
chunks cut around the window's edge, in decode steps alone or batched beside other sequences,
split over CTAs or not, on the decode tile or not, with the pages behind the window released
(-1 in the table, NaN in the page).

Engines: E4B-like and Gemma-3-like shapes, reduced in depth, hidden size and vocabulary so
that they build fast (real head sizes, window 512, KV sharing, PLE, soft-cap), random bf16
weights, a rank-16 adapter on all seven projections: every request alone is the reference;
batched (with graphs), in reversed order, chunked across the window's edge, after
preemption, from the prefix cache and launched ahead give the same token ids and logprobs.
Each of those conditions is a test of its own (``CONDITIONS``), with eager steps alone and
batched besides (graphs versus kernels): a module fixture runs them all, one engine at a
time, and prints each verdict to stderr as it comes ("[gemma-engine gemma4] batched: ok",
or what differs: the request, the first output token that differs, both sides there, and
which steps ran eagerly or ahead), so a device call cut short still names the cause.
The full shapes' rows are benchmarks/suites/architectures_gemma.py's.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

DEV = "cuda"
SCALE = 0.0625


def _cache(lens, hq, hk, d, page, seed):
    from detlora.ops import paged_attention as pa

    g = torch.Generator(device=DEV).manual_seed(seed)
    pages_per = [-(-n // page) for n in lens]
    total = sum(pages_per) + 2
    perm = torch.randperm(total, device=DEV, generator=g)
    k_cache = torch.full((total, page, hk, d), float("nan"), dtype=torch.bfloat16, device=DEV)
    v_cache = torch.full_like(k_cache, float("nan"))
    tables = torch.zeros(len(lens), max(pages_per) + 1, dtype=torch.int32, device=DEV)
    data, start = [], 0
    for b, n in enumerate(lens):
        mine = perm[start:start + pages_per[b]]
        start += pages_per[b]
        tables[b, :len(mine)] = mine.int()
        k = torch.randn(n, hk, d, generator=g, device=DEV).bfloat16()
        v = torch.randn(n, hk, d, generator=g, device=DEV).bfloat16()
        pos = torch.arange(n, device=DEV)
        pa.write_kv(k, v, k_cache, v_cache, mine[pos // page] * page + pos % page)
        data.append((k, v, torch.randn(n, hq, d, generator=g, device=DEV).bfloat16()))
    return data, k_cache, v_cache, tables


def _run(data, kc, vc, tables, pieces, window, **kw):
    from detlora.ops import paged_attention as pa

    q = torch.cat([data[s][2][a:e] for s, a, e in pieces])
    tab = torch.stack([tables[s] for s, _, _ in pieces])
    lens = torch.tensor([e for _, _, e in pieces], dtype=torch.int32, device=DEV)
    q_lens = [e - a for _, a, e in pieces]
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32,
                       device=DEV)
    out = torch.full_like(q, float("nan"))
    pa.paged_attention(q, kc, vc, tab, lens, qsl, SCALE, out=out, window=window, **kw)
    return list(out.split(q_lens))


def _release(kc, vc, tables, s, before, page):
    tables = tables.clone()
    for i in range(max(0, before) // page):
        kc[int(tables[s, i])] = float("nan")
        vc[int(tables[s, i])] = float("nan")
        tables[s, i] = -1
    return tables


SHAPES = [(8, 2, 512, 16), (8, 2, 256, 16), (4, 2, 256, 16)]  # (Hq, Hk, D, page)


@pytest.mark.parametrize("hq,hk,d,page", SHAPES, ids=[f"d{s[2]}-gqa{s[0] // s[1]}"
                                                     for s in SHAPES])
def test_window_rows_identical_in_every_mode(hq, hk, d, page):
    window, n = 512, 1300
    data, kc, vc, tables = _cache([n, 700], hq, hk, d, page, seed=d + hq)
    full = _run(data, kc, vc, tables, [(0, 0, n)], window)[0]
    k, v, q = data[0]
    # float64 oracle of a few rows
    for p in (0, 511, 512, 1299):
        lo = max(0, p - window + 1)
        s = torch.einsum("hd,khd->hk", q[p].double(),
                         k[lo:p + 1].double().repeat_interleave(hq // hk, 1)) * SCALE
        want = torch.einsum("hk,khd->hd", torch.softmax(s, -1),
                            v[lo:p + 1].double().repeat_interleave(hq // hk, 1))
        assert float((full[p].double() - want).abs().max()) < 2e-2, p

    def check(first, end, what, **kw):
        released = _release(kc.clone(), vc.clone(), tables, 0, first - window + 1, page)
        got = _run(data, kc, vc, released, [(0, first, end), (1, 699, 700)], window, **kw)[0]
        assert torch.equal(got, full[first:end]), what

    for cut in (window - 1, window, window + 1, 640, 1000):
        check(0, cut, f"chunk 0:{cut}")
        check(cut, n, f"chunk {cut}:{n}")
    for p in (0, 63, 511, 512, 513, 1024, 1299):
        check(p, p + 1, f"decode {p}")
        check(p, p + 1, f"decode {p} hint", max_query_len=1)
        for ctas in (1, 2, 4):
            check(p, p + 1, f"decode {p} over {ctas} CTAs", kv_ctas=ctas, max_query_len=1)
    for ctas in (1, 3):
        check(0, n, f"prefill over {ctas} CTAs", kv_ctas=ctas)
    steps = [5, 511, 512, 900, 1299]
    rows = _run(data, kc, vc, tables, [(0, p, p + 1) for p in steps], window)
    for p, row in zip(steps, rows, strict=True):
        assert torch.equal(row, full[p:p + 1]), f"batched decode {p}"


def test_head_dim_512_full_attention_rows_identical():
    data, kc, vc, tables = _cache([2100, 40], 8, 2, 512, 16, seed=3)
    full = _run(data, kc, vc, tables, [(0, 0, 2100)], None)[0]
    for first, end in ((0, 700), (700, 2100), (2099, 2100), (1024, 1025)):
        for ctas in (1, None):
            got = _run(data, kc, vc, tables, [(0, first, end), (1, 39, 40)], None,
                       kv_ctas=ctas)[0]
            assert torch.equal(got, full[first:end]), (first, end, ctas)


# ----------------------------------------------------------------------------- engines

E4B_SMALL = dict(hidden_size=1024, intermediate_size=2048, num_hidden_layers=8,
                 layer_types=(["sliding_attention"] * 3 + ["full_attention"]) * 2,
                 num_kv_shared_layers=4, vocab_size=4096, vocab_size_per_layer_input=4096,
                 hidden_size_per_layer_input=64)


@pytest.fixture(scope="module", params=["gemma4", "gemma3"])
def engine_case(request, tmp_path_factory):
    from benchmarks.suites import architectures_gemma as ag

    root = tmp_path_factory.mktemp(request.param)
    if request.param == "gemma4":
        cfg = {**ag.GEMMA4_E4B, **E4B_SMALL}
    else:
        cfg = {**ag.GEMMA3_4B, "hidden_size": 1024, "intermediate_size": 2048,
               "num_hidden_layers": 7, "vocab_size": 4096, "sliding_window": 512}
    ag.write_checkpoint(root / "m", cfg)
    ag.write_adapter(root / "a", root / "m", targets=ag.TARGETS, rank=16)
    return request.param, root, cfg


def _llm(path, **kw):
    from detlora import LLM

    args = dict(enable_lora=True, max_loras=2, max_lora_rank=16, max_model_len=2048,
                determinism="batch_invariant", enable_prefix_caching=False,
                gpu_memory_utilization=0.5)
    return LLM(str(path), **{**args, **kw})


def _requests(root):
    from detlora import LoRARequest, SamplingParams

    lora = LoRARequest("a", 1, str(root / "a"))
    g = torch.Generator().manual_seed(5)
    lens = [500, 515, 530, 700, 1029, 260, 513, 800]
    prompts = [torch.randint(3, 4000, (n,), generator=g).tolist() for n in lens]
    loras = [lora if k % 2 else None for k in range(len(prompts))]
    params = [SamplingParams(temperature=0.0, max_tokens=24, logprobs=1, ignore_eos=True)
              if k % 2 == 0 else SamplingParams(temperature=0.8, top_p=0.95, seed=k,
                                                max_tokens=24, logprobs=0, ignore_eos=True)
              for k in range(len(prompts))]
    return prompts, params, loras


def _differences(outs, ref, prompts, loras) -> str:
    """'' when every output equals its reference to the bit, else one line per request that
    differs: its prompt length, adapter, the first token index where ids or logprobs part,
    and both sides there."""
    lines = []
    for k, (a, b) in enumerate(zip(outs, ref, strict=True)):
        x, y = a.outputs[0], b.outputs[0]
        if x.token_ids == y.token_ids and x.logprobs == y.logprobs:
            continue
        n = max(len(x.token_ids), len(y.token_ids))
        at = next((i for i in range(n) if x.token_ids[i:i + 1] != y.token_ids[i:i + 1]
                   or (x.logprobs or [])[i:i + 1] != (y.logprobs or [])[i:i + 1]), n)
        lines.append(
            f"request {k} (prompt {len(prompts[k])}, {'adapter' if loras[k] else 'base'}, "
            f"finish {x.finish_reason}/{y.finish_reason}) first differs at output token {at}: "
            f"ids {x.token_ids[at:at + 2]} vs {y.token_ids[at:at + 2]}, logprobs "
            f"{(x.logprobs or [])[at:at + 1]} vs {(y.logprobs or [])[at:at + 1]}")
    return "\n".join(lines)


def _watch_steps(llm) -> list[tuple[int, int]]:
    """(tokens, sequences) of every step the engine's runner runs eagerly from now on (the
    others replay a decode or step graph), for the difference reports."""
    runner = llm.engine.runner
    eager: list[tuple[int, int]] = []
    build = runner.forward_batch

    def forward_batch(step):
        eager.append((step.num_tokens, step.num_seqs))
        return build(step)

    runner.forward_batch = forward_batch
    return eager


def _paths(llm, eager: list[tuple[int, int]]) -> str:
    runner = llm.engine.runner
    return (f" [decode graphs {runner.graphs is not None}, step graphs "
            f"{runner.step_graphs is not None} (capture error: {runner.graph_error}), "
            f"{len(eager)} eager steps (tokens, seqs): {sorted(set(eager))[:12]}, "
            f"{llm.engine.num_steps_ahead} steps launched ahead]")


def _report(family: str, condition: str, problem: str) -> None:
    """Each condition's verdict on the live log at once (pytest's summary may come too late
    for a device call's time limit)."""
    import sys

    verdict = "ok" if not problem else "FAILED: " + problem.replace("\n", "\n    ")
    print(f"[gemma-engine {family}] {condition}: {verdict}", file=sys.__stderr__, flush=True)


CONDITIONS = ("graphs", "batched", "reversed", "run_ahead", "eager_alone", "eager", "chunked",
              "preempted", "prefix_cached")


@pytest.fixture(scope="module")
def engine_verdicts(engine_case):
    """Every condition of the window test run once per family, one engine alive at a time:
    condition -> '' (bits equal, or the property holds) or what went wrong (a difference
    report, or an exception's traceback). Every request alone on the first engine (CUDA
    graphs, steps launched ahead) is the reference."""
    import gc
    import traceback

    family, root, _ = engine_case
    prompts, params, loras = _requests(root)
    verdicts: dict[str, str] = {}

    def check(condition, fn):
        try:
            problem = fn() or ""
        except Exception:  # the verdict of this condition; the others still run
            problem = traceback.format_exc(limit=12)
        verdicts[condition] = problem
        _report(family, condition, problem)

    def generate(llm, order=None):
        order = list(range(len(prompts))) if order is None else order
        return llm.generate([prompts[k] for k in order], [params[k] for k in order],
                            [loras[k] for k in order], use_tqdm=False)

    alone: list = []
    eager: list = []  # the first engine's eager steps

    def build():
        llm = _llm(root / "m")
        runner = llm.engine.runner
        eager.append(_watch_steps(llm))
        alone.extend(llm.generate(p, s, r, use_tqdm=False)[0]
                     for p, s, r in zip(prompts, params, loras, strict=True))
        return llm, (None if runner.uses_cuda_graphs else
                     f"no CUDA graphs: {runner.graph_error}")

    try:
        llm, graph_problem = build()
    except Exception:
        problem = traceback.format_exc(limit=12)
        for condition in CONDITIONS:
            verdicts[condition] = "the first engine failed: " + problem
            _report(family, condition, verdicts[condition])
        return verdicts
    verdicts["graphs"] = graph_problem or ""
    _report(family, "graphs", verdicts["graphs"])
    first = {"llm": llm}  # dropped below: one engine at a time
    del llm

    def with_paths(problem: str) -> str:
        return problem and problem + _paths(first["llm"], eager[0])

    check("batched", lambda: with_paths(_differences(generate(first["llm"]), alone, prompts,
                                                     loras)))
    order = list(reversed(range(len(prompts))))
    check("reversed", lambda: with_paths(_differences(
        generate(first["llm"], order), [alone[k] for k in order],
        [prompts[k] for k in order], [loras[k] for k in order])))
    check("run_ahead", lambda: "" if first["llm"].engine.num_steps_ahead > 0 else
          f"no step was launched ahead (run_ahead={first['llm'].engine.run_ahead})")
    first.clear()
    gc.collect()
    torch.cuda.empty_cache()

    def other(condition, **kw):
        def run():
            engine = _llm(root / "m", **kw)  # an error here is the verdict too
            steps = _watch_steps(engine)
            try:
                if condition == "eager_alone":  # each request alone, eagerly
                    diff = _differences([engine.generate(p, s, r, use_tqdm=False)[0]
                                         for p, s, r in zip(prompts, params, loras,
                                                            strict=True)],
                                        alone, prompts, loras)
                    return diff and diff + _paths(engine, steps)
                outs = generate(engine)
                notes = []
                if kw.get("enable_prefix_caching"):
                    outs = generate(engine)
                    if sum(o.num_cached_tokens for o in outs) == 0:
                        notes.append("no prefix-cache hit")
                if "num_kv_blocks" in kw and engine.engine.scheduler.num_preemptions == 0:
                    notes.append("no preemption")
                diff = _differences(outs, alone, prompts, loras)
                problem = "\n".join(notes + ([diff] if diff else []))
                return problem and problem + _paths(engine, steps)
            finally:
                del engine
                gc.collect()
                torch.cuda.empty_cache()

        check(condition, run)

    # Eager steps (no graphs, no run-ahead), alone then batched: tells the graphs' part
    # from the kernels'.
    other("eager_alone", enforce_eager=True)
    other("eager", enforce_eager=True)
    other("chunked", max_num_batched_tokens=300)
    other("preempted", num_kv_blocks=120, block_size=16)
    other("prefix_cached", enable_prefix_caching=True)
    return verdicts


@pytest.mark.parametrize("condition", CONDITIONS)
def test_engine_invariance_across_the_window(engine_verdicts, condition):
    """One condition's verdict (``engine_verdicts``): every request's token ids and logprobs
    equal its own alone on the first engine, or the property named holds."""
    problem = engine_verdicts[condition]
    assert not problem, f"{condition}:\n{problem}"

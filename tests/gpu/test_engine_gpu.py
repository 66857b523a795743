"""The engine on CUDA: every determinism level generates; batch_invariant gives the same bits
at batch sizes 1, 4 and 16 with CUDA graphs on, eager or graphed, and after preemption.

Tiny random bf16 Llama checkpoints and PEFT adapters are written with safetensors here (no
transformers needed on the GPU machine). Bits are compared with ==, never a tolerance.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tests.helpers.bf16_llama import write_bf16_llama

from detlora.config import SamplingParams
from detlora.entrypoints.llm import LLM
from detlora.lora.request import LoRARequest

pytestmark = pytest.mark.gpu

VOCAB = 512
HIDDEN, LAYERS, HEADS, KV_HEADS, INTER = 256, 2, 4, 2, 512
HEAD_DIM = HIDDEN // HEADS
RANK = 16
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _write_model(path: Path) -> None:
    write_bf16_llama(path, vocab=VOCAB, hidden=HIDDEN, layers=LAYERS, heads=HEADS,
                     kv_heads=KV_HEADS, head_dim=HEAD_DIM, inter=INTER,
                     proj_std=0.06, down_std=0.04)


def _write_adapter(path: Path, seed: int) -> None:
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    kv = KV_HEADS * HEAD_DIM
    dims = {"q_proj": (HIDDEN, HIDDEN), "k_proj": (HIDDEN, kv), "v_proj": (HIDDEN, kv),
            "o_proj": (HIDDEN, HIDDEN), "gate_proj": (HIDDEN, INTER),
            "up_proj": (HIDDEN, INTER), "down_proj": (INTER, HIDDEN)}
    w = {}
    for i in range(LAYERS):
        for name, (fin, fout) in dims.items():
            part = "self_attn" if name in TARGETS[:4] else "mlp"
            p = f"base_model.model.model.layers.{i}.{part}.{name}."
            w[p + "lora_A.weight"] = (torch.randn(RANK, fin, generator=g) / fin**0.5).to(
                torch.bfloat16)
            w[p + "lora_B.weight"] = (torch.randn(fout, RANK, generator=g) * 0.05).to(
                torch.bfloat16)
    path.mkdir(parents=True)
    save_file(w, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": RANK, "lora_alpha": 2 * RANK, "target_modules": list(TARGETS),
        "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM"}))


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine_gpu")
    _write_model(root / "model")
    for k in range(2):
        _write_adapter(root / f"a{k}", seed=10 + k)
    loras = [LoRARequest(f"a{k}", k + 1, str(root / f"a{k}")) for k in range(2)]
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, VOCAB, (int(n),), generator=g).tolist()
               for n in torch.randint(5, 120, (16,), generator=g)]
    return root / "model", loras, prompts


def _params(n: int, max_tokens: int = 24) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0,
                           max_tokens=max_tokens, logprobs=0, ignore_eos=True) if k % 2 == 0
            else SamplingParams(max_tokens=max_tokens, logprobs=0, ignore_eos=True,
                                temperature=0.8, top_p=0.95, seed=k)
            for k in range(n)]


def _llm(model_dir, **kw) -> LLM:
    args = dict(enable_lora=True, max_loras=2, max_lora_rank=RANK, device="cuda",
                max_num_seqs=32, num_kv_blocks=512, enable_prefix_caching=False)
    return LLM(str(model_dir), **{**args, **kw})


def _batched(llm, prompts, params, loras, size):
    out = []
    for lo in range(0, len(prompts), size):
        out += llm.generate(prompts[lo:lo + size], params[lo:lo + size], loras[lo:lo + size],
                            use_tqdm=False)
    return out


def _diff(a, b) -> list[int]:
    return [k for k, (x, y) in enumerate(zip(a, b, strict=True))
            if x.outputs[0].token_ids != y.outputs[0].token_ids
            or x.outputs[0].logprobs != y.outputs[0].logprobs]


@pytest.mark.parametrize("level", ["fast", "run_to_run", "batch_invariant"])
def test_generates_at_every_level(assets, level):
    model_dir, loras, prompts = assets
    llm = _llm(model_dir, determinism=level)
    mixed = [loras[k % 2] if k % 3 else None for k in range(len(prompts))]
    outs = llm.generate(prompts, _params(len(prompts)), mixed, use_tqdm=False)
    for o in outs:
        c = o.outputs[0]
        assert len(c.token_ids) == 24 and all(0 <= t < VOCAB for t in c.token_ids)
        assert all(v.logprob <= 0 for d in c.logprobs for v in d.values())
    assert len({o.fingerprint for o in outs}) == 3  # base, a0, a1
    assert llm.engine.runner.uses_cuda_graphs, llm.engine.runner.graph_error
    # Same batch, same bits, for the levels that promise it.
    if level != "fast":
        again = llm.generate(prompts, _params(len(prompts)), mixed, use_tqdm=False)
        assert _diff(outs, again) == []


def test_batch_invariant_across_batch_sizes_with_cuda_graphs(assets):
    model_dir, loras, prompts = assets
    n = len(prompts)
    params, mixed = _params(n), [loras[k % 2] if k % 3 else None for k in range(n)]
    llm = _llm(model_dir, determinism="batch_invariant")
    assert llm.engine.runner.uses_cuda_graphs, llm.engine.runner.graph_error
    ref = _batched(llm, prompts, params, mixed, 1)
    for size in (4, 16):
        assert _diff(_batched(llm, prompts, params, mixed, size), ref) == [], size
    order = list(range(n))[::-1]
    rev = llm.generate([prompts[k] for k in order], [params[k] for k in order],
                       [mixed[k] for k in order], use_tqdm=False)
    assert _diff(rev, [ref[k] for k in order]) == []
    # Eager (no graphs) gives the graph's bits too.
    eager = _llm(model_dir, determinism="batch_invariant", enforce_eager=True)
    assert not eager.engine.runner.uses_cuda_graphs
    assert _diff(eager.generate(prompts, params, mixed, use_tqdm=False), ref) == []


def test_batch_invariant_preemption_and_chunking(assets):
    model_dir, loras, prompts = assets
    n = len(prompts)
    params, mixed = _params(n), [loras[k % 2] if k % 3 else None for k in range(n)]
    ref = _llm(model_dir, determinism="batch_invariant").generate(prompts, params, mixed,
                                                                  use_tqdm=False)
    small = _llm(model_dir, determinism="batch_invariant", num_kv_blocks=24, block_size=16,
                 max_num_batched_tokens=64)
    outs = small.generate(prompts, params, mixed, use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > 0
    assert _diff(outs, ref) == []


def test_n_completions_are_batch_invariant(assets):
    model_dir, loras, prompts = assets
    llm = _llm(model_dir, determinism="batch_invariant")
    sp = SamplingParams(max_tokens=16, n=4, temperature=0.9, seed=21, logprobs=0,
                        ignore_eos=True)
    alone = llm.generate(prompts[3], sp, loras[0], use_tqdm=False)[0]
    batch = llm.generate(prompts[:8], sp, [loras[0]] * 8, use_tqdm=False)[3]

    def completions(out):
        return [(c.index, c.token_ids, c.logprobs) for c in out.outputs]

    assert completions(alone) == completions(batch)
    assert len({tuple(c.token_ids) for c in alone.outputs}) > 1


def test_prompt_logprobs_are_batch_invariant(assets):
    model_dir, loras, prompts = assets
    sp = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=2, ignore_eos=True)
    mixed = [loras[k % 2] for k in range(6)]
    llm = _llm(model_dir, determinism="batch_invariant")
    alone = [llm.generate(prompts[k], sp, mixed[k], use_tqdm=False)[0].prompt_logprobs
             for k in range(6)]
    batch = llm.generate(prompts[:6][::-1], sp, mixed[::-1], use_tqdm=False)[::-1]
    chunked = _llm(model_dir, determinism="batch_invariant", max_num_batched_tokens=64)
    chunks = chunked.generate(prompts[:6], sp, mixed, use_tqdm=False)
    assert [o.prompt_logprobs for o in batch] == alone == [o.prompt_logprobs for o in chunks]
    assert [len(p) for p in alone] == [len(p) for p in prompts[:6]]


def test_stop_strings_are_batch_invariant(tmp_path):
    from detlora.entrypoints.demo import build_demo_assets  # a model with a tokenizer

    model_dir, _ = build_demo_assets(tmp_path)
    llm = LLM(str(model_dir), device="cuda", determinism="batch_invariant", max_num_seqs=16,
              num_kv_blocks=256)
    prompts = ["the engine reads the prompt and", "a sum in floating point", "the user asks",
               "a kernel writes"]
    full = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)
    stops = SamplingParams(temperature=0.0,
                           max_tokens=24, stop=[o.outputs[0].text[20:25] for o in full])
    alone = [llm.generate(p, stops, use_tqdm=False)[0].outputs[0] for p in prompts]
    batch = [o.outputs[0] for o in llm.generate(prompts[::-1], stops, use_tqdm=False)][::-1]

    def key(c):
        return c.text, c.token_ids, c.stop_reason, c.finish_reason

    assert [key(c) for c in alone] == [key(c) for c in batch]
    assert sum(c.finish_reason == "stop" for c in alone) >= 2


def test_sampler_noise_bits_are_the_same_on_cpu_and_gpu():
    from detlora.engine.sample.sampler import _mix32, row_keys

    ids = torch.arange(VOCAB, dtype=torch.int64)
    keys = torch.tensor([row_keys(2**63 + 5, 1000), row_keys(7, 3)], dtype=torch.int64)
    cpu = _mix32(keys[:, :1] ^ _mix32(ids)[None, :])
    gpu = _mix32(keys[:, :1].cuda() ^ _mix32(ids.cuda())[None, :])
    assert torch.equal(cpu, gpu.cpu())


@pytest.mark.parametrize("level", ["run_to_run", "batch_invariant"])
def test_running_one_step_ahead_gives_the_step_by_step_bits(assets, level):
    """The decode graphs read fed input ids when a step is launched before the last one is
    read; requests that stop on a stop token (their rows computed ahead are dropped), ban
    stop tokens for a while, and end at different lengths give the bits of step by step."""
    model_dir, loras, prompts = assets
    n = len(prompts)
    stops = tuple(range(2, 2 + VOCAB // 12))
    params = [SamplingParams(max_tokens=8 + 3 * k, logprobs=0, stop_token_ids=stops,
                             min_tokens=k % 3, **(dict(temperature=0.0) if k % 2 == 0 else
                                                  dict(temperature=0.9, top_p=0.9, seed=k)))
              for k in range(n)]
    mixed = [loras[k % 2] if k % 3 else None for k in range(n)]
    llm = _llm(model_dir, determinism=level)
    engine = llm.engine
    assert engine.run_ahead and engine.runner.uses_cuda_graphs
    ahead = llm.generate(prompts, params, mixed, use_tqdm=False)
    launched_ahead = engine.num_steps_ahead
    engine.run_ahead = False
    steps = engine.num_steps
    step_by_step = llm.generate(prompts, params, mixed, use_tqdm=False)
    assert launched_ahead > 0 and engine.num_steps_ahead == launched_ahead
    assert {o.outputs[0].finish_reason for o in step_by_step} == {"stop", "length"}
    assert _diff(ahead, step_by_step) == []
    # The same steps, plus at most one launched ahead for nothing per stop.
    stopped = sum(o.outputs[0].finish_reason == "stop" for o in step_by_step)
    assert engine.num_steps - steps <= steps <= engine.num_steps - steps + stopped
    assert engine.block_manager.num_free == engine.block_manager.num_blocks


@pytest.mark.parametrize("level", ["run_to_run", "batch_invariant"])
def test_pdl_launches_give_the_bits_of_plain_launches(assets, monkeypatch, level):
    """Kernels launched with programmatic dependent launch (ops/pdl.py, on by default on
    sm_90) give the engine's bits of plain launches, graphs and running ahead included."""
    model_dir, loras, prompts = assets
    params = _params(len(prompts))
    mixed = [loras[k % 2] if k % 3 else None for k in range(len(prompts))]
    monkeypatch.setenv("DETLORA_PDL", "0")
    plain = _llm(model_dir, determinism=level).generate(prompts, params, mixed, use_tqdm=False)
    monkeypatch.setenv("DETLORA_PDL", "1")
    pdl = _llm(model_dir, determinism=level).generate(prompts, params, mixed, use_tqdm=False)
    assert _diff(pdl, plain) == []


def test_step_graphs_give_the_eager_bits(assets, monkeypatch):
    """Prefill, chunked and mixed steps replayed from the step graphs (engine/runner/step_graphs.py,
    padded to their token and sequence buckets) give batch_invariant's eager bits."""
    import detlora.engine.runner.step_graphs as sg

    model_dir, loras, prompts = assets
    params = _params(len(prompts))
    mixed = [loras[k % 2] if k % 3 else None for k in range(len(prompts))]
    replays = []
    run = sg.StepGraphs.run
    monkeypatch.setattr(sg.StepGraphs, "run", lambda self, step: replays.append(
        self.bucket_for(step)) or run(self, step))
    kw = dict(determinism="batch_invariant", max_num_batched_tokens=256, max_model_len=256)
    graphed = _llm(model_dir, **kw)
    assert graphed.engine.runner.step_graphs is not None
    out = _batched(graphed, prompts, params, mixed, 5)  # five prompts per call
    assert len(replays) > 0 and len(set(replays)) > 1
    monkeypatch.setattr(sg, "TOKEN_BUCKETS", ())
    eager = _llm(model_dir, **kw)
    assert eager.engine.runner.step_graphs is None
    ref = _batched(eager, prompts, params, mixed, 5)
    assert _diff(out, ref) == []


def test_prefix_cache_keeps_the_bits(assets):
    """batch_invariant with CUDA graphs: prompts whose shared prefix, or whose whole first
    turn (prompt and answer, written by prefill and decode steps), comes from the cache give
    the bits of the same prompts computed from scratch alone; also with preemption."""
    model_dir, loras, prompts = assets
    n = 12
    shared = prompts[0] + prompts[1]  # over 16-token pages
    asks = [shared + p[:20] for p in prompts[2:2 + n]]
    params, mixed = _params(n), [loras[k % 2] if k % 3 else None for k in range(n)]
    plain = _llm(model_dir, determinism="batch_invariant")
    alone = _batched(plain, asks, params, mixed, 1)
    cached = _llm(model_dir, determinism="batch_invariant", enable_prefix_caching=True)
    assert cached.engine.runner.uses_cuda_graphs, cached.engine.runner.graph_error
    first = cached.generate(asks[:3], params[:3], mixed[:3], use_tqdm=False)
    outs = cached.generate(asks, params, mixed, use_tqdm=False)
    assert all(o.num_cached_tokens >= len(shared) // 16 * 16 for o in outs)
    assert _diff(first, alone[:3]) == [] and _diff(outs, alone) == []
    turns = [o.prompt_token_ids + o.outputs[0].token_ids for o in outs]
    turn_alone = _batched(plain, turns, params, mixed, 1)
    again = cached.generate(turns, params, mixed, use_tqdm=False)
    assert all(o.num_cached_tokens > len(o.prompt_token_ids) - 32 for o in again)
    assert _diff(again, turn_alone) == []
    small = _llm(model_dir, determinism="batch_invariant", enable_prefix_caching=True,
                 num_kv_blocks=40, block_size=16, max_num_batched_tokens=64)
    assert small.engine.runner.uses_cuda_graphs, small.engine.runner.graph_error
    pre = small.generate(asks, params, mixed, use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > 0
    assert small.engine.block_manager.num_hit_tokens > 0
    assert _diff(pre, alone) == []


def test_capture_survives_a_dead_engine_collected_mid_capture(assets, monkeypatch):
    """An engine dropped by its user used to stay alive in reference cycles (its runner's
    graphs held its bound forward) until Python's cyclic GC ran, which could be in the middle
    of the next engine's capture; freeing its CUDA graphs there invalidated the capture
    (without gc_paused, on the H200, the small engine of test_prefix_cache_keeps_the_bits ran
    eagerly in 2 of 3 runs). Now the dropped engine's graphs are freed at once, and a capture
    with a collection after every captured forward still succeeds."""
    import gc
    import weakref

    import detlora.engine.runner.decode_graphs as cg
    import detlora.engine.runner.step_graphs as sg

    model_dir, _, _ = assets
    real = cg.capture_bucket

    def capture_with_gc(forward, batch, **kw):
        def forward_then_gc(b):
            out = forward(b)
            if torch.cuda.is_current_stream_capturing():  # not in the warm-up before it
                gc.collect()  # as an automatic collection might, inside the capture
            return out
        return real(forward_then_gc, batch, **kw)

    gc.disable()  # the dead engine survives until the next one captures (no automatic GC)
    try:
        old = _llm(model_dir, determinism="batch_invariant", max_num_batched_tokens=64)
        assert old.engine.runner.uses_cuda_graphs, old.engine.runner.graph_error
        old_graphs = weakref.ref(old.engine.runner.graphs)
        del old
        assert old_graphs() is None  # no cycle: freed without the GC
        monkeypatch.setattr(cg, "capture_bucket", capture_with_gc)
        monkeypatch.setattr(sg, "capture_bucket", capture_with_gc)
        llm = _llm(model_dir, determinism="batch_invariant", max_num_batched_tokens=64)
    finally:
        gc.enable()
    assert llm.engine.runner.uses_cuda_graphs, llm.engine.runner.graph_error


def test_penalized_requests_run_ahead_with_the_step_by_step_bits(assets):
    """Penalties count a row's last token, which a step launched ahead only has on the device
    (the decode graphs' feed): the sampler adds it there, and the bits are step by step's."""
    model_dir, loras, prompts = assets
    n = 12
    params = [SamplingParams(max_tokens=12 + k, logprobs=1, ignore_eos=True, seed=k,
                             temperature=0.9 if k % 2 else 0.0,
                             repetition_penalty=(1.0, 2.0, 0.5)[k % 3],
                             frequency_penalty=(0.0, 1.5, -1.0)[k % 3],
                             presence_penalty=(2.0, 0.0, -2.0)[k % 3]) for k in range(n)]
    mixed = [loras[k % 2] if k % 3 else None for k in range(n)]
    llm = _llm(model_dir, determinism="batch_invariant")
    engine = llm.engine
    assert engine.run_ahead and engine.runner.uses_cuda_graphs
    ahead = llm.generate(prompts[:n], params, mixed, use_tqdm=False)
    launched_ahead = engine.num_steps_ahead
    engine.run_ahead = False
    step_by_step = llm.generate(prompts[:n], params, mixed, use_tqdm=False)
    assert launched_ahead > 0
    assert _diff(ahead, step_by_step) == []


def test_runs_ahead_while_requests_queue_for_a_slot(assets):
    """Four sequence slots for sixteen requests that stop at varied steps: with every slot
    taken, steps still run ahead (a freed slot is filled a step later), with the bits of
    step by step under batch_invariant."""
    model_dir, loras, prompts = assets
    n = len(prompts)
    stops = tuple(range(2, 2 + VOCAB // 12))
    params = [SamplingParams(max_tokens=6 + 2 * k, logprobs=0, stop_token_ids=stops,
                             **(dict(temperature=0.0) if k % 2 == 0 else
                                dict(temperature=0.9, seed=k)))
              for k in range(n)]
    mixed = [loras[k % 2] if k % 3 else None for k in range(n)]
    llm = _llm(model_dir, determinism="batch_invariant", max_num_seqs=4)
    engine = llm.engine
    ahead = llm.generate(prompts, params, mixed, use_tqdm=False)
    launched_ahead = engine.num_steps_ahead
    engine.run_ahead = False
    step_by_step = llm.generate(prompts, params, mixed, use_tqdm=False)
    assert launched_ahead > 0
    assert _diff(ahead, step_by_step) == []


def _arrivals(engine, prompts, loras) -> list:
    """Requests added one every other step while others run (a server's pattern); the
    sequences in arrival order, run to the end."""
    stops = tuple(range(2, 2 + VOCAB // 12))
    seqs = []
    for k, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=10 + 2 * k, logprobs=0, stop_token_ids=stops,
                                **(dict(temperature=0.0) if k % 2 == 0 else
                                   dict(temperature=0.9, top_p=0.9, seed=k)))
        seqs.append(engine.add_request(prompt, params, lora=loras[k % 2] if k % 3 else None))
        engine.step_sequences()
        engine.step_sequences()
    while engine.has_unfinished():
        engine.step_sequences()
    return seqs


@pytest.mark.parametrize("step_graphs", [True, False], ids=["step_graphs", "eager_mixed"])
def test_arrivals_join_steps_launched_ahead_with_the_step_by_step_bits(assets, monkeypatch,
                                                                     step_graphs):
    """A request that arrives while a step is in flight prefills in the step launched ahead,
    beside decodes whose input ids are the device's fed tokens: replayed from the step
    graphs, or eager while the decode graphs hold the feed; batch_invariant bits of step by
    step."""
    import detlora.engine.runner.step_graphs as sg

    model_dir, loras, prompts = assets
    if not step_graphs:
        monkeypatch.setattr(sg, "TOKEN_BUCKETS", ())
    llm = _llm(model_dir, determinism="batch_invariant")
    engine = llm.engine
    assert engine.run_ahead and engine.runner.uses_cuda_graphs
    assert (engine.runner.step_graphs is not None) == step_graphs
    ahead = _arrivals(engine, prompts, loras)
    admitted = engine.num_admitted_ahead
    engine.run_ahead = False
    step_by_step = _arrivals(engine, prompts, loras)
    assert admitted >= len(prompts) // 2
    assert engine.num_admitted_ahead == admitted
    for k, (a, b) in enumerate(zip(ahead, step_by_step, strict=True)):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs, k
    assert engine.block_manager.num_free == engine.block_manager.num_blocks


def test_logit_adjustments_are_batch_invariant(assets):
    """Penalties (run ahead: the unread last token counted on the device), logit bias and
    allowed tokens on bf16 logits with CUDA graphs: alone and in a reversed batch beside plain
    rows, the same bits."""
    model_dir, loras, prompts = assets
    n = 9
    params = [SamplingParams(max_tokens=16, ignore_eos=True, logprobs=1, seed=k,
                             temperature=0.9 if k % 2 else 0.0, repetition_penalty=1.3,
                             presence_penalty=0.4, frequency_penalty=0.2) if k % 3 == 0 else
              SamplingParams(max_tokens=16, ignore_eos=True, logprobs=1, seed=k,
                             temperature=0.8, min_p=0.05,
                             allowed_token_ids=[5, 6, 7, 300]) if k % 3 == 1
              else SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1,
                                  logit_bias={11: 8.0, 12: -100.0})
              for k in range(n)]
    mixed = [loras[k % 2] if k % 4 else None for k in range(n)]
    llm = _llm(model_dir, determinism="batch_invariant")
    alone = _batched(llm, prompts[:n], params, mixed, 1)
    rev = llm.generate(prompts[:n][::-1], params[::-1], mixed[::-1], use_tqdm=False)[::-1]
    assert _diff(rev, alone) == []
    assert all(set(alone[k].outputs[0].token_ids) <= {5, 6, 7, 300} for k in (1, 4, 7))
    assert all(12 not in alone[k].outputs[0].token_ids for k in (2, 5, 8))

"""Running one step ahead (the GPU engine's default) gives the bits of running step by step.

On the CPU ``run_ahead`` is off (it only pays where the GPU lags the host); these tests turn
it on, so the eager path takes its input ids from the tokens the sampler left on the device.
The requests stop on stop tokens at varied steps (rows computed ahead for them are dropped),
have different lengths, ban stop tokens for a while (min_tokens), and run out of KV pages.
"""

import pytest
from tests.helpers.engine_outputs import random_prompts, same_outputs

from detlora.config import SamplingParams
from detlora.entrypoints.llm import LLM
from detlora.lora.request import LoRARequest

N = 8
STOPS = tuple(range(2, 14))  # ~10% of the tiny vocabulary: several requests stop early


def _params(k: int) -> SamplingParams:
    common = dict(max_tokens=6 + 2 * k, logprobs=k % 3, stop_token_ids=STOPS,
                  min_tokens=k % 4)
    if k % 2 == 0:
        return SamplingParams(**common, temperature=0.0)
    return SamplingParams(**common, temperature=0.9, top_p=0.9, top_k=50, seed=100 + k)


@pytest.fixture(scope="module")
def case(llama_dir, llama_adapters):
    loras = [LoRARequest(f"a{k}", k + 1, str(p)) for k, p in enumerate(llama_adapters)]
    prompts = random_prompts(N, seed=21)
    mixed = [loras[k % 2] if k % 3 else None for k in range(N)]
    params = [_params(k) for k in range(N)]
    return prompts, params, mixed


def _run(llama_dir, case, run_ahead: bool, prepare=None, **kw):
    """``prepare(engine)`` runs before generating (to watch the engine)."""
    prompts, params, mixed = case
    llm = LLM(str(llama_dir), enable_lora=True, max_loras=2, max_lora_rank=8, device="cpu",
              **kw)
    llm.engine.run_ahead = run_ahead
    if prepare is not None:
        prepare(llm.engine)
    outs = llm.generate(prompts, params, mixed, use_tqdm=False)
    return llm.engine, outs


@pytest.mark.parametrize("kw", [{}, {"num_kv_blocks": 14, "block_size": 4}],
                         ids=["plenty_of_pages", "preemption"])
def test_running_ahead_gives_the_same_outputs_and_steps(llama_dir, case, kw):
    base_engine, base = _run(llama_dir, case, False, **kw)
    engine, outs = _run(llama_dir, case, True, **kw)
    assert [o.request_id for o in outs] == [o.request_id for o in base]
    bad = [k for k, (a, b) in enumerate(zip(outs, base, strict=True)) if not same_outputs(a, b)]
    assert not bad, f"outputs {bad} differ when running ahead"
    # The case is a real one: some requests stopped early, some ran to their length.
    reasons = {o.outputs[0].finish_reason for o in base}
    assert reasons == {"stop", "length"}
    # A step launched ahead for a request that then stopped is one extra step at most per stop.
    stops = sum(o.outputs[0].finish_reason == "stop" for o in base)
    assert base_engine.num_steps <= engine.num_steps <= base_engine.num_steps + stops
    assert base_engine.num_steps_ahead == 0
    assert engine.num_steps_ahead > (0 if kw else engine.num_steps // 2)
    assert engine.block_manager.num_free == engine.block_manager.num_blocks
    assert not engine.has_unfinished() and engine._inflight is None
    if kw:
        assert engine.scheduler.num_preemptions > 0


def _penalized(k: int) -> SamplingParams:
    # Strong penalties, so a token left out of a row's counts changes what it samples next;
    # every fourth row has none (a logit bias instead), beside them in the same steps.
    common = dict(max_tokens=8 + k, logprobs=1, stop_token_ids=STOPS, min_tokens=2)
    if k % 4 == 3:
        common["logit_bias"] = {20 + k: 3.0}
    else:
        common |= dict(repetition_penalty=(1.0, 2.0, 0.5)[k % 3],
                       frequency_penalty=(0.0, 1.5, -1.0)[k % 3],
                       presence_penalty=(2.0, 0.0, -2.0)[k % 3])
    if k % 2 == 0:
        return SamplingParams(**common, temperature=0.0)
    return SamplingParams(**common, temperature=0.9, top_p=0.9, seed=200 + k)


@pytest.mark.parametrize("kw", [{}, {"num_kv_blocks": 14, "block_size": 4}],
                         ids=["plenty_of_pages", "preemption"])
def test_penalized_requests_run_ahead_with_the_same_outputs(llama_dir, case, kw):
    # Penalties count the row's last token, which a step launched ahead has only on the
    # device: the sampler adds it there (logit_adjust), so these requests run ahead too.
    prompts, _, mixed = case
    case = prompts, [_penalized(k) for k in range(N)], mixed
    base_engine, base = _run(llama_dir, case, False, **kw)
    engine, outs = _run(llama_dir, case, True, **kw)
    bad = [k for k, (a, b) in enumerate(zip(outs, base, strict=True)) if not same_outputs(a, b)]
    assert not bad, f"outputs {bad} differ when running ahead"
    assert engine.num_steps_ahead > (0 if kw else engine.num_steps // 2)
    assert base_engine.num_steps <= engine.num_steps
    if kw:
        assert engine.scheduler.num_preemptions > 0


def test_requests_queued_for_a_slot_do_not_stop_running_ahead(llama_dir, case):
    # Three sequence slots for eight requests: while every slot is taken the scheduler admits
    # nobody, so the next step is surely a decode of every running sequence. A slot freed by
    # a stop the host has not read is filled one step later than step by step; the CPU path
    # is batch-invariant, so the outputs stay the same.
    _, base = _run(llama_dir, case, False, max_num_seqs=3)
    queued = []

    def count_queued(engine):
        launch_ahead = engine._launch_ahead

        def counting(current):
            waiting = len(engine.scheduler.waiting)
            ahead = launch_ahead(current)
            if ahead is not None and waiting:
                queued.append(waiting)
            return ahead

        engine._launch_ahead = counting

    engine, outs = _run(llama_dir, case, True, count_queued, max_num_seqs=3)
    bad = [k for k, (a, b) in enumerate(zip(outs, base, strict=True)) if not same_outputs(a, b)]
    assert not bad, f"outputs {bad} differ when running ahead"
    assert len(queued) > 5  # steps launched ahead while requests queued
    assert not engine.has_unfinished() and engine._inflight is None
    assert engine.block_manager.num_free == engine.block_manager.num_blocks


def _arrivals(llama_dir, llama_adapters, run_ahead: bool):
    """Requests added while others run (a server's pattern: one arrival every other step,
    with free sequence slots), some sharing a running request's prompt prefix, some with
    adapters, some reading label logprobs; the engine and the sequences, in arrival order."""
    llm = LLM(str(llama_dir), enable_lora=True, max_loras=2, max_lora_rank=8, device="cpu",
              block_size=4)
    engine = llm.engine
    engine.run_ahead = run_ahead
    loras = [LoRARequest(f"a{k}", k + 1, str(p)) for k, p in enumerate(llama_adapters)]
    prompts = random_prompts(N, seed=33, lo=6, hi=20)
    seqs = []
    for k in range(N):
        lora = loras[k % 2] if k % 3 else None
        prompt = prompts[k]
        if k % 3 == 2:  # the previous request's first 9 tokens, and its adapter
            prompt, lora = prompts[k - 1][:9] + prompts[k][:5], loras[(k - 1) % 2]
        seqs.append(engine.add_request(
            prompt, _params(k) if k % 4 != 3 else _penalized(k), lora=lora,
            label_token_ids=[20, 21, 22] if k % 5 == 1 else None))
        engine.step_sequences()
        engine.step_sequences()
    while engine.has_unfinished():
        engine.step_sequences()
    return engine, seqs


def test_arrivals_join_steps_launched_ahead_with_the_same_outputs(llama_dir, llama_adapters):
    # A request that arrives while a step is in flight is admitted into the step launched
    # ahead (its prompt beside the running sequences' fed decodes) instead of stopping the
    # run-ahead; the batches differ from step by step, the bits do not.
    base_engine, base = _arrivals(llama_dir, llama_adapters, False)
    engine, seqs = _arrivals(llama_dir, llama_adapters, True)
    for k, (a, b) in enumerate(zip(seqs, base, strict=True)):
        assert a.finish_reason == b.finish_reason, k
        assert a.token_ids == b.token_ids, f"request {k}: tokens differ when running ahead"
        assert a.logprobs == b.logprobs, f"request {k}: logprobs differ"
        assert a.label_logprobs == b.label_logprobs, f"request {k}: label logprobs differ"
    assert base_engine.num_admitted_ahead == 0
    assert engine.num_admitted_ahead >= N // 2  # most arrivals joined a step launched ahead
    assert engine.num_steps_ahead > engine.num_steps // 2
    assert any(s.num_cached_tokens for s in seqs)  # prefix pages shared with running requests
    assert engine.block_manager.num_free == engine.block_manager.num_blocks
    assert engine._inflight is None


def test_waves_of_one_token_requests_prefill_ahead_with_the_same_outputs(llama_dir,
                                                                         llama_adapters):
    # Short requests (one token, some three, some reading label logprobs) queued for four
    # sequence slots: every step ends its one-token rows, so the next wave is admitted into
    # a step launched while they are still in flight (the rows that end are left out of it),
    # and the requests that go on decode beside the new prompts.
    loras = [LoRARequest(f"a{k}", k + 1, str(p)) for k, p in enumerate(llama_adapters)]
    prompts = random_prompts(24, seed=44, lo=3, hi=15)

    def run(run_ahead: bool):
        llm = LLM(str(llama_dir), enable_lora=True, max_loras=2, max_lora_rank=8,
                  device="cpu", max_num_seqs=4, block_size=4)
        engine = llm.engine
        engine.run_ahead = run_ahead
        seqs = [engine.add_request(p, SamplingParams(max_tokens=1 + 2 * (k % 5 == 4),
                                                     temperature=0.0, logprobs=1),
                                   lora=loras[k % 2] if k % 3 else None,
                                   label_token_ids=[20, 21] if k % 4 == 1 else None)
                for k, p in enumerate(prompts)]
        while engine.has_unfinished():
            engine.step_sequences()
        return engine, seqs

    base_engine, base = run(False)
    engine, seqs = run(True)
    for k, (a, b) in enumerate(zip(seqs, base, strict=True)):
        assert a.token_ids == b.token_ids, f"request {k}: tokens differ when running ahead"
        assert a.logprobs == b.logprobs, f"request {k}: logprobs differ"
        assert a.label_logprobs == b.label_logprobs, f"request {k}: label logprobs differ"
        assert a.finish_reason == b.finish_reason == "length"
    assert engine.num_admitted_ahead >= 16  # the waves after the first came in ahead
    assert engine.num_steps <= base_engine.num_steps
    assert engine.block_manager.num_free == engine.block_manager.num_blocks
    assert not engine.has_unfinished() and engine._inflight is None

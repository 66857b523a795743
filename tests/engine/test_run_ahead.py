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

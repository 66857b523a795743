"""Many adapters through few slots, end to end on the CPU: an adapter's outputs do not depend
on its slot, on the adapters resident beside it, on evictions and copies back (from the host
cache or from disk), nor on ``max_loras``; a working set larger than the slots gives every
request the bits it has alone. Token ids and logprobs compared with ==."""

from __future__ import annotations

import pytest
from tests.helpers.engine_outputs import random_prompts, same_outputs
from tests.helpers.tiny_hf import write_random_adapter

from detlora.config import SamplingParams
from detlora.entrypoints.llm import LLM
from detlora.lora.request import LoRARequest

SP = SamplingParams(max_tokens=5, logprobs=1, ignore_eos=True, temperature=0.0)
TARGETS = [None, ["q_proj", "v_proj"], ["o_proj", "gate_proj", "down_proj"]]


@pytest.fixture(scope="module")
def adapters(llama_dir, tmp_path_factory) -> list[LoRARequest]:
    root = tmp_path_factory.mktemp("many_adapters")
    return [LoRARequest(f"m{i}", 100 + i, str(write_random_adapter(
        llama_dir, root / f"m{i}", r=(2, 4, 8)[i % 3], alpha=8, targets=TARGETS[i % 3],
        seed=100 + i))) for i in range(64)]


def _llm(llama_dir, **kw) -> LLM:
    args = dict(enable_lora=True, max_loras=8, max_lora_rank=8, device="cpu",
                max_model_len=64, enable_prefix_caching=False)
    return LLM(str(llama_dir), **{**args, **kw})


def _run(llm, prompts, loras):
    return llm.generate(prompts, SP, loras, use_tqdm=False)


@pytest.mark.parametrize("level", ["batch_invariant", "run_to_run"])
def test_slot_residents_and_swaps_change_no_bit(llama_dir, adapters, level):
    target, others = adapters[0], adapters[1:]
    prompt = random_prompts(1, seed=21)[0]
    alone = _run(_llm(llama_dir, determinism=level), prompt, target)[0]
    llm = _llm(llama_dir, determinism=level, max_cpu_loras=16)
    manager = llm.engine.lora_manager
    fill = random_prompts(16, seed=22)
    _run(llm, fill[:7], others[:7])  # slots 0..6
    assert same_outputs(_run(llm, prompt, target)[0], alone)
    assert manager.slot_of(target.id) == 7
    _run(llm, fill[:8], others[7:15])  # evicts it from its slot, not from the host cache
    assert manager.slot_of(target.id) is None and target.id in manager.host.cached()
    swaps, loads = manager.stats.swaps, manager.loads
    assert same_outputs(_run(llm, prompt, target)[0], alone)  # copied back from host memory
    assert manager.stats.swaps == swaps + 1 and manager.loads == loads
    for k in (15, 23):  # 16 others: out of the host cache too
        _run(llm, fill[:8], others[k: k + 8])
    assert target.id not in manager.host.cached()
    loads = manager.loads
    assert same_outputs(_run(llm, prompt, target)[0], alone)  # read from disk again
    assert manager.loads == loads + 1


def test_sixty_three_residents_and_any_max_loras(llama_dir, adapters):
    target, others = adapters[0], adapters[1:]
    prompt = random_prompts(1, seed=23)[0]
    ref = _run(_llm(llama_dir, max_loras=1), prompt, target)[0]
    llm = _llm(llama_dir, max_loras=64)
    _run(llm, random_prompts(63, seed=24, hi=8), others)
    out = _run(llm, prompt, target)[0]
    assert len(llm.engine.lora_manager.resident()) == 64
    assert same_outputs(out, ref)
    assert out.fingerprint == ref.fingerprint  # max_loras is not part of it at batch_invariant


def test_working_set_larger_than_the_slots(llama_dir, adapters):
    """24 requests over 12 adapters through 2 slots and a host cache of 4, in waves: each gets
    the bits it has alone, and the adapters were swapped, read and prefetched as counted."""
    loras = [adapters[i % 12] for i in range(24)]
    prompts = random_prompts(24, seed=25, hi=12)
    solo = _llm(llama_dir, max_loras=1)
    alone = [_run(solo, p, r)[0] for p, r in zip(prompts, loras, strict=True)]
    llm = _llm(llama_dir, max_loras=2, max_cpu_loras=4)
    outs = _run(llm, prompts, loras)
    bad = [k for k, (a, b) in enumerate(zip(outs, alone, strict=True)) if not same_outputs(a, b)]
    assert not bad
    stats = llm.engine.lora_stats
    # Grouped by adapter: each adapter's two requests ran in one wave, so it was copied into
    # a slot once (demand or prefetch) and read once (the host cache holds 4).
    assert stats.swaps == 12 and stats.disk_loads == 12
    assert stats.slot_misses + stats.prefetch_swaps == 12


def test_running_ahead_while_requests_wait_for_adapter_slots(llama_dir, adapters):
    """While every waiting request waits for an adapter slot, the engine launches the next
    decode step before reading the last one (as when nothing waits), with the same bits."""
    loras = [adapters[i % 6] for i in range(12)]
    prompts = random_prompts(12, seed=26, hi=10)
    params = [SamplingParams(max_tokens=3 + k % 5, logprobs=1, temperature=0.0,
                             stop_token_ids=tuple(range(2, 12))) for k in range(12)]
    outs, engines = {}, {}
    for ahead in (False, True):
        llm = _llm(llama_dir, max_loras=2)
        llm.engine.run_ahead = ahead
        outs[ahead] = llm.generate(prompts, params, loras, use_tqdm=False)
        engines[ahead] = llm.engine
    bad = [k for k, (a, b) in enumerate(zip(outs[True], outs[False], strict=True))
           if not same_outputs(a, b)]
    assert not bad
    assert engines[False].num_steps_ahead == 0 and engines[True].num_steps_ahead > 0


def test_adapters_copied_into_free_slots_ahead_of_their_step(llama_dir, adapters):
    """Four sequence slots, eight adapter slots: while four requests run, the next ones'
    adapters (read into the host cache by add_lora) are copied into the free slots ahead of
    the steps that admit them; the outputs are those of each request alone."""
    loras = adapters[:12]
    prompts = random_prompts(12, seed=27, hi=10)
    solo = _llm(llama_dir, max_loras=1)
    alone = [_run(solo, p, r)[0] for p, r in zip(prompts, loras, strict=True)]
    llm = _llm(llama_dir, max_loras=8, max_num_seqs=4)
    for r in loras:
        assert llm.add_lora(r)
    stats = llm.engine.lora_stats
    assert stats.disk_loads == 12 and stats.swaps == 0
    outs = _run(llm, prompts, loras)
    assert all(same_outputs(a, b) for a, b in zip(outs, alone, strict=True))
    assert stats.prefetch_swaps > 0 and stats.host_misses == 0 and stats.disk_loads == 12
    assert stats.slot_hits >= stats.prefetch_swaps  # each prefetched adapter was then used


def test_next_wave_adapters_copied_behind_the_last_step_of_a_wave(llama_dir, adapters):
    """Waves of equal-length requests fill every adapter slot: when a wave's last step is
    launched, its slots are idle from then on, so the next wave's adapters (in the host
    cache) are copied into them behind that step instead of when the next wave is admitted;
    every request keeps the bits it has alone."""
    loras = [adapters[i % 8] for i in range(16)]
    prompts = random_prompts(16, seed=28, hi=10)
    solo = _llm(llama_dir, max_loras=1)
    alone = [_run(solo, p, r)[0] for p, r in zip(prompts, loras, strict=True)]
    llm = _llm(llama_dir, max_loras=2)
    for r in adapters[:8]:
        assert llm.add_lora(r)  # into the host cache (and the first two into slots)
    stats = llm.engine.lora_stats
    before = stats.as_dict()
    outs = _run(llm, prompts, loras)
    assert all(same_outputs(a, b) for a, b in zip(outs, alone, strict=True))
    swaps = stats.swaps - before["swaps"]
    ahead = stats.prefetch_swaps - before["prefetch_swaps"]
    # The first wave's two adapters come on demand (add_lora left the last two in the
    # slots); every later wave's came ahead.
    assert swaps == 8 and ahead == 6
    assert stats.slot_misses - before["slot_misses"] == 2

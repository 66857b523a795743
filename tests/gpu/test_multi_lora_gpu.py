"""Many adapters through few slots on CUDA (graphs on): an adapter's outputs do not depend on
its slot, on the adapters resident beside it, on evictions and copies back (from pinned host
memory on the side stream, or from disk), nor on ``max_loras``; slots written ahead of their
step while another step runs give the same bits. Token ids and logprobs compared with ==.

A small random bf16 Llama and adapters of mixed ranks and targets are written with
safetensors here (no transformers or peft needed on the GPU machine).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tests.helpers.bf16_llama import write_bf16_llama

from detlora.config import SamplingParams
from detlora.engine.runner.decode_graphs import NARROW_GROUPS
from detlora.entrypoints.llm import LLM
from detlora.lora.request import LoRARequest

pytestmark = pytest.mark.gpu

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, INTER = 512, 256, 2, 4, 2, 512
HEAD_DIM = HIDDEN // HEADS
SP = SamplingParams(max_tokens=8, logprobs=1, ignore_eos=True, temperature=0.0)
TARGET_SETS = [("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
               ("q_proj", "v_proj"), ("o_proj", "gate_proj", "down_proj")]
RANKS = (4, 8, 16)


def _rnd(g: torch.Generator, *size: int, std: float) -> torch.Tensor:
    return (torch.randn(*size, generator=g) * std).to(torch.bfloat16)


def _write_model(path: Path) -> None:
    write_bf16_llama(path, vocab=VOCAB, hidden=HIDDEN, layers=LAYERS, heads=HEADS,
                     kv_heads=KV_HEADS, head_dim=HEAD_DIM, inter=INTER,
                     proj_std=0.06, down_std=0.04)


def _write_adapter(path: Path, seed: int) -> None:
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    rank, targets = RANKS[seed % 3], TARGET_SETS[seed % 3]
    kv = KV_HEADS * HEAD_DIM
    dims = {"q_proj": (HIDDEN, HIDDEN), "k_proj": (HIDDEN, kv), "v_proj": (HIDDEN, kv),
            "o_proj": (HIDDEN, HIDDEN), "gate_proj": (HIDDEN, INTER),
            "up_proj": (HIDDEN, INTER), "down_proj": (INTER, HIDDEN)}
    w = {}
    for i in range(LAYERS):
        for name in targets:
            fin, fout = dims[name]
            part = "self_attn" if name in TARGET_SETS[0][:4] else "mlp"
            p = f"base_model.model.model.layers.{i}.{part}.{name}."
            w[p + "lora_A.weight"] = _rnd(g, rank, fin, std=fin**-0.5)
            w[p + "lora_B.weight"] = _rnd(g, fout, rank, std=0.05)
    path.mkdir(parents=True)
    save_file(w, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets),
        "bias": "none", "use_rslora": seed % 2 == 1}))


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("multi_lora_gpu")
    _write_model(root / "model")
    adapters = []
    for i in range(64):
        _write_adapter(root / f"a{i}", seed=i)
        adapters.append(LoRARequest(f"a{i}", i + 1, str(root / f"a{i}")))
    prompts = torch.randint(2, VOCAB, (64, 12), generator=torch.Generator().manual_seed(1))
    return root / "model", adapters, prompts.tolist()


def _llm(model: Path, **kw) -> LLM:
    # Few token buckets: fewer step graphs to capture per engine (ten engines in this file).
    args = dict(enable_lora=True, max_loras=8, max_lora_rank=16, max_model_len=128,
                max_num_seqs=64, max_num_batched_tokens=256, num_kv_blocks=256,
                enable_prefix_caching=False)
    return LLM(str(model), **{**args, **kw})


def _same(a, b) -> bool:
    x, y = a.outputs[0], b.outputs[0]
    return x.token_ids == y.token_ids and x.logprobs == y.logprobs


@pytest.mark.parametrize("level", ["batch_invariant", "run_to_run"])
def test_slot_residents_and_swaps_change_no_bit(assets, level):
    """The same request alone (the same batch) with its adapter in slot 0, in slot 7 beside
    seven others, copied back from the host cache, and read again from disk."""
    model, adapters, prompts = assets
    target, others = adapters[0], adapters[1:]
    fresh = _llm(model, determinism=level)
    alone = fresh.generate(prompts[0], SP, target, use_tqdm=False)[0]
    assert fresh.engine.lora_manager.slot_of(target.id) == 0
    assert fresh.engine.runner.uses_cuda_graphs
    del fresh
    llm = _llm(model, determinism=level, max_cpu_loras=16)
    manager = llm.engine.lora_manager

    def again() -> bool:
        return _same(llm.generate(prompts[0], SP, target, use_tqdm=False)[0], alone)

    llm.generate(prompts[1:8], SP, others[:7], use_tqdm=False)
    assert again() and manager.slot_of(target.id) == 7
    llm.generate(prompts[1:9], SP, others[7:15], use_tqdm=False)
    assert manager.slot_of(target.id) is None and target.id in manager.host.cached()
    assert again() and manager.stats.host_hits >= 1
    for k in (15, 23):
        llm.generate(prompts[1:9], SP, others[k: k + 8], use_tqdm=False)
    assert target.id not in manager.host.cached()
    loads = manager.loads
    assert again() and manager.loads == loads + 1


def test_sixty_three_residents_and_any_max_loras(assets):
    model, adapters, prompts = assets
    target, others = adapters[0], adapters[1:]
    one = _llm(model, max_loras=1)
    ref = one.generate(prompts[:4], SP, [target] * 4, use_tqdm=False)
    del one
    many = _llm(model, max_loras=64)
    many.generate(prompts[:63], SP, others, use_tqdm=False)
    outs = many.generate(prompts[:4], SP, [target] * 4, use_tqdm=False)
    assert len(many.engine.lora_manager.resident()) == 64
    # The last decode steps had one adapter: they replayed the narrow graphs.
    assert many.engine.runner.graphs.last_replayed == (4, NARROW_GROUPS)
    assert all(_same(a, b) for a, b in zip(outs, ref, strict=True))
    assert [o.fingerprint for o in outs] == [o.fingerprint for o in ref]


def test_working_set_larger_than_the_slots(assets):
    """48 requests over 24 adapters through 4 slots and a host cache of 8, in one call: each
    request's bits are those it has alone."""
    model, adapters, prompts = assets
    loras = [adapters[k % 24] for k in range(48)]
    solo = _llm(model, max_loras=1)
    alone = [solo.generate(prompts[k % 64], SP, loras[k], use_tqdm=False)[0] for k in range(48)]
    del solo
    llm = _llm(model, max_loras=4, max_cpu_loras=8)
    outs = llm.generate([prompts[k % 64] for k in range(48)], SP, loras, use_tqdm=False)
    bad = [k for k in range(48) if not _same(outs[k], alone[k])]
    assert not bad
    stats = llm.engine.lora_stats
    assert stats.swaps >= 24 and stats.disk_loads >= 24


def test_slots_written_ahead_while_a_step_runs(assets):
    """Few sequence slots, many adapter slots: adapters are copied into free slots on the side
    stream while the running requests decode; every output is the one it has alone."""
    model, adapters, prompts = assets
    loras = adapters[:24]
    solo = _llm(model, max_loras=1)
    alone = [solo.generate(prompts[k], SP, loras[k], use_tqdm=False)[0] for k in range(24)]
    del solo
    llm = _llm(model, max_loras=16, max_num_seqs=4)
    for r in loras:
        llm.add_lora(r)
    outs = llm.generate(prompts[:24], SP, loras, use_tqdm=False)
    assert all(_same(a, b) for a, b in zip(outs, alone, strict=True))
    stats = llm.engine.lora_stats
    assert stats.prefetch_swaps > 0 and stats.host_misses == 0


def test_next_wave_copied_behind_the_last_step_of_a_wave(assets):
    """Waves of equal-length requests over 4 slots: the next wave's adapters are copied into
    the slots of the wave whose last step is in flight (the copy waits for that step on the
    side stream); every output is the one it has alone, and the slots hold exactly what the
    CPU path's torch copies give."""
    model, adapters, prompts = assets
    loras = [adapters[k % 16] for k in range(32)]
    solo = _llm(model, max_loras=1)
    alone = [solo.generate(prompts[k], SP, loras[k], use_tqdm=False)[0] for k in range(32)]
    del solo
    llm = _llm(model, max_loras=4)
    for r in adapters[:16]:
        llm.add_lora(r)
    stats = llm.engine.lora_stats
    ahead = stats.prefetch_swaps
    outs = llm.generate(prompts[:32], SP, loras, use_tqdm=False)
    assert all(_same(a, b) for a, b in zip(outs, alone, strict=True))
    assert stats.prefetch_swaps - ahead >= 12  # waves 2-4 came ahead
    manager = llm.engine.lora_manager
    torch.cuda.synchronize()
    for req in adapters[12:16]:  # the last wave's, written by copy_pieces: against torch

        slot = manager.slot_of(req.id)
        if slot is None:
            continue
        image, _ = manager.host.get(req)
        want = [[t[slot].clone() for t in (lin.lora.lora_a, lin.lora.lora_b,
                                            lin.lora.lora_scale)] for lin, _ in manager._linears]
        for lin, _ in manager._linears:
            lin.lora.lora_a[slot].fill_(float("nan"))
            lin.lora.lora_b[slot].fill_(float("nan"))
        manager.writer.cuda = False  # the torch copies, from the pinned image
        try:
            manager.writer._fill(slot, image, image.block.data.cuda())
        finally:
            manager.writer.cuda = True
        manager.host.release(image)
        got = [[t[slot] for t in (lin.lora.lora_a, lin.lora.lora_b, lin.lora.lora_scale)]
               for lin, _ in manager._linears]
        assert all(torch.equal(a, b) for xs, ys in zip(got, want, strict=True)
                   for a, b in zip(xs, ys, strict=True))


@pytest.mark.parametrize("m", [1, 64, 300])
def test_in_gemm_linear_skips_unused_slots_in_bf16(m):
    """Llama-3.1-8B's q|k|v with 64 rank-16 slots, one or two in use: unused slots' tiles write
    nothing (split path), every written column has the bits of a linear with the base's K
    split, and the base columns those of the plain linear."""
    from detlora.ops import matmul as mm
    from detlora.ops.adapter_groups import group_tokens
    from detlora.ops.slot_columns import SlotColumns

    base, width, slots, k = 6144, 48, 64, 4096
    g = torch.Generator(device="cuda").manual_seed(m)
    w = (torch.randn(base + slots * width, k, generator=g, device="cuda") / 64).bfloat16()
    x = torch.randn(m, k, generator=g, device="cuda").bfloat16()
    token_slots = torch.tensor([(3, 41, -1)[r % 3] for r in range(m)], dtype=torch.int32,
                               device="cuda")
    cols = SlotColumns(base, width, group_tokens(token_slots, slots))
    out = torch.full((m, w.shape[0]), float("nan"), dtype=torch.bfloat16, device="cuda")
    mm.linear(x, w, out=out, slot_columns=cols)
    plain = mm.linear(x, w[:base])
    assert torch.equal(out[:, :base], plain)
    cfg = mm.matmul_config(m, w.shape[0], k, split_n=base)
    full = mm.linear(x, w, config=cfg)
    in_use = sorted({(3, 41, -1)[r % 3] for r in range(m)} - {-1})  # m=1: slot 3 only
    used = [range(base + s * width, base + (s + 1) * width) for s in in_use]
    for span in used:
        assert torch.equal(out[:, span.start: span.stop], full[:, span.start: span.stop])
    if cfg.split_ctas:  # decode: most unused slots' columns were never written
        assert out[:, base:].isnan().all(0).sum() >= slots * width // 2

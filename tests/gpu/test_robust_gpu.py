"""The engine on CUDA when numbers go bad and engines come and go.

* A row whose logits are not finite ends with finish_reason "error" at every level, eager
  and with CUDA graphs (the decode and step graphs compute the finite flag inside the graph,
  in the greedy head; the engine runs one step ahead with graphs): an adapter whose
  ``lora_alpha`` (1e38) overflows errors at its first token, a NaN embedding row breaks the
  one sequence that feeds that token mid-decode. No id outside the vocabulary comes out; the
  other rows keep their bits: against the batch without the bad row (batch_invariant), or a
  twin batch of the same shapes (run_to_run). ``fast`` promises no bits: there the other rows
  only finish normally.
* Engines built one after another at the default memory utilization, ten times in one
  process: each one's memory is back to the baseline once it is dropped (or shut down), and
  the next one finds room for its KV cache.

The CPU proves the same logic (tests/engine/test_nonfinite_logits.py,
tests/engine/test_engine_release.py).
"""

from __future__ import annotations

import json
import shutil
import time

import pytest
import torch
from tests.gpu.test_engine_gpu import RANK, VOCAB, _write_adapter, _write_model

from detlora.config import SamplingParams
from detlora.entrypoints.llm import LLM
from detlora.lora.request import LoRARequest

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
LEVELS = ("fast", "run_to_run", "batch_invariant")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("robust_gpu")
    _write_model(root / "model")
    for k in range(2):
        _write_adapter(root / f"a{k}", seed=10 + k)
    shutil.copytree(root / "a0", root / "big")
    cfg = json.loads((root / "big" / "adapter_config.json").read_text())
    (root / "big" / "adapter_config.json").write_text(json.dumps({**cfg, "lora_alpha": 1e38}))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, VOCAB, (int(n),), generator=g).tolist()
               for n in torch.randint(5, 60, (8,), generator=g)]
    loras = {name: LoRARequest(name, k + 1, str(root / name))
             for k, name in enumerate(("a0", "a1", "big"))}
    loras["twin"] = LoRARequest("twin", 9, str(root / "a0"))  # big's shapes, finite numbers
    return root / "model", loras, prompts


def _llm(model_dir, level, eager, **kw) -> LLM:
    args = dict(enable_lora=True, max_loras=3, max_lora_rank=RANK, device=DEVICE,
                max_num_seqs=16, num_kv_blocks=256, max_num_batched_tokens=512,
                enable_prefix_caching=False, determinism=level, enforce_eager=eager)
    return LLM(str(model_dir), **{**args, **kw})


def _params(n: int, max_tokens: int = 12) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=max_tokens, logprobs=0, ignore_eos=True, temperature=0.0)
            if k % 2 == 0
            else SamplingParams(max_tokens=max_tokens, logprobs=1, ignore_eos=True,
                                temperature=0.8, top_p=0.95, seed=k)
            for k in range(n)]


def _same(a, b) -> bool:
    x, y = a.outputs[0], b.outputs[0]
    return (torch.equal(torch.tensor(x.token_ids), torch.tensor(y.token_ids))
            and x.logprobs == y.logprobs)


def _check_error(out, who: str) -> None:
    c = out.outputs[0]
    assert c.finish_reason == "error", c
    assert who in c.error and "not finite" in c.error and "engine step" in c.error, c.error


def _check_vocab(outs) -> None:
    for o in outs:
        assert all(0 <= t < VOCAB for t in o.outputs[0].token_ids), o.outputs[0].token_ids


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_an_overflowing_adapter_row_errors_and_the_others_keep_their_bits(assets, level,
                                                                          eager):
    model_dir, loras, prompts = assets
    mix = [None, loras["a0"], loras["big"], loras["a1"], None, loras["a0"]]
    params = _params(len(mix))
    params[2] = SamplingParams(max_tokens=1, logprobs=0, temperature=0.0)  # its twin too
    prompts = prompts[: len(mix)]
    llm = _llm(model_dir, level, eager)
    assert llm.engine.runner.uses_cuda_graphs is not eager, llm.engine.runner.graph_error
    outs = llm.generate(prompts, params, mix, use_tqdm=False)
    _check_error(outs[2], "adapter 'big'")
    _check_vocab(outs)
    keep = [0, 1, 3, 4, 5]
    assert all(outs[k].outputs[0].finish_reason == "length" for k in keep)
    twin = llm.generate(prompts, params, [*mix[:2], loras["twin"], *mix[3:]], use_tqdm=False)
    assert twin[2].outputs[0].finish_reason == "length"
    if level != "fast":
        assert [k for k in keep if not _same(outs[k], twin[k])] == []
    if level == "batch_invariant":
        alone = llm.generate([prompts[k] for k in keep], [params[k] for k in keep],
                             [mix[k] for k in keep], use_tqdm=False)
        assert [k for k, a in zip(keep, alone, strict=True) if not _same(outs[k], a)] == []
    again = llm.generate(prompts[2], SamplingParams(max_tokens=4), loras["big"],
                         use_tqdm=False)
    _check_error(again[0], "adapter 'big'")
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("level", ["run_to_run", "batch_invariant"])
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_a_row_that_turns_non_finite_mid_decode(assets, level, eager):
    """A NaN embedding row (set after loading) breaks the sequence that feeds that token, in a
    decode step: a decode graph's replay with graphs, one step ahead of the host. (Not at
    ``fast``: a rerun there may not even produce the same tokens before the bad one.)"""
    model_dir, loras, prompts = assets
    mix = [None, loras["a0"], None, loras["a1"], None, loras["a0"], None, None]
    params = _params(len(mix))
    llm = _llm(model_dir, level, eager)
    clean = llm.generate(prompts, params, mix, use_tqdm=False)
    r, token = None, None
    for k, o in enumerate(clean):
        ids = o.outputs[0].token_ids
        others = {x for j, p in enumerate(prompts) if j != k for x in p}
        others |= {x for j, oo in enumerate(clean) if j != k for x in oo.outputs[0].token_ids}
        if ids[1] != 0 and ids[1] not in others | set(prompts[k]) | {ids[0]}:
            r, token = k, ids[1]
            break
    assert r is not None, "no row with a private second token"
    with torch.no_grad():
        llm.engine.model.embed_tokens.weight[token] = float("nan")
    steps_ahead = llm.engine.num_steps_ahead
    outs = llm.generate(prompts, params, mix, use_tqdm=False)
    c = outs[r].outputs[0]
    assert c.finish_reason == "error" and c.token_ids == clean[r].outputs[0].token_ids[:2], c
    assert "when sampling output token 3" in c.error, c.error
    _check_vocab(outs)
    others = [k for k in range(len(mix)) if k != r]
    assert all(outs[k].outputs[0].finish_reason == "length" for k in others)
    if level == "batch_invariant":
        assert [k for k in others if not _same(outs[k], clean[k])] == []
    if not eager:
        assert llm.engine.num_steps_ahead > steps_ahead  # ran ahead through the error


def _allocated() -> int:
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def test_engines_built_one_after_another_release_their_memory(assets):
    """Ten engines at the default gpu_memory_utilization (each sizes its KV cache to fill it),
    dropped, shut down, or closed by ``with``: the memory comes back every time. The first
    engine leaves the per-device kernel workspaces behind (shared by every engine); from
    then on the allocated bytes return to that baseline exactly."""
    model_dir, loras, prompts = assets
    ask = prompts[:4]
    params = SamplingParams(max_tokens=4)
    mix = [None, loras["a0"], loras["a1"], None]
    start = _allocated()
    baseline = None
    seconds = []
    for k in range(10):
        t = time.perf_counter()
        llm = LLM(str(model_dir), enable_lora=True, max_loras=2, max_lora_rank=RANK,
                  device=DEVICE, seed=k)
        assert llm.engine.runner.uses_cuda_graphs, llm.engine.runner.graph_error
        assert _allocated() > 0.5 * torch.cuda.get_device_properties(0).total_memory
        if k % 3 == 0:
            outs = llm.generate(ask, params, mix, use_tqdm=False)
            del llm
        elif k % 3 == 1:
            outs = llm.generate(ask, params, mix, use_tqdm=False)
            llm.shutdown()
            assert _allocated() <= (baseline if baseline is not None else start + 2**30)
            del llm
        else:
            with llm:
                outs = llm.generate(ask, params, mix, use_tqdm=False)
            del llm
        assert [o.outputs[0].finish_reason for o in outs] == ["length"] * 4
        del outs
        now = _allocated()
        if baseline is None:
            assert now - start < 2**30, f"{(now - start) / 2**20:.0f} MiB left by the first"
            baseline = now
        assert now == baseline, f"engine {k}: {(now - baseline) / 2**20:.1f} MiB still held"
        seconds.append(time.perf_counter() - t)
    print(f"build+generate+release: {[round(s, 2) for s in seconds]} s")

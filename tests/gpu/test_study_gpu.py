"""``detlora study`` on a GPU: the quick study on the tiny model runs every section, with its
promises kept (deterministic configurations repeat, batch_invariant holds across batches),
and the trace's hooks work on CUDA (continuing from an engine's own KV cache gives its
tokens)."""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_quick_study_on_the_gpu(tmp_path):
    from detlora.study.run import run_study

    result = run_study(["tiny"], out=tmp_path, quick=True, device="cuda", progress=False)
    data = json.loads((tmp_path / "study.json").read_text())
    assert data["meta"]["gpu"] and not data["meta"]["errors"]
    assert all(r["bits_changed"] == 0 for r in data["repeat"] if r["reduction"] != "atomic")
    assert all(r["differing"] == 0 for r in data["replay"] if r["reduction"] != "atomic")
    assert all(r["changed"] == 0 for r in data["decisions"]
               if r["reduction"] != "atomic" and r["check"] == "repeat")
    bi = [r for r in data["cross_batch"] if r["level"] == "batch_invariant"]
    assert len(bi) == 8 and all(r["bits_changed"] == 0 for r in bi)
    perf = data["performance"]
    assert len(perf) == 8 * 2 and all(r["output_tok_per_s"] > 0 for r in perf)
    assert all("e2e_vs_atomic" in r for r in perf)
    assert (tmp_path / "latency.png").exists()
    assert result.meta["seconds"] > 0


def test_continue_from_its_own_kv_on_cuda(tmp_path):
    from detlora import LLM, LoRARequest, SamplingParams
    from detlora.engine.introspect import continue_from_kv, observe, read_kv
    from detlora.entrypoints.demo import build_demo_assets

    model, adapters = build_demo_assets(tmp_path)
    llm = LLM(str(model), enable_lora=True, max_loras=1, max_lora_rank=8,
              determinism="batch_invariant", enforce_eager=True, device="cuda",
              max_num_seqs=4, enable_prefix_caching=False)
    lora = LoRARequest("a", 1, str(adapters[0]))
    prompt = [8, 9, 10, 11, 12, 13, 14, 15, 16]
    eight_greedy = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)
    ks, vs, shrinks = [], [], []

    def on_step(step, logits):
        k, v = read_kv(llm.engine, step.slot_mapping)
        ks.append(k)
        vs.append(v)

    with observe(llm.engine, on_step=on_step, on_shrink=lambda n, h: shrinks.append(h)):
        out = llm.generate([prompt], eight_greedy, lora,
                           use_tqdm=False)[0]
    assert shrinks and all(h.is_cuda and h.dtype == torch.float32 for h in shrinks)
    tokens = out.outputs[0].token_ids
    k, v = torch.cat(ks, dim=1), torch.cat(vs, dim=1)
    cut = len(prompt) + 3
    got = continue_from_kv(llm.engine, prompt + tokens[:4], k[:, :cut], v[:, :cut], lora=lora,
                           max_tokens=4)
    assert [t.token_id for t in got] == tokens[4:]

"""The start-up steps that compile the eager path's kernel variants (engine/runner/
eager_warmup.py): each is larger than every step graph, within the scheduler's budgets, meets
one attention numbering (equal prompts; prompts beside up to 128 and past 128 sequences), and
running them changes nothing: the KV cache and the outputs after them are bit for bit those
of an engine that never ran them."""

import torch
from tests.engine.runner.test_step_graph_inputs import PAGE, _engine, _Uncaptured
from tests.helpers.engine_outputs import random_prompts, same_outputs

from detlora.config import SamplingParams
from detlora.engine.runner.eager_warmup import eager_warmup_steps
from detlora.engine.runner.step_graphs import step_graph_buckets
from detlora.lora.request import LoRARequest
from detlora.ops.paged_attention import AttentionProblem, search_block, tile_slots

DEFAULTS = dict(graph_tokens=2048, graph_seqs=256, max_num_batched_tokens=8192,
                max_num_seqs=256, max_model_len=512, block_size=16, num_adapters=4)


def _numbering(step, block_q=21):
    problem = AttentionProblem(num_tokens=step.num_tokens, num_q_heads=24, num_kv_heads=8,
                               head_dim=128, num_seqs=step.num_seqs, page_size=16,
                               max_blocks=32, max_query_len=step.max_query_len)
    _, _, search = tile_slots(problem, block_q)
    return search, search_block(step.num_seqs) if search else None


def test_steps_exceed_the_graphs_and_meet_each_numbering():
    steps = eager_warmup_steps(**DEFAULTS)
    assert [_numbering(s) for s in steps] == [(False, None), (True, 128), (True, 1024)]
    for s in steps:
        assert 2048 < s.num_tokens <= 8192 and s.num_seqs <= 256
        assert set(s.slot_mapping) == {-1}  # nothing written
        assert max(s.positions) < 512 and s.query_start_loc[-1] == s.num_tokens
        assert s.logits_indices == [q - 1 for q in s.query_start_loc[1:]]
        assert {-1, 0} <= set(s.token_adapter)  # rows with and without an adapter
    # Up to 64 sequences: no step past 128, so no second search block.
    few = eager_warmup_steps(**{**DEFAULTS, "max_num_seqs": 64, "graph_seqs": 64})
    assert [_numbering(s) for s in few] == [(False, None), (True, 128)]


def test_no_steps_when_the_graphs_hold_every_step():
    assert eager_warmup_steps(**{**DEFAULTS, "max_num_batched_tokens": 2048}) == []


def test_warm_steps_change_no_state(request):
    """A CPU engine runs the warm-up steps (small step buckets stand in for the GPU's graphs):
    its KV cache is unchanged and its outputs equal a fresh engine's, bit for bit."""
    model_dir = request.getfixturevalue("llama_dir")
    loras = [LoRARequest(f"a{k}", k + 1, str(p))
             for k, p in enumerate(request.getfixturevalue("llama_adapters"))]
    prompts = random_prompts(6, seed=3, lo=3, hi=18)
    params = SamplingParams(temperature=0.0, max_tokens=5, logprobs=1, ignore_eos=True)
    mixed = [loras[k % 2] if k % 3 else None for k in range(6)]
    outs = []
    for warm in (False, True):
        llm = _engine(model_dir, False, block_size=PAGE, max_model_len=24)
        llm.generate(prompts[:2], params, mixed[:2], use_tqdm=False)  # adapters in slots
        runner = llm.engine.runner
        if warm:
            runner.step_graphs = _Uncaptured(
                runner._decode_forward, device=runner.device, feed=runner._feed,
                buckets=step_graph_buckets(16, 4), block_size=runner.block_size,
                max_blocks_per_seq=-(-runner.max_model_len // runner.block_size),
                max_model_len=runner.max_model_len, num_adapters=runner.num_adapters)
            kv = [t.clone() for pair in runner.kv_cache for t in pair]
            runner.warm_eager_steps(max_num_seqs=8, max_num_batched_tokens=64)
            after = [t for pair in runner.kv_cache for t in pair]
            assert all(torch.equal(a, b) for a, b in zip(kv, after, strict=True))
            runner.step_graphs = None
        outs.append(llm.generate(prompts, params, mixed, use_tqdm=False))
    assert all(same_outputs(a, b) for a, b in zip(*outs, strict=True))

    # ... and it ran real steps: the small buckets leave two steps past them.
    steps = eager_warmup_steps(graph_tokens=16, graph_seqs=4, max_num_batched_tokens=64,
                               max_num_seqs=8, max_model_len=24, block_size=PAGE,
                               num_adapters=2)
    assert len(steps) == 2 and all(s.num_tokens > 16 for s in steps)

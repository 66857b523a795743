"""The step graphs' static inputs (engine/runner/step_graphs.py): what a prefill or mixed step
stages is the eager step padded as documented, and a padded step gives the eager rows' bits.

Graph capture needs CUDA (tests/gpu replays the graphs); staging and the padded forward run
anywhere. On the CPU the engine's batch_invariant ops make a row's bits independent of the
row count, so the padded forward must match the eager one bit for bit.
"""

import dataclasses

import pytest
import torch
from tests.helpers.engine_outputs import random_prompts, same_outputs

from detlora.config import SamplingParams
from detlora.engine.runner.model_runner import step_forward
from detlora.engine.runner.step_graphs import StepGraphs, step_graph_buckets
from detlora.engine.runner.step_inputs import StepInputs
from detlora.entrypoints.llm import LLM
from detlora.lora.request import LoRARequest
from detlora.ops.adapter_groups import group_tokens

PAGE = 4


def _step() -> StepInputs:
    """Three sequences: a 5-token prefill chunk after 2 cached tokens (adapter 1), a decode
    row fed from the previous step's row 1 (no adapter), a decode row (adapter 0)."""
    tables = [[3, 4], [6, 2, 9], [5]]
    lens = [7, 10, 3]
    pos = [2, 3, 4, 5, 6, 9, 2]
    rows = [0] * 5 + [1, 2]
    slots = [tables[r][p // PAGE] * PAGE + p % PAGE for r, p in zip(rows, pos, strict=True)]
    return StepInputs(input_ids=[11, 12, 13, 14, 15, -2, 17], positions=pos, slot_mapping=slots,
                      token_adapter=[1] * 5 + [-1, 0], block_tables=tables, seq_lens=lens,
                      query_start_loc=[0, 5, 6, 7], logits_indices=[4, 6])


def _graphs(num_adapters=2, buckets=((8, 1), (16, 4))) -> StepGraphs:
    feed = torch.arange(100, 108, dtype=torch.int64)
    return StepGraphs(lambda batch: (batch.input_ids,), device=torch.device("cpu"), feed=feed,
                      buckets=list(buckets), block_size=PAGE, max_blocks_per_seq=3,
                      max_model_len=12, num_adapters=num_adapters)


def test_buckets_cover_tokens_and_sequences_up_to_the_limits():
    assert step_graph_buckets(100, 2) == [(16, 1), (32, 1), (64, 1)]
    pairs = step_graph_buckets(8192, 256)
    assert pairs[:3] == [(16, 1), (16, 4), (16, 16)] and pairs[-3] == (2048, 256)
    # Past 2048 tokens (hundreds of short prompts), the largest sequence bucket only.
    assert pairs[-2:] == [(4096, 256), (8192, 256)]
    assert len(pairs) == 41 and step_graph_buckets(8, 4) == []
    assert step_graph_buckets(4096, 100)[-1] == (4096, 64)
    assert max(s for _, s in step_graph_buckets(8192, 100)) == 64  # never past max_num_seqs


def test_a_step_takes_the_smallest_bucket_that_holds_it():
    g = _graphs()
    step = _step()
    assert g.bucket_for(step) == (16, 4)
    one = dataclasses.replace(step, seq_lens=[7], query_start_loc=[0, 5], block_tables=[[3, 4]],
                              logits_indices=[4], input_ids=step.input_ids[:5],
                              positions=step.positions[:5], slot_mapping=step.slot_mapping[:5],
                              token_adapter=step.token_adapter[:5])
    assert g.bucket_for(one) == (8, 1)
    big = dataclasses.replace(step, input_ids=[1] * 17)
    assert g.bucket_for(big) is None
    with pytest.raises(ValueError, match="does not fit bucket"):
        g.stage(step, (8, 1))


def test_staged_inputs_are_the_step_padded_to_its_bucket():
    g = _graphs()
    step = _step()
    g.stage(dataclasses.replace(step, block_tables=[[1, 1, 1]] * 3), (16, 4))  # stale columns
    g.stage(step, (16, 4))
    pad = 16 - 7
    b = g.batch(16, 4)
    # Row 5 is fed: the previous step's row 1 (feed[1] = 101); padding rows take token 0.
    assert b.input_ids.tolist() == [11, 12, 13, 14, 15, 101, 17] + [0] * pad
    assert b.positions.tolist() == step.positions + [0] * pad
    assert b.attn.slot_mapping.tolist() == step.slot_mapping + [-1] * pad
    # Sequence 3 is empty; sequence 4 holds the padding rows, a context of their own on page 0.
    assert b.attn.seq_lens.tolist() == [*step.seq_lens, 0, pad]
    assert b.attn.query_start_loc.tolist() == [*step.query_start_loc, 7, 16]
    assert b.attn.max_query_len == 16 and b.attn.max_seq_len == 12
    for i, row in enumerate(step.block_tables):
        assert b.attn.block_tables[i, : len(row)].tolist() == row
    assert b.attn.block_tables[3:5, :3].tolist() == [[0, 0, 0]] * 2
    assert b.attn.block_tables.shape[1] == 4  # the padding context may span the whole bucket
    assert b.logits_indices.tolist() == [4, 6, 0, 0]
    ref = group_tokens(torch.tensor(step.token_adapter + [-1] * pad, dtype=torch.int32), 2)
    for name in ("token_adapter", "sorted_rows", "group_start", "group_size", "group_adapter"):
        assert torch.equal(getattr(b.lora.groups, name), getattr(ref, name)), name


def test_padding_rows_stay_inside_the_rotary_table():
    """A bucket may hold more rows than max_model_len; every staged position must still be a
    row of the rotary table (max_model_len rows): the kernels read cos/sin at each row's
    position unchecked, and a padding row past the table read outside its allocation (an
    illegal memory access on the H200 when the table ended an allocator segment)."""
    from detlora.ops.rotary import check_positions

    g = _graphs(buckets=((32, 4),))  # max_model_len 12
    one = StepInputs(input_ids=[5], positions=[11], slot_mapping=[7], token_adapter=[-1],
                     block_tables=[[0, 1, 2]], seq_lens=[12], query_start_loc=[0, 1],
                     logits_indices=[0])
    g.stage(one, (32, 4))
    positions = g.batch(32, 4).positions
    assert positions.tolist() == [11] + [0] * 31
    check_positions(positions, g.max_model_len)  # raises for a position past the table


def test_staging_without_lora_has_no_groups():
    g = _graphs(num_adapters=None)
    g.stage(_step(), (16, 4))
    b = g.batch(16, 4)
    assert b.lora is None and b.input_ids.shape[0] == 16


class _Uncaptured(StepGraphs):
    """Step graphs that run the padded forward instead of replaying a capture (CPU)."""

    replays = 0
    scoring_replays = 0  # of steps with prompt rows (prompt logprobs)

    def run(self, step):
        bucket = self.bucket_for(step)
        self.stage(step, bucket)
        _Uncaptured.replays += 1
        _Uncaptured.scoring_replays += bool(step.prompt_rows)
        out = self.forward(self.batch(*bucket))
        return tuple(o[: len(step.logits_indices)] for o in out)


def _engine(model_dir, padded: bool, **kw) -> LLM:
    llm = LLM(str(model_dir), enable_lora=True, max_loras=2, max_lora_rank=8, device="cpu",
              determinism="batch_invariant", max_num_batched_tokens=64, **kw)
    if padded:
        runner = llm.engine.runner
        model = runner.model
        hidden = torch.empty(64, model.spec.hidden_size, dtype=model.dtype)
        runner.step_graphs = _Uncaptured(
            step_forward(model, runner.greedy_head, hidden), device=runner.device,
            feed=runner._feed, buckets=step_graph_buckets(64, 16), block_size=runner.block_size,
            max_blocks_per_seq=-(-runner.max_model_len // runner.block_size),
            max_model_len=runner.max_model_len, num_adapters=runner.num_adapters,
            hidden=hidden)
    return llm


def _assert_padded_gives_eager_bits(model_dir, prompts, params, loras, **kw) -> list:
    outs = {}
    for padded in (False, True):
        llm = _engine(model_dir, padded, block_size=PAGE, **kw)
        before = _Uncaptured.replays
        outs[padded] = llm.generate(prompts, params, loras, use_tqdm=False)
        if padded:
            assert _Uncaptured.replays > before  # the padded path really ran
    bad = [k for k, (a, b) in enumerate(zip(outs[True], outs[False], strict=True))
           if not same_outputs(a, b) or a.prompt_logprobs != b.prompt_logprobs]
    assert not bad, f"outputs {bad} differ through the padded step buckets"
    return outs[True]


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_padded_steps_give_the_eager_bits(request, kind):
    """Every step (prefill, chunked prefill, mixed, decode: the CPU has no decode graphs)
    through the padded buckets: the same tokens and logprobs as the eager steps, bit for bit
    (batch_invariant CPU ops; Qwen3 adds q/k norms). Fed rows (running ahead) are the GPU
    tests'."""
    model_dir = request.getfixturevalue(f"{kind}_dir")
    adapters = (request.getfixturevalue("llama_adapters") if kind == "llama"
                else [request.getfixturevalue("qwen3_adapter")] * 2)
    loras = [LoRARequest(f"a{k}", k + 1, str(p)) for k, p in enumerate(adapters)]
    prompts = random_prompts(10, seed=5, lo=3, hi=60)
    mixed = [loras[k % 2] if k % 3 else None for k in range(10)]
    params = [SamplingParams(temperature=0.0, max_tokens=6, logprobs=1, ignore_eos=True) if k % 2
              else SamplingParams(max_tokens=6, logprobs=0, temperature=0.8, seed=k,
                                  ignore_eos=True) for k in range(10)]
    _assert_padded_gives_eager_bits(model_dir, prompts, params, mixed)


def test_padded_steps_with_buckets_past_max_model_len(request):
    """Buckets of up to 64 rows under a max_model_len of 24: padding rows outnumber the rotary
    table's rows, and every padded step must still give the eager bits (the CPU reference ops
    index the table, so a padding position past it raises here)."""
    model_dir = request.getfixturevalue("llama_dir")
    loras = [LoRARequest(f"a{k}", k + 1, str(p))
             for k, p in enumerate(request.getfixturevalue("llama_adapters"))]
    # 39 prompt tokens: the first step fills the 64-row bucket with 25 padding rows.
    prompts = [p[:12] for p in random_prompts(3, seed=9, lo=12, hi=13)] + [[5, 6, 7]]
    mixed = [loras[0], None, loras[1], loras[0]]
    params = [SamplingParams(temperature=0.0, max_tokens=6, logprobs=0, ignore_eos=True)] * 4
    _assert_padded_gives_eager_bits(model_dir, prompts, params, mixed, max_model_len=24)


def test_prompt_logprobs_through_the_padded_buckets(request):
    """Steps whose rows score prompt tokens (echo, lm-eval's loglikelihood) take the step
    graph too: the graph leaves every row's final hidden state in its buffer, and the prompt
    logprobs read from there are the eager step's, bit for bit, chunked prefill included
    (prompts past the 64-token budget), mixed with requests that score nothing."""
    model_dir = request.getfixturevalue("llama_dir")
    loras = [LoRARequest(f"a{k}", k + 1, str(p))
             for k, p in enumerate(request.getfixturevalue("llama_adapters"))]
    prompts = random_prompts(6, seed=13, lo=5, hi=40) + random_prompts(1, seed=14, lo=90, hi=91)
    mixed = [loras[k % 2] if k % 3 else None for k in range(7)]
    params = [SamplingParams(temperature=0.0, max_tokens=2, logprobs=1, ignore_eos=True,
                             prompt_logprobs=1 if k % 4 else (3 if k else None))
              for k in range(7)]
    before = _Uncaptured.scoring_replays
    outs = _assert_padded_gives_eager_bits(model_dir, prompts, params, mixed)
    assert _Uncaptured.scoring_replays > before  # scoring steps took the buckets
    assert outs[0].prompt_logprobs is None
    assert all(len(o.prompt_logprobs) == len(p) for o, p in zip(outs[1:], prompts[1:],
                                                                strict=True))

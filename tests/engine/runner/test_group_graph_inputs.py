"""CUDA-graph inputs of a model with several KV groups (Gemma's sliding-window and full
layers): the decode and step graphs stage every group's slots and block tables, padded as
group 0's are, and a Gemma engine whose steps go through the padded buffers (run, not
replayed: the CPU has no graphs) gives the eager steps' bits."""

from __future__ import annotations

import torch
from tests.engine.runner.test_step_graph_inputs import _Uncaptured
from tests.helpers.engine_outputs import same_outputs
from tests.helpers.tiny_gemma import TEXT_TARGETS, make_gemma4, make_gemma_adapter

from detlora.config import SamplingParams
from detlora.engine.runner.decode_graphs import DecodeGraphs
from detlora.engine.runner.step_graphs import StepGraphs, step_graph_buckets
from detlora.engine.runner.step_inputs import StepInputs
from detlora.entrypoints.llm import LLM
from detlora.lora.request import LoRARequest

PAGE = 4


def _decode_step() -> StepInputs:
    return StepInputs(input_ids=[11, 12], positions=[9, 2], slot_mapping=[9, 21],
                      token_adapter=[-1, -1], block_tables=[[0, 1, 2], [5]], seq_lens=[10, 3],
                      query_start_loc=[0, 1, 2], logits_indices=[0, 1],
                      group_slot_mapping=[[33, 41]],
                      group_block_tables=[[[-1, 7, 8], [10]]])


def test_decode_graphs_stage_every_groups_slots_and_tables():
    g = DecodeGraphs(lambda batch: batch.input_ids, device=torch.device("cpu"),
                     max_num_seqs=4, max_blocks_per_seq=3, max_model_len=12,
                     num_adapters=None, kv_groups=2)
    g.stage(_decode_step(), 4)
    attn = g._batch(4).attn
    one = attn.for_group(1)
    assert one.slot_mapping.tolist() == [33, 41, -1, -1]  # padding rows write nothing
    assert one.block_tables[:2].tolist() == [[-1, 7, 8], [10, 0, 0]]
    assert one.block_tables[2:, 0].tolist() == [0, 0]  # padding: a one-token context, page 0
    assert attn.for_group(0).slot_mapping.tolist() == [9, 21, -1, -1]
    assert one.seq_lens is attn.seq_lens


def test_step_graphs_stage_every_groups_slots_and_tables():
    feed = torch.arange(100, 108, dtype=torch.int64)
    g = StepGraphs(lambda batch: (batch.input_ids,), device=torch.device("cpu"), feed=feed,
                   buckets=[(8, 4)], block_size=PAGE, max_blocks_per_seq=3, max_model_len=12,
                   num_adapters=None, kv_groups=2)
    g.stage(_decode_step(), (8, 4))
    one = g.batch(8, 4).attn.for_group(1)
    assert one.slot_mapping.tolist() == [33, 41] + [-1] * 6
    assert one.block_tables[:2, :3].tolist() == [[-1, 7, 8], [10, 0, 0]]
    assert one.block_tables[2:, :3].tolist() == [[0, 0, 0]] * 3


class _UncapturedDecode(DecodeGraphs):
    """Decode graphs that run the padded forward instead of replaying a capture (CPU)."""

    runs = 0

    def run(self, step):
        bucket = self.bucket_for(step.num_seqs)
        self.stage(step, bucket)
        _UncapturedDecode.runs += 1
        return tuple(t[: step.num_seqs] for t in self.forward(self._batch(bucket)))


def test_gemma_steps_through_padded_buffers_give_the_eager_bits(tmp_path):
    base = make_gemma4(tmp_path / "base")
    ad = make_gemma_adapter(base, tmp_path / "ad", targets=TEXT_TARGETS)
    lora = LoRARequest("a", 1, str(ad))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 110, (n,), generator=g).tolist() for n in (5, 19, 11, 27)]
    loras = [None, lora, lora, None]
    sp = SamplingParams(temperature=0.0, max_tokens=6, logprobs=0, ignore_eos=True)
    outs = {}
    for padded in (False, True):
        llm = LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=8, device="cpu",
                  max_num_batched_tokens=16, block_size=PAGE)
        runner = llm.engine.runner
        if padded:
            width = -(-runner.max_model_len // runner.block_size)
            runner.step_graphs = _Uncaptured(
                runner._decode_forward, device=runner.device, feed=runner._feed,
                buckets=step_graph_buckets(16, 4), block_size=PAGE, max_blocks_per_seq=width,
                max_model_len=runner.max_model_len, num_adapters=runner.num_adapters,
                kv_groups=runner.kv_groups)
            runner.graphs = _UncapturedDecode(
                runner._decode_forward, device=runner.device, max_num_seqs=4,
                max_blocks_per_seq=width, max_model_len=runner.max_model_len,
                num_adapters=runner.num_adapters, kv_groups=runner.kv_groups)
            runner._feed = runner.graphs.feed
        before = (_Uncaptured.replays, _UncapturedDecode.runs)
        outs[padded] = llm.generate(prompts, sp, loras, use_tqdm=False)
        if padded:  # both padded paths really ran
            assert _Uncaptured.replays > before[0] and _UncapturedDecode.runs > before[1]
    assert all(same_outputs(a, b) for a, b in zip(outs[True], outs[False], strict=True))

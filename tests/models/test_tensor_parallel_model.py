"""A model split over 2 and 4 tensor-parallel ranks (threads joined by gloo) gives the logits
of one rank bit for bit at batch_invariant: prefill and decode over the paged cache, with
mixed adapters (in_gemm LoRA), tied and untied heads, Llama and Qwen3 (q/k norms), KV heads
replicated past their count, and a vocabulary that does not split evenly."""

from __future__ import annotations

import pytest
import torch
from tests.helpers.tiny_hf import PagedKV, make_checkpoint, write_random_adapter
from tests.helpers.tp_threads import run_ranks

from detlora.layers.backend import make_backend
from detlora.layers.lora_slots import LoRAConfig
from detlora.lora.manager import LoRAManager
from detlora.lora.request import LoRARequest
from detlora.models.loader import load_model

LENGTHS = [5, 9, 3, 12]


@pytest.fixture(scope="module", params=["llama-tied", "qwen3"])
def case(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    arch = request.param.split("-")[0]
    # 4 heads, 2 KV heads (replicated at 4 ranks), MLP 128; vocab 328 splits unevenly.
    base = make_checkpoint(root / "base", arch, tie=request.param.endswith("tied"),
                           rope_scaling=arch == "llama", intermediate_size=128,
                           vocab_size=328)
    adapters = [write_random_adapter(base, root / f"a{k}", r=4 + 4 * k, seed=10 + k)
                for k in range(2)]
    return base, adapters


def _run(base, adapters, level="batch_invariant", dtype=torch.float32):
    """Logits of a mixed-adapter prefill, then of a decode step, on every rank."""
    loras = [LoRARequest(f"a{k}", k + 1, str(p)) for k, p in enumerate(adapters)]

    def rank(group):
        backend = make_backend("cpu", level, dtype=dtype)
        model = load_model(base, dtype=dtype, backend=backend, tp=group,
                           lora_config=LoRAConfig(max_loras=3, max_lora_rank=8))
        model.allocate_kv_cache(num_blocks=32, block_size=4)
        slots = LoRAManager(model).activate([loras[0], loras[1], None, loras[0]])
        g = torch.Generator().manual_seed(4)
        prompts = [torch.randint(0, model.spec.vocab_size, (n,), generator=g).tolist()
                   for n in LENGTHS]
        kv = PagedKV(32, 4, seed=5)
        slot_of = dict(enumerate(slots))
        prefill = model(kv.step(dict(enumerate(prompts)), slot_of, 3))
        decode = model(kv.step({s: [7 + s] for s in range(len(LENGTHS))}, slot_of, 3))
        return prefill, decode, model.weights_hash()

    return rank


@pytest.mark.parametrize("size", [2, 4])
def test_shards_give_one_rank_bits(case, size):
    base, adapters = case
    (want,) = run_ranks(1, _run(base, adapters))
    got = run_ranks(size, _run(base, adapters))
    for r, (prefill, decode, weights_hash) in enumerate(got):
        assert torch.equal(prefill, want[0]), f"rank {r}: prefill logits differ"
        assert torch.equal(decode, want[1]), f"rank {r}: decode logits differ"
        assert weights_hash == want[2]
    assert want[0].shape == (sum(LENGTHS), 328)


def test_below_batch_invariant_the_ranks_all_reduce(case):
    """run_to_run sums rounded partial outputs across ranks: close to one rank, not promised
    equal, and the same on every rank."""
    base, adapters = case
    (want,) = run_ranks(1, _run(base, adapters, "run_to_run"))
    got = run_ranks(2, _run(base, adapters, "run_to_run"))
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])
    torch.testing.assert_close(got[0][0], want[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[0][1], want[1], rtol=1e-4, atol=1e-4)

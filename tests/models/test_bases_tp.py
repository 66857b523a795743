"""Qwen2 (q/k/v biases) and Phi-3 (fused checkpoint, adapters on the fused modules) split over
2 tensor-parallel ranks (threads joined by gloo) give one rank's logits bit for bit at
batch_invariant, at widths that are not powers of two (hidden 96, MLP 200, 6 / 2 heads)."""

from __future__ import annotations

import pytest
import torch
from tests.helpers.tiny_hf import (
    ALL_TARGETS,
    FUSED_TARGETS,
    make_base_checkpoint,
    write_random_adapter,
)
from tests.helpers.tp_threads import run_ranks
from tests.models.test_tensor_parallel_model import _run


@pytest.mark.parametrize("arch", ["qwen2", "phi3"])
def test_two_ranks_give_one_rank_bits(arch, tmp_path):
    base = make_base_checkpoint(tmp_path / "base", arch)
    targets = FUSED_TARGETS if arch == "phi3" else ALL_TARGETS
    adapters = [write_random_adapter(base, tmp_path / f"a{k}", r=4 + 4 * k, seed=10 + k,
                                     targets=targets) for k in range(2)]
    (want,) = run_ranks(1, _run(base, adapters))
    for got in run_ranks(2, _run(base, adapters)):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert got[2] == want[2]  # the whole model's weights hash on every rank

"""An in_gemm LoRA layer's outputs do not depend on how many adapter slots it holds
(``max_loras``): the same adapter in slot 0 or in the last slot of a layer of 1, 8 or 32
slots gives the same bits, for the fused q|k|v (column-parallel) and the o projection
(row-parallel, K summed as ordered groups), at decode and at a prefill of more than 64 rows,
where the GEMM's tiles (split or persistent path) are chosen from the stacked width. The
kernel path in Triton's interpreter (fp16) and the CPU batch-invariant path."""

from __future__ import annotations

import pytest
import torch

from detlora.layers.backend import make_backend
from detlora.layers.lora_slots import LoRAConfig
from detlora.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear
from detlora.ops._runtime import interpreting
from detlora.ops.adapter_groups import group_tokens

HIDDEN, QKV, RANK = 512, (32, 16, 16), 8
SLOT_COUNTS = (1, 8, 32)


def _backend(kernels: bool):
    if kernels and not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1")
    return make_backend("cpu", "batch_invariant", "in_gemm", dtype=torch.float16,
                        kernels=kernels, max_lora_rank=RANK)


def _layer(kind: str, backend, max_loras: int):
    g = torch.Generator().manual_seed(0)
    lora = LoRAConfig(max_loras, RANK)
    if kind == "qkv":
        layer = ColumnParallelLinear(HIDDEN, QKV, backend=backend, bias=True,
                                     dtype=torch.float16, lora=lora)
        sizes = QKV
    else:
        layer = RowParallelLinear(HIDDEN, 48, backend=backend, dtype=torch.float16, lora=lora)
        sizes = (48,)
    for s, n in enumerate(sizes):
        layer.load_weight((torch.randn(n, HIDDEN, generator=g) / HIDDEN**0.5).half(), s)
        if layer.bias is not None:
            layer.load_bias(torch.randn(n, generator=g).half(), s)
    # The adapter: rank 4 (zero-padded to RANK), q and v only for the fused layer.
    a = [torch.randn(4, HIDDEN, generator=g).half() / 8 for _ in sizes]
    b = [torch.randn(n, 4, generator=g).half() for n in sizes]
    if kind == "qkv":
        a[1] = b[1] = None
    return layer, (a, b, 2.0)


def _outputs(kind: str, kernels: bool, max_loras: int, slot: int, m: int) -> torch.Tensor:
    layer, (a, b, scale) = _layer(kind, _backend(kernels), max_loras)
    layer.set_lora(slot, a, b, scale)
    x = torch.randn(m, HIDDEN, generator=torch.Generator().manual_seed(m)).half()
    # Every third row without an adapter.
    token_slots = torch.tensor([-1 if r % 3 == 2 else slot for r in range(m)],
                               dtype=torch.int32)
    with torch.no_grad():
        return layer(x, group_tokens(token_slots, max_loras)).clone()


@pytest.mark.parametrize("m", [3, 80], ids=["decode", "prefill"])
@pytest.mark.parametrize("kind", ["qkv", "o"])
@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "cpu"])
def test_outputs_do_not_depend_on_the_slot_count(kernels, kind, m):
    ref = _outputs(kind, kernels, 1, 0, m)
    for slots in SLOT_COUNTS[1:]:
        for slot in (0, slots - 1):
            got = _outputs(kind, kernels, slots, slot, m)
            assert torch.equal(got, ref), (slots, slot)


def test_prefill_tiles_change_with_the_slot_count():
    """The GEMM configs the kernel test compares: at 80 rows the stacked width picks other
    tiles (or path) for 32 slots than for one, with the same K split."""
    from detlora.ops import matmul as mm

    n = sum(QKV)
    width = len(QKV) * RANK
    cfgs = {s: mm.matmul_config(80, n + s * width, HIDDEN, torch.float16, 1, 4, split_n=n)
            for s in SLOT_COUNTS}
    assert len({c.k_split for c in cfgs.values()}) == 1
    assert len({(c.block_m, c.block_n, c.split_ctas) for c in cfgs.values()}) > 1

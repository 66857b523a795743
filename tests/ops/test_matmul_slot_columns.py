"""The batch-invariant linear with ``slot_columns`` (the in_gemm shrink), in Triton's interpreter:
tiles of slots no row uses are skipped (their columns stay unwritten), every other column has
the bits of the plain linear of the base width (same K split), whatever the slot count and
wherever an adapter's columns sit; the CPU batch-invariant linear keeps the same promises."""

import pytest
import torch

from detlora.ops import cpu_invariant
from detlora.ops import matmul as mm
from detlora.ops.adapter_groups import group_tokens
from detlora.ops.slot_columns import SlotColumns

BASE, WIDTH, K = 40, 12, 96


def _weights(slots: int, seed: int = 0, dtype=torch.float16):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(BASE + slots * WIDTH, K, generator=g) / K**0.5).to(dtype)
    bias = torch.randn(BASE + slots * WIDTH, generator=g).to(dtype)
    return w, bias


def _x(m: int, seed: int = 1, dtype=torch.float16):
    return torch.randn(m, K, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _columns(token_slots: list[int], slots: int) -> SlotColumns:
    return SlotColumns(BASE, WIDTH, group_tokens(torch.tensor(token_slots, dtype=torch.int32),
                                                 slots))


def _cfg(chunks: int, bn: int = 16, bn2: int = 0) -> mm.MatmulConfig:
    return mm.MatmulConfig(mm.KSplit.for_chunks(K, 16, chunks), 16, bn, split_ctas=True,
                           block_n2=bn2)


def _span(s: int) -> slice:
    return slice(BASE + s * WIDTH, BASE + (s + 1) * WIDTH)


@pytest.mark.parametrize("cfg", [None, _cfg(1), _cfg(3), _cfg(1, 16, 16)],
                         ids=["default", "one_chunk", "three_chunks", "two_part"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_unused_slots_are_skipped_and_used_ones_match(cfg, with_bias):
    slots = 16
    w, bias = _weights(slots)
    bias = bias if with_bias else None
    x = _x(5)
    token_slots = [2, -1, 2, 5, -1]
    ks = mm.k_split(BASE, K, x.dtype) if cfg is None else cfg.k_split
    same_split = mm.MatmulConfig(ks, 16, 16, split_ctas=True)
    want = mm.linear(x, w, bias, config=same_split)
    if cfg is None:  # what linear picks: tiles for the base and one slot
        cfg = mm.matmul_config(5, BASE + WIDTH, K, x.dtype, 1, 4, split_n=BASE)
    tile = cfg.block_n + cfg.block_n2
    n = w.shape[0]
    used = {c for s in (2, 5) for c in range(n)[_span(s)]} | set(range(BASE))
    computed = torch.tensor([any(j in used for j in range(c // tile * tile, c // tile * tile
                                                             + tile)) for c in range(n)])
    assert not computed.all()  # some tiles hold unused slots only
    for _ in range(2):  # twice: the split path's counters are left clean
        out = torch.full((5, n), float("nan"), dtype=x.dtype)
        mm.linear(x, w, bias, out=out, config=cfg, slot_columns=_columns(token_slots, slots))
        assert torch.equal(out[:, computed], want[:, computed])
        assert out[:, ~computed].isnan().all()  # skipped tiles write nothing


def test_base_columns_have_the_plain_linear_bits_at_any_slot_count():
    x = _x(3)
    plain = mm.linear(x, _weights(1)[0][:BASE])
    for slots in (1, 8, 64):
        w, _ = _weights(slots)
        w[:BASE] = _weights(1)[0][:BASE]
        out = mm.linear(x, w, slot_columns=_columns([0, 0, -1], slots))
        assert torch.equal(out[:, :BASE], plain), slots


def test_a_slot_has_the_same_bits_wherever_it_sits():
    slots = 8
    x = _x(4)
    w, _ = _weights(slots)
    a = w[_span(0)].clone()
    w0, w7 = w.clone(), w.clone()
    w7[_span(7)] = a
    got0 = mm.linear(x, w0, slot_columns=_columns([0] * 4, slots))[:, _span(0)]
    got7 = mm.linear(x, w7, slot_columns=_columns([7] * 4, slots))[:, _span(7)]
    assert torch.equal(got0, got7)


def test_cpu_invariant_linear_with_slot_columns():
    x = _x(5, dtype=torch.float32)
    w, bias = _weights(8, dtype=torch.float32)
    cols = _columns([3, -1, 3, 6, 3], 8)
    y = cpu_invariant.linear(x, w, bias, slot_columns=cols)
    assert torch.equal(y[:, :BASE], cpu_invariant.linear(x, w[:BASE], bias[:BASE]))
    assert torch.equal(y[:, _span(6)], cpu_invariant.linear(x, w[_span(6)], bias[_span(6)]))
    assert torch.count_nonzero(y[:, _span(0)]) == 0
    w2, bias2 = w.clone(), bias.clone()
    w2[_span(1)], bias2[_span(1)] = w[_span(3)], bias[_span(3)]  # the adapter one slot over
    y2 = cpu_invariant.linear(x, w2, bias2, slot_columns=_columns([1, -1, 1, 6, 1], 8))
    assert torch.equal(y2[:, _span(1)], y[:, _span(3)])


def test_slot_columns_checked():
    w, _ = _weights(4)
    with pytest.raises(ValueError, match="do not end at the weight's"):
        mm.linear(_x(2), w, slot_columns=SlotColumns(BASE, WIDTH + 1,
                                                     _columns([0, 1], 4).groups))
    with pytest.raises(ValueError, match="groups has 3 rows, x has 2"):
        mm.linear(_x(2), w, slot_columns=_columns([0, 1, 2], 4))
    with pytest.raises(ValueError, match="must be SlotColumns"):
        mm.linear(_x(2), w, slot_columns=(BASE, WIDTH))

"""The group cap of the LoRA kernels. The shrink (``ShrinkConfig.group_cap``): at most ``cap``
programs along the grid's adapter-group axis, each looping over its groups. The expand and its
fused variants (``ExpandConfig.group_cap``): programs along the batch's row tiles, at most the
row tiles of M rows plus ``cap``, each looping over the rest. Either way the bits are those of
one program per group (or per row tile): one adapter in use among many slots, every row on its
own adapter (more groups than the cap), rows without an adapter, decode- and prefill-sized
batches. The expand's launch no longer grows with the slots; bad caps are refused; the capped
kernels compile for sm_90 without spills. In Triton's interpreter, fp16/fp32 (its bf16 tl.dot
is wrong)."""

import dataclasses
import itertools

import pytest
import torch

from detlora.ops import lora_expand as expand_mod
from detlora.ops.adapter_groups import group_programs, group_tokens, row_tile_programs
from detlora.ops.lora_configs import ExpandConfig, ShrinkConfig, expand_config, shrink_config
from detlora.ops.lora_expand import lora_expand
from detlora.ops.lora_expand_rotary_write_kv import lora_expand_rotary_write_kv
from detlora.ops.lora_expand_silu_and_mul import lora_expand_silu_and_mul
from detlora.ops.lora_shrink import lora_shrink
from detlora.ops.lora_workspace import LoRAWorkspace
from detlora.ops.rotary import rope_cos_sin_cache

CAPS = (None, 1, 2, 8)
PAGE = 4


def adapter_ids(case: str, m: int, seed: int) -> tuple[torch.Tensor, int]:
    """(token_adapter, adapter slots) for a batch of ``m`` rows."""
    g = torch.Generator().manual_seed(seed)
    if case == "one_in_use":  # one adapter of 16 slots, a few rows without one
        ids = torch.full((m,), 5, dtype=torch.int32)
        ids[1::3] = -1
        return ids, 16
    if case == "all_different":  # each row its own slot: m groups, more than any cap
        return torch.randperm(m + 3, generator=g)[:m].to(torch.int32), m + 3
    # mixed: a few adapters, rows without one; groups larger than a row tile
    return torch.randint(-1, 4, (m,), generator=g, dtype=torch.int32), 6


# (case, rows): decode- and prefill-sized batches (all_different: 9 and 20 groups, more than
# every cap but None).
CASES = [("one_in_use", 5), ("one_in_use", 40), ("all_different", 9), ("all_different", 20),
         ("mixed", 5), ("mixed", 40)]
# The slower kernels (the shrink, the fused expands) without the 20-group case: 9 groups already
# make cap 8 loop (the plain expand keeps it; the interpreter runs each CTA in turn).
FEWER_CASES = [c for c in CASES if c != ("all_different", 20)]


def capped(cfg, cap):
    return dataclasses.replace(cfg, group_cap=cap)


def expand_operands(m, widths, r, slots, seed, dtype=torch.float16):
    g = torch.Generator().manual_seed(seed)
    n = sum(widths)
    h = torch.randn(len(widths), m, r, generator=g)
    b = (torch.randn(slots, n, r, generator=g) / r**0.5).half()
    y = (2 * torch.randn(m, n, generator=g)).to(dtype)
    return y, h, b, [0, *itertools.accumulate(widths)]


@pytest.mark.parametrize("case,m", CASES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_expand_bits_do_not_depend_on_the_cap(case, m, dtype):
    ids, slots = adapter_ids(case, m, seed=m)
    y, h, b, offsets = expand_operands(m, (48, 16, 16), 16, slots, seed=m + 1, dtype=dtype)
    groups = group_tokens(ids, slots)
    # Row tiles of 16: prefill-sized groups take several tiles.
    cfg = dataclasses.replace(expand_config(m, 16, 48), block_m=16)
    outs = [lora_expand(y.clone(), h, b, groups, offsets, config=capped(cfg, cap))
            for cap in CAPS]
    assert not torch.equal(outs[0], y)  # the update was added
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


@pytest.mark.parametrize("case,m", [("one_in_use", 5), ("all_different", 20), ("mixed", 40)])
def test_expand_of_deferred_partials_and_the_shrink_do_not_depend_on_the_cap(case, m):
    ids, slots = adapter_ids(case, m, seed=m + 2)
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 200, generator=g).half()
    a = (torch.randn(slots, 2, 8, 200, generator=g) / 200**0.5).half()
    scale = torch.rand(slots, generator=g) + 0.5
    y, _, b, offsets = expand_operands(m, (32, 32), 8, slots, seed=m + 3)
    groups = group_tokens(ids, slots)
    outs = []
    for cap in CAPS:
        shrink_cfg = capped(shrink_config("ordered_bi", m, 200, 16), cap)
        parts = lora_shrink(x, a, groups, scale, reduction="ordered_bi", config=shrink_cfg,
                            defer=True)
        outs.append(lora_expand(y.clone(), parts, b, groups, offsets,
                                config=capped(expand_config(m, 8, 32), cap)))
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


@pytest.mark.parametrize("reduction", ["unsplit", "ordered", "ordered_bi", "tree"])
@pytest.mark.parametrize("case,m", FEWER_CASES)
def test_shrink_bits_do_not_depend_on_the_cap(reduction, case, m):
    ids, slots = adapter_ids(case, m, seed=m + 4)
    g = torch.Generator().manual_seed(m + 5)
    x = torch.randn(m, 400, generator=g).half()
    a = (torch.randn(slots, 3, 8, 400, generator=g) / 400**0.5).half()
    scale = torch.rand(slots, generator=g) + 0.5
    groups = group_tokens(ids, slots)
    ws = LoRAWorkspace("cpu")
    cfg = shrink_config(reduction, m, 400, 24)
    if cfg.split_k == 1 and reduction != "unsplit":  # split K, so partials are summed
        cfg = ShrinkConfig(split_k=3, block_m=16, block_n=16, block_k=64)
    outs = [lora_shrink(x, a, groups, scale, reduction=reduction, workspace=ws,
                        config=capped(cfg, cap)) for cap in CAPS]
    assert torch.all(outs[0][:, ids < 0] == 0) and outs[0][:, ids >= 0].abs().sum() > 0
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    if reduction.startswith("ordered"):  # every group's tile counters reset themselves
        assert ws._counters.numel() > 0 and int(ws._counters.abs().sum()) == 0


@pytest.mark.parametrize("case,m", FEWER_CASES)
def test_expand_silu_and_mul_bits_do_not_depend_on_the_cap(case, m):
    ids, slots = adapter_ids(case, m, seed=m + 6)
    y, h, b, _ = expand_operands(m, (40, 40), 16, slots, seed=m + 7)
    groups = group_tokens(ids, slots)
    cfg = dataclasses.replace(expand_config(m, 16, 40), block_m=16)
    outs = [lora_expand_silu_and_mul(y, h, b, groups, config=capped(cfg, cap)) for cap in CAPS]
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


@pytest.mark.parametrize("case,m", FEWER_CASES)
def test_expand_rotary_write_kv_bits_do_not_depend_on_the_cap(case, m):
    hq, hk, d, r = 2, 1, 16, 8
    ids, slots = adapter_ids(case, m, seed=m + 8)
    y, h, b, offsets = expand_operands(m, (hq * d, hk * d, hk * d), r, slots, seed=m + 9)
    g = torch.Generator().manual_seed(m + 10)
    pos = torch.randint(0, 64, (m,), generator=g)
    pages = m // PAGE + 2
    slot_map = torch.randperm(pages * PAGE, generator=g)[:m]
    slot_map[2::5] = -1  # padding rows
    cache = torch.randn(2, pages, PAGE, hk, d, generator=g).half()
    cos_sin = rope_cos_sin_cache(d, 64, 10000.0)
    groups = group_tokens(ids, slots)
    cfg = dataclasses.replace(expand_config(m, r, hq * d), block_m=16)
    results = []
    for cap in CAPS:
        kc, vc = cache[0].clone(), cache[1].clone()
        q = lora_expand_rotary_write_kv(y, h, b, groups, offsets, pos, cos_sin, kc, vc,
                                        slot_map, config=capped(cfg, cap))
        results.append((q, kc, vc))
    for got in results[1:]:
        assert all(torch.equal(x, want) for x, want in zip(got, results[0], strict=True))


class _Grids:
    """Stands in for a kernel: records each launch's grid and ROW_LOOP."""

    def __init__(self) -> None:
        self.launches: list[tuple[tuple, bool]] = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((grid, kwargs["ROW_LOOP"]))
        return launch


def test_capped_launch_does_not_grow_with_the_slots(monkeypatch):
    grids = _Grids()
    monkeypatch.setattr(expand_mod, "_expand_kernel", grids)
    m = 64
    ids = torch.zeros(m, dtype=torch.int32)  # one adapter in use
    cases = list(itertools.product((1, 8, 32, 64), (None, 8)))
    for slots, cap in cases:
        y, h, b, offsets = expand_operands(m, (32, 16, 16), 16, slots, seed=0)
        lora_expand(y, h, b, group_tokens(ids, slots), offsets,
                    config=capped(expand_config(m, 16, 32), cap))
    row_axis = {case: grid[2] for (grid, _), case in zip(grids.launches, cases, strict=True)}
    # 4 row tiles of 16 rows, plus one per group that could have rows: min(M, L + 1) - 1.
    assert [row_axis[(s, None)] for s in (1, 8, 32, 64)] == [5, 12, 36, 67]
    assert [row_axis[(s, 8)] for s in (1, 8, 32, 64)] == [5, 12, 12, 12]
    assert [loop for _, loop in grids.launches] == [False] * 5 + [True, False, True]
    assert all(grid[:2] == (1, 3) for grid, _ in grids.launches)  # n tiles, slices
    # The engine's default tiles cap the row-tile axis at the batch's tiles plus 16.
    assert expand_config(m, 16, 32).group_cap == 16


def test_group_programs():
    assert group_programs(33, None) == (33, 0)
    assert group_programs(33, 8) == (8, 8)
    # A cap that does not bind launches the plain kernel (the loop is slower there).
    assert group_programs(8, 8) == (8, 0) and group_programs(1, 8) == (1, 0)


def test_row_tile_programs():
    # (rows, BLOCK_M, groups, cap) -> (programs, loop)
    assert row_tile_programs(64, 16, 65, None) == (68, False)
    assert row_tile_programs(64, 16, 65, 16) == (20, True)
    assert row_tile_programs(64, 16, 2, 16) == (5, False)
    assert row_tile_programs(1, 16, 1, 16) == (1, False)
    assert row_tile_programs(40, 16, 9, 1) == (4, True)


@pytest.mark.parametrize("sizes,block_m", [([5, 0, 0], 4), ([17, 16, 1, 9], 16),
                                           ([1] * 9, 16), ([3, 13], 16), ([64], 16)])
def test_the_row_tile_bound_covers_every_batch(sizes, block_m):
    """No grouping of M rows needs more row tiles than the launch without a cap has."""
    m = sum(sizes)
    tiles = sum(-(-n // block_m) for n in sizes)
    programs, loop = row_tile_programs(m, block_m, len(sizes), None)
    assert tiles <= programs and not loop


@pytest.mark.parametrize("cap", [0, -1, 1.5, True, "8"])
def test_bad_cap_raises_value_error(cap):
    ids = torch.tensor([0, 1, -1], dtype=torch.int32)
    y, h, b, offsets = expand_operands(3, (16,), 8, 2, seed=1)
    with pytest.raises(ValueError, match="group_cap must be None or a positive int"):
        lora_expand(y, h, b, ids, offsets, config=ExpandConfig(16, 16, 16, group_cap=cap))
    x = torch.randn(3, 64).half()
    a = torch.randn(2, 1, 8, 64).half()
    with pytest.raises(ValueError, match="group_cap must be None or a positive int"):
        lora_shrink(x, a, ids, 1.0, config=capped(shrink_config("ordered", 3, 64, 8), cap))


# Run without the interpreter (sm90_compile's subprocess): every group-grid kernel, one
# program per group or row tile and capped (looping), compiles for sm_90 without spills.
_SM90_SCRIPT = r"""
import json, sys
from compile_sm90 import compile_kernel, ptx_summary, ptxas_spills
from detlora.ops import lora_expand, lora_shrink
from detlora.ops import lora_expand_rotary_write_kv as rk
from detlora.ops import lora_expand_silu_and_mul as sm

ints = {n: "*i32" for n in ("rows_ptr", "group_start_ptr", "group_size_ptr",
                            "group_adapter_ptr", "counter_ptr", "positions_ptr", "slot_ptr",
                            "ranks_ptr", "row_tiles_ptr")}
f32 = {n: "*fp32" for n in ("h_ptr", "scale_ptr", "scratch_ptr", "cos_sin_ptr")}
expand = dict(NUM_PARTS=1, TAIL_GROUP=1, PARTIALS=False, BLOCK_M=16, BLOCK_N=64, BLOCK_R=16,
              EVEN_R=False, RANKS=True, PDL=True)  # the engine's: slot ranks, masked loads
kernels = [
    ("expand", lora_expand._expand_kernel, expand, ints | f32),
    ("expand_partials", lora_expand._expand_kernel,
     dict(expand, NUM_PARTS=12, TAIL_GROUP=3, PARTIALS=True), ints | f32),
    ("silu_and_mul", sm._expand_silu_and_mul_kernel, expand, ints | f32),
    ("rotary_write_kv", rk._expand_rotary_write_kv_kernel,
     dict(expand, BLOCK_HALF=64, PAGE=16, HEAD_DIM=128, HALF=64) | {"BLOCK_N": None},
     ints | f32),
] + [(f"shrink_mode{mode}", lora_shrink._shrink_kernel,
      dict(MODE=mode, SPLIT=1 if mode == 0 else 12, TAIL_GROUP=3, TREE_IN_CTA=mode in (0, 2),
           BLOCK_M=16, BLOCK_N=16, BLOCK_K=128, EVEN_K=True), ints | f32 | {"out_ptr": "*fp32"})
     for mode in range(5)]
results = []
for name, fn, consts, ptrs in kernels:
    consts = {k: v for k, v in consts.items() if v is not None}
    for cap in json.loads(sys.argv[1]):
        # Expands: a row-tile axis that loops (ROW_LOOP) or not; shrinks: GROUP_CAP.
        extra = (dict(GROUP_CAP=cap) if name.startswith("shrink")
                 else dict(ROW_LOOP=bool(cap)))
        k, _ = compile_kernel(fn, dict(consts, **extra), ptrs)
        ptx = k.asm["ptx"]
        s = ptx_summary(ptx)
        results.append([name, cap, ptxas_spills(ptx),
                        s.get("mma.sync", 0) + s.get("wgmma.mma_async", 0)])
print(json.dumps(results))
"""


def test_group_grid_kernels_compile_for_sm90_capped_and_not(sm90_compile):
    results = sm90_compile(_SM90_SCRIPT, [0, 8])
    assert len(results) == 2 * 9
    for name, cap, spills, mmas in results:
        assert spills == 0, (name, cap)
        assert mmas > 0, (name, cap)

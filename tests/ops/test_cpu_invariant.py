"""The batch-invariant CPU ops: same semantics as the references, rows independent of the batch."""

import torch

from detlora.ops import cpu_invariant as ops
from detlora.ops.adapter_groups import group_tokens
from detlora.ops.lora_expand import lora_expand_ref
from detlora.ops.lora_shrink import lora_shrink_ref
from detlora.ops.matmul import linear_ref
from detlora.ops.paged_attention import paged_attention_ref, write_kv_ref


def test_linear_matches_reference_and_rows_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 80, generator=g), torch.randn(96, generator=g)
    x = torch.randn(70, 80, generator=g)
    full = ops.linear(x, w, b)
    torch.testing.assert_close(full, linear_ref(x, w, b), rtol=1e-5, atol=1e-5)
    for m in (1, 2, 3, 5, 16, 17, 33):
        assert torch.equal(ops.linear(x[-m:], w, b), full[-m:])
    # A row gives the same bits at any position of a tile, beside any other rows.
    row = x[3:4]
    for pos in range(ops.ROW_TILE):
        other = torch.randn(ops.ROW_TILE, 80, generator=g)
        other[pos] = row
        assert torch.equal(ops.linear(other, w, b)[pos], full[3])


def test_lora_shrink_expand_match_reference_and_are_invariant():
    g = torch.Generator().manual_seed(1)
    lora_a = torch.randn(3, 2, 8, 64, generator=g)
    lora_b = torch.randn(3, 48, 8, generator=g)
    scale = torch.tensor([0.5, 2.0, 1.0])
    x = torch.randn(20, 64, generator=g)
    ids = torch.tensor([0, 1, -1, 2, 0] * 4, dtype=torch.int32)
    groups = group_tokens(ids, 3)
    h = ops.lora_shrink(x, lora_a, groups, scale)
    torch.testing.assert_close(h, lora_shrink_ref(x, lora_a, ids, scale), rtol=1e-5, atol=1e-5)
    y0 = torch.randn(20, 48, generator=g)
    y = ops.lora_expand(y0.clone(), h, lora_b, groups, (0, 32, 48))
    ref = lora_expand_ref(y0.clone(), h, lora_b, ids, (0, 32, 48))
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(y[2], y0[2])  # no adapter: untouched
    for rows in ([0], [3, 7], list(range(9, 20))):
        sub = group_tokens(ids[rows], 3)
        assert torch.equal(ops.lora_shrink(x[rows], lora_a, sub, scale), h[:, rows])


def _paged(seq_lens, hq=4, hk=2, d=16, page=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    pages = sum(-(-n // page) for n in seq_lens) + 2
    k_cache = torch.zeros(pages, page, hk, d)
    v_cache = torch.zeros(pages, page, hk, d)
    perm = torch.randperm(pages, generator=g).tolist()  # scattered pages
    tables, used = [], 0
    for n in seq_lens:
        tables.append(perm[used : used + -(-n // page)])
        used += len(tables[-1])
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    for b, n in enumerate(seq_lens):
        k = torch.randn(n, hk, d, generator=g)
        v = torch.randn(n, hk, d, generator=g)
        slots = torch.tensor([tables[b][p // page] * page + p % page for p in range(n)])
        write_kv_ref(k, v, k_cache, v_cache, slots)
    q = torch.randn(sum(seq_lens), hq, d, generator=g)
    return q, k_cache, v_cache, bt


def test_paged_attention_matches_reference():
    lens = [1, 7, 40]
    q, kc, vc, bt = _paged(lens)
    qsl = torch.tensor([0, 1, 8, 48], dtype=torch.int32)
    sl = torch.tensor(lens, dtype=torch.int32)
    out = ops.paged_attention(q, kc, vc, bt, sl, qsl, 0.25)
    torch.testing.assert_close(out, paged_attention_ref(q, kc, vc, bt, sl, qsl, 0.25),
                               rtol=1e-5, atol=1e-5)


def test_paged_attention_query_bits_independent_of_chunking_and_decode():
    n = 45
    q, kc, vc, bt = _paged([n], seed=3)
    scale = 0.25

    def run(lo, hi):  # queries lo..hi-1 of the sequence, context hi
        qsl = torch.tensor([0, hi - lo], dtype=torch.int32)
        return ops.paged_attention(q[lo:hi], kc, vc, bt, torch.tensor([hi], dtype=torch.int32),
                                   qsl, scale)

    full = run(0, n)
    for lo, hi in [(44, 45), (20, 21), (0, 16), (16, 33), (30, 45), (5, 6)]:
        assert torch.equal(run(lo, hi), full[lo:hi]), (lo, hi)

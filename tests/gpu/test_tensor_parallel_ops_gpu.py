"""The GEMMs of tensor parallelism on one GPU, bf16, Llama-3.2-3B and Llama-3.1-8B shapes:
what 1, 2, 4 and 8 ranks would compute, bit for bit equal to one device.

Row-parallel (o, down): the ranks' group partials (``linear_partials`` over their K shard,
G / ranks groups each, batched) added in group order equal the one-launch grouped linear.
Column-parallel (q|k|v, gate|up, LM head): a shard's columns with the layer's K split equal
the layer's columns. Every M from decode to prefill, both kernel paths (split, persistent).
"""

import pytest
import torch

from detlora.ops import grouped_linear as gl
from detlora.ops import matmul as mm

pytestmark = pytest.mark.gpu

DEV = "cuda"
M_VALUES = (1, 7, 64, 200, 2048)
# (N, K): o and down of Llama-3.2-3B and Llama-3.1-8B.
ROW_SHAPES = [(3072, 3072), (3072, 8192), (4096, 4096), (4096, 14336)]
# q|k|v, gate|up, LM head of the same models.
COLUMN_SHAPES = [(5120, 3072), (16384, 3072), (128256, 3072), (6144, 4096), (28672, 4096)]


def _data(m, n, k, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(m, k, device=DEV, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, device=DEV, generator=g) / k**0.5).to(torch.bfloat16)
    b = torch.randn(n, device=DEV, generator=g).to(torch.bfloat16)
    return x, w, b


@pytest.mark.parametrize("n,k", ROW_SHAPES)
@pytest.mark.parametrize("m", M_VALUES)
def test_row_parallel_partials_give_the_grouped_linear(n, k, m):
    x, w, b = _data(m, n, k, seed=n + k + m)
    groups = gl.k_groups(k)
    assert groups == 8 and mm.KSplit.equal_groups(k, groups) is not None
    one = gl.linear_grouped(x, w, b, groups)
    ref = x.double() @ w.double().T + b.double()
    assert float((one.double() - ref).norm() / ref.norm()) < 1e-2
    for ranks in (1, 2, 4, 8):
        kr = k // ranks
        parts = [gl.linear_partials(x[:, r * kr:(r + 1) * kr], w[:, r * kr:(r + 1) * kr],
                                    groups // ranks) for r in range(ranks)]
        got = gl.sum_partials(torch.cat(parts), b, torch.bfloat16)
        assert torch.equal(got, one), f"{ranks} ranks"


@pytest.mark.parametrize("n,k", COLUMN_SHAPES)
@pytest.mark.parametrize("m", M_VALUES)
def test_column_shards_give_the_layers_columns(n, k, m):
    x, w, _ = _data(m, n, k, seed=n + k + m)
    split = mm.k_split(n, k)
    full = mm.linear(x, w)
    for ranks in (2, 4, 8):
        width = -(-n // ranks)
        for r in (0, ranks - 1):
            rows = slice(r * width, min(n, (r + 1) * width))
            assert torch.equal(mm.linear(x, w[rows], split=split), full[:, rows]), \
                f"{ranks} ranks, rank {r}"


def test_narrow_column_shard_needs_the_layers_split():
    """Where a shard's own width would split K differently (Llama-8B's KV slice at 8 ranks),
    the layer's split is what keeps the bits."""
    n, k = 6144, 4096
    assert mm.k_split(n // 8, k) != mm.k_split(n, k)
    x, w, _ = _data(64, n, k, seed=1)
    full = mm.linear(x, w)
    assert torch.equal(mm.linear(x, w[: n // 8], split=mm.k_split(n, k)), full[:, : n // 8])


# ----------------------------------------------------------------------------- uneven shapes
# Issue 50: widths of real models whose K groups are not whole 64-wide blocks, or whole but an
# odd count of them. What t ranks compute is simulated on one GPU through the engine's own
# backend (the ops the layers call), bit for bit against the one-device layer.

BF16 = torch.bfloat16
# (N, K) of row-parallel layers, with K / 8 (the group) in blocks of 64:
UNEVEN_ROW_SHAPES = [
    (576, 576),     # SmolLM2-135M o: groups of 72 (1.125 blocks)
    (576, 1536),    # SmolLM2-135M down: 192 (3)
    (896, 896),     # Qwen2.5-0.5B o: 112 (1.75)
    (896, 4864),    # Qwen2.5-0.5B down: 608 (9.5)
    (1152, 6912),   # Gemma 3 1B down: 864 (13.5)
    (3136, 5120),   # Nemotron-H 4B o: 640 (10)
    (3136, 7680),   # Nemotron-H 4B Mamba-2 out_proj: 960 (15)
    (3136, 12544),  # Nemotron-H 4B down: 1568 (24.5)
    (3584, 3584),   # Qwen2.5-7B o: 448 (7)
    (3584, 18944),  # Qwen2.5-7B down: 2368 (37)
    (96, 200),      # the tiny model: 25
    (192, 520),     # 65
]
# Column-parallel layers: (slice widths, K, bias, KV heads, head_dim) with the KV slices last
# (their rows follow kv_head_shard: replicated past the KV head count), or no KV heads (MLP).
UNEVEN_COLUMN_LAYERS = [
    ((896, 128, 128), 896, True, 2, 64),          # Qwen2.5-0.5B q|k|v
    ((4864, 4864), 896, False, None, None),        # Qwen2.5-0.5B gate|up
    ((3584, 512, 512), 3584, True, 4, 128),       # Qwen2.5-7B q|k|v
    ((18944, 18944), 3584, False, None, None),     # Qwen2.5-7B gate|up
    ((5120, 1024, 1024), 3136, False, 8, 128),    # Nemotron-H 4B q|k|v
    ((12544,), 3136, False, None, None),           # Nemotron-H 4B up (relu^2, not gated)
    ((1024, 256, 256), 1152, False, 1, 256),      # Gemma 3 1B q|k|v (1 KV head: replicated)
    ((6912, 6912), 1152, False, None, None),       # Gemma 3 1B gate|up
    ((1536, 1536), 576, False, None, None),        # SmolLM2-135M gate|up
]
# (vocabulary, hidden) of LM heads: shards of vocab_shard_rows, the last padded with zeros.
UNEVEN_HEADS = [(49152, 576), (151936, 896), (152064, 3584), (262144, 1152), (131072, 3136),
                (128256, 2048)]


@pytest.fixture(scope="module")
def backend():
    from detlora.layers.backend import make_backend

    return make_backend(DEV, "batch_invariant", dtype=BF16)


def _rank_sizes(groups: int) -> list[int]:
    return [t for t in (1, 2, 4, 8) if groups % t == 0]


@pytest.mark.parametrize("n,k", UNEVEN_ROW_SHAPES)
@pytest.mark.parametrize("m", M_VALUES)
def test_row_parallel_uneven_groups_give_one_device_bits(backend, n, k, m):
    """RowParallelLinear's two paths: one device's ``row_linear`` (one launch when the groups
    are whole blocks, else the partials) against t ranks' ``linear_partials`` of G / t groups
    each, gathered and summed in group order."""
    x, w, b = _data(m, n, k, seed=n + k + m)
    groups = gl.k_groups(k)
    assert groups == 8
    one = backend.row_linear(x, w, b, groups)
    ref = x.double() @ w.double().T + b.double()
    assert float((one.double() - ref).norm() / ref.norm()) < 1e-2
    for ranks in _rank_sizes(groups):
        kr = k // ranks
        parts = [backend.linear_partials(x[:, r * kr:(r + 1) * kr].contiguous(),
                                         w[:, r * kr:(r + 1) * kr].contiguous(),
                                         groups // ranks) for r in range(ranks)]
        got = backend.sum_partials(torch.cat(parts), b, BF16)
        assert torch.equal(got, one), f"{ranks} ranks"


@pytest.mark.parametrize("n,k", [(576, 576), (3136, 12544), (3584, 18944)])
@pytest.mark.parametrize("m", (1, 64, 300))
def test_row_parallel_slot_columns_on_uneven_groups(backend, n, k, m):
    """A row-parallel layer with in_gemm LoRA: the slot columns (A of each slot) ride in the
    grouped GEMM; one device may skip unused slots' tiles, ranks compute every column, and
    the used columns agree bit for bit."""
    from detlora.ops.adapter_groups import group_tokens
    from detlora.ops.slot_columns import SlotColumns

    slots, width = 4, 16
    x, w, _ = _data(m, n + slots * width, k, seed=n + k + m + 1)
    ids = (torch.arange(m, device=DEV) % 3 - 1).to(torch.int32)  # none, slot 0, slot 1
    sc = SlotColumns(n, width, group_tokens(ids, slots))
    groups = gl.k_groups(k)
    one = backend.row_linear(x, w, None, groups, slot_columns=sc)
    # The base columns and the slots some row uses (one row uses none: every slot skipped).
    used = slice(0, n + width * len({int(i) for i in ids.tolist() if i >= 0}))
    for ranks in _rank_sizes(groups)[1:]:
        kr = k // ranks
        parts = [backend.linear_partials(x[:, r * kr:(r + 1) * kr].contiguous(),
                                         w[:, r * kr:(r + 1) * kr].contiguous(),
                                         groups // ranks) for r in range(ranks)]
        got = backend.sum_partials(torch.cat(parts), None, BF16)
        assert torch.equal(got[:, used], one[:, used]), f"{ranks} ranks"


def _column_rows(widths, kv_heads, head_dim, rank, ranks):
    """ColumnParallelLinear's rows of rank ``rank``: per slice an even shard, KV slices by
    kv_head_shard (replicated past the KV head count)."""
    from detlora.distributed.sharding import even_shard, kv_head_shard

    rows, start = [], 0
    for s, n in enumerate(widths):
        if kv_heads is not None and s > 0:
            lo, hi = kv_head_shard(kv_heads, rank, ranks)
            lo, hi = lo * head_dim, hi * head_dim
        else:
            lo, hi = even_shard(n, rank, ranks)
        rows.append(torch.arange(start + lo, start + hi))
        start += n
    return torch.cat(rows).to(DEV)


@pytest.mark.parametrize("widths,k,bias,kv_heads,head_dim", UNEVEN_COLUMN_LAYERS)
@pytest.mark.parametrize("m", (1, 64, 300))
def test_column_shards_of_uneven_layers_give_the_layers_columns(backend, widths, k, bias,
                                                               kv_heads, head_dim, m):
    n = sum(widths)
    x, w, b = _data(m, n, k, seed=n + k + m)
    b = b if bias else None
    full = backend.column_linear(x, w, b, n)
    for ranks in (2, 4, 8):
        if any(wd % ranks for wd in widths[:1 if kv_heads else None]) or (
                kv_heads and kv_heads % ranks and ranks % kv_heads):
            continue
        for r in range(ranks):
            rows = _column_rows(widths, kv_heads, head_dim, r, ranks)
            got = backend.column_linear(x, w[rows].contiguous(),
                                        None if b is None else b[rows].contiguous(), n)
            assert torch.equal(got, full[:, rows]), f"{ranks} ranks, rank {r}"


@pytest.mark.parametrize("vocab,hidden", UNEVEN_HEADS)
def test_vocab_parallel_head_of_uneven_vocabularies(backend, vocab, hidden):
    """The LM head's vocabulary shards (padded with zero rows), each computed with the whole
    head's K split, gathered: one device's logits."""
    from detlora.distributed.sharding import vocab_shard_rows

    x, w, _ = _data(64, vocab, hidden, seed=vocab)
    full = backend.column_linear(x, w, None, vocab)
    for ranks in (2, 4, 8):
        rows = vocab_shard_rows(vocab, ranks)
        padded = torch.zeros(ranks * rows, hidden, dtype=BF16, device=DEV)
        padded[:vocab] = w
        shards = [backend.column_linear(x, padded[r * rows:(r + 1) * rows], None, vocab)
                  for r in range(ranks)]
        got = torch.cat(shards, dim=1)[:, :vocab]
        assert torch.equal(got, full), f"{ranks} ranks"


@pytest.mark.parametrize("inter", (1536, 4864, 12544, 18944, 200, 520))
def test_silu_and_mul_of_a_shard_gives_the_layers_columns(inter):
    from detlora.ops.silu_and_mul import silu_and_mul

    g = torch.Generator(device=DEV).manual_seed(inter)
    x = (torch.randn(37, 2 * inter, device=DEV, generator=g) * 4).to(BF16)
    full = silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    for ranks in (2, 4, 8):
        if inter % ranks:
            continue
        part = inter // ranks
        for r in range(ranks):
            cols = slice(r * part, (r + 1) * part)
            got = silu_and_mul(torch.cat([gate[:, cols], up[:, cols]], dim=1))
            assert torch.equal(got, full[:, cols]), f"{ranks} ranks, rank {r}"


# (q heads, KV heads, head_dim, ranks). Past the KV head count the ranks replicate KV heads
# and the GQA group each rank's kernel sees shrinks (Gemma 3 1B 4/1 at 2 and 4, Gemma 3 4B
# 8/4 at 8, Gemma 4 E4B's sliding layers 8/2 at 4 and 8); otherwise it stays (Qwen2.5 14/2
# and 28/4, Nemotron-H 4B 40/8, Llama 3.1 8B 32/8).
ATTENTION_SPLITS = [(4, 1, 256, 2), (4, 1, 256, 4), (8, 4, 256, 8), (8, 2, 256, 4),
                    (8, 2, 256, 8), (14, 2, 64, 2), (28, 4, 128, 4), (40, 8, 128, 8),
                    (32, 8, 128, 8)]


def _attention_case(hq, hk, d, lens, seed):
    """K/V of ``lens`` sequences written into shuffled pages of 16, and queries."""
    from detlora.ops import paged_attention as pa

    page = 16
    g = torch.Generator(device=DEV).manual_seed(seed)
    pages = [-(-n // page) for n in lens]
    perm = torch.randperm(sum(pages) + 3, device=DEV, generator=g)
    k_cache = torch.zeros(sum(pages) + 3, page, hk, d, dtype=BF16, device=DEV)
    v_cache = torch.zeros_like(k_cache)
    tables = torch.zeros(len(lens), max(pages), dtype=torch.int32, device=DEV)
    start = 0
    for b, n in enumerate(lens):
        mine = perm[start:start + pages[b]]
        start += pages[b]
        tables[b, :len(mine)] = mine.int()
        pos = torch.arange(n, device=DEV)
        k = torch.randn(n, hk, d, device=DEV, generator=g).to(BF16)
        v = torch.randn(n, hk, d, device=DEV, generator=g).to(BF16)
        pa.write_kv(k, v, k_cache, v_cache, mine[pos // page] * page + pos % page)
    q = torch.randn(sum(lens), hq, d, device=DEV, generator=g).to(BF16)
    return q, k_cache, v_cache, tables


@pytest.mark.parametrize("hq,hk,d,ranks", ATTENTION_SPLITS)
def test_attention_of_a_ranks_heads_gives_one_device_bits(hq, hk, d, ranks):
    """A rank's query heads over its KV heads (split, or one replicated head: a smaller GQA
    group) give the whole attention's rows for those heads: prefill of whole prompts, a
    chunk after a cached prefix, and a decode step (the 16-row tile)."""
    from detlora.distributed.sharding import even_shard, kv_head_shard
    from detlora.ops import paged_attention as pa

    lens = [37, 300, 5, 129]
    q_all, k_cache, v_cache, tables = _attention_case(hq, hk, d, lens, seed=hq * d + ranks)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    calls = {  # name: (query rows per sequence, max_query_len)
        "prefill": (lens, None),
        "chunk": ([min(n, 17) for n in lens], 17),
        "decode": ([1] * len(lens), 1),
    }
    offsets = [0, *torch.tensor(lens).cumsum(0).tolist()]
    for name, (q_lens, max_len) in calls.items():
        # Each sequence's last q_len positions.
        q = torch.cat([q_all[offsets[b + 1] - n:offsets[b + 1]] for b, n in enumerate(q_lens)])
        qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32,
                           device=DEV)
        scale = d ** -0.5
        full = pa.paged_attention(q, k_cache, v_cache, tables, seq_lens, qsl, scale,
                                  max_query_len=max_len)
        for r in range(ranks):
            qlo, qhi = even_shard(hq, r, ranks)
            klo, khi = kv_head_shard(hk, r, ranks)
            got = pa.paged_attention(q[:, qlo:qhi].contiguous(),
                                     k_cache[:, :, klo:khi].contiguous(),
                                     v_cache[:, :, klo:khi].contiguous(), tables, seq_lens,
                                     qsl, scale, max_query_len=max_len)
            assert torch.equal(got, full[:, qlo:qhi]), f"{name}: rank {r} of {ranks}"


@pytest.mark.parametrize("widths", [(5120, 1024, 1024), (12544,), (896, 128, 128),
                                    (4864, 4864)])
def test_lora_expand_of_a_column_shard_gives_the_layers_columns(widths):
    """The column-parallel expand: B's rows of a shard, each slice's update added to the
    shard's columns, equal the whole layer's (the rank sum runs per column)."""
    from detlora.ops.adapter_groups import group_tokens
    from detlora.ops.lora_expand import lora_expand

    m, rank, adapters = 50, 16, 3
    g = torch.Generator(device=DEV).manual_seed(sum(widths))
    n = sum(widths)
    y = torch.randn(m, n, device=DEV, generator=g).to(BF16)
    h = torch.randn(len(widths), m, rank, device=DEV, generator=g)
    lora_b = (torch.randn(adapters, n, rank, device=DEV, generator=g) * 0.1).to(BF16)
    groups = group_tokens((torch.arange(m, device=DEV) % (adapters + 1) - 1).int(), adapters)
    offsets = [0, *torch.tensor(widths).cumsum(0).tolist()]
    full = lora_expand(y.clone(), h, lora_b, groups, offsets)
    for ranks in (2, 4, 8):
        for r in (0, ranks - 1):
            rows = _column_rows(widths, None, None, r, ranks)
            part_widths = [wd // ranks for wd in widths]
            got = lora_expand(y[:, rows].contiguous(), h, lora_b[:, rows].contiguous(), groups,
                              [0, *torch.tensor(part_widths).cumsum(0).tolist()])
            assert torch.equal(got, full[:, rows]), f"{ranks} ranks, rank {r}"

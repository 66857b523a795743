"""Arguments that change with the batch make no new compiled kernel variants.

Triton compiles a variant per specialization of a launch: every int argument's ``== 1`` and
``% 16``, every pointer's 16-byte alignment, every constexpr value. On the H200 one paged
attention variant takes ~1.2 s to compile, so a serving engine must not meet a new one because
a step had another batch size (benchmarks/results/first_cache_hit.json: the first prefix-cache
hit compiled one until fff7c66).
"""

import pytest
import torch

from detlora.ops import (
    lora_expand,
    lora_expand_rotary_write_kv,
    lora_expand_silu_and_mul,
    lora_shrink,
    matmul,
    rms_norm,
    softmax,
)
from detlora.ops import paged_attention as pa
from detlora.ops import paged_attention_split_kv as pas

# kernel, ints that change with the batch, pointers whose alignment changes with the launch
BATCH_DEPENDENT = [
    (pa._paged_attention_kernel, {*pa.STEP_INTS, "seg_blocks"},
     {*pa.INDEX_POINTERS, "counter_ptr"}),
    (pas._split_kv_kernel, set(pa.STEP_INTS), set(pa.INDEX_POINTERS)),
    (pas._combine_kernel, {"num_splits", "num_tokens"}, set()),
    (softmax._softmax_stats_kernel, {"stats_plane"}, set()),
    (softmax._softmax_kernel, {"stats_plane"}, set()),
    (softmax._log_softmax_kernel, {"stats_plane"}, set()),
    # One scalar a row through the caller's views (c=16 serving compiled one mid-level).
    (softmax._chosen_logprob_kernel, {"stats_plane", "stride_index", "stride_out"},
     {"index_ptr", "out_ptr", "stats_ptr"}),
    (rms_norm._rms_norm_kernel, {"n_rows"}, set()),
    (rms_norm._fused_add_rms_norm_kernel, {"n_rows"}, set()),
    (matmul._mm_split_kernel, {"M", "num_groups"}, {"group_adapter_ptr", "group_size_ptr"}),
    (matmul._mm_persistent_kernel, {"M"}, set()),
    (lora_shrink._tree_reduce_kernel, {"M", "stride_ps"}, set()),
    # min(M, slots + 1) adapter groups: read only by a group cap's loop
    (lora_shrink._shrink_kernel, {"num_groups"}, set()),
    # the most row tiles of M rows: read only past the programs' first tiles
    (lora_expand._expand_kernel, {"num_row_tiles"}, set()),
    (lora_expand_silu_and_mul._expand_silu_and_mul_kernel, {"num_row_tiles"}, set()),
    (lora_expand_rotary_write_kv._expand_rotary_write_kv_kernel, {"num_row_tiles"}, set()),
]


def _unspecialized(kernel) -> tuple[set[str], set[str]]:
    """Names left unspecialized (value, alignment), for a compiled or interpreted kernel."""
    if hasattr(kernel, "params"):  # JITFunction (a GPU machine)
        return ({p.name for p in kernel.params if p.do_not_specialize},
                {p.name for p in kernel.params if p.do_not_specialize_on_alignment})
    kw = kernel.kwargs  # InterpretedFunction keeps the decorator's arguments
    return set(kw["do_not_specialize"] or ()), set(kw["do_not_specialize_on_alignment"] or ())


def _names(kernel) -> set[str]:
    return {p.name for p in kernel.params} if hasattr(kernel, "params") else set(kernel.arg_names)


@pytest.mark.parametrize("kernel, ints, pointers", BATCH_DEPENDENT,
                         ids=[k[0].fn.__name__ for k in BATCH_DEPENDENT])
def test_batch_dependent_arguments_are_not_specialized(kernel, ints, pointers):
    assert ints | pointers <= _names(kernel)  # the names are the kernel's
    values, alignments = _unspecialized(kernel)
    assert ints <= values
    assert pointers <= alignments


class _Launches:
    """Stands in for a kernel: records each launch's keyword (constexpr) arguments."""

    def __init__(self) -> None:
        self.constexprs: list[dict] = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.constexprs.append(kwargs)
        return launch


def _decode_call(num_seqs: int, max_query_len: int, kv_ctas: int = 1, blocks: int = 12) -> dict:
    """The constexprs paged attention launches for ``num_seqs`` rows of ``max_query_len``
    queries each (GQA 6/2 heads of 16, pages of 4, ``blocks`` pages a row)."""
    hq, hk, d, page = 6, 2, 16, 4
    t = num_seqs * max_query_len
    q = torch.zeros(t, hq, d)
    k_cache = torch.zeros(num_seqs * blocks, page, hk, d)
    tables = torch.arange(num_seqs * blocks, dtype=torch.int32).view(num_seqs, blocks)
    seq_lens = torch.full((num_seqs,), 40, dtype=torch.int32)
    qsl = torch.arange(0, t + 1, max_query_len, dtype=torch.int32)
    launches = _Launches()
    kernel = pa._paged_attention_kernel
    pa._paged_attention_kernel = launches
    try:
        pa.paged_attention(q, k_cache, k_cache.clone(), tables, seq_lens, qsl, 0.25,
                           max_query_len=max_query_len, kv_ctas=kv_ctas)
    finally:
        pa._paged_attention_kernel = kernel
    (constexprs,) = launches.constexprs
    return constexprs


def test_unread_constexprs_do_not_follow_the_batch():
    # Direct tile numbering never reads BLOCK_B (the search block: 128 up to 128 sequences,
    # 1024 above), and the unsplit path never reads MERGE_ROWS (from the query length).
    small = _decode_call(3, 1)
    assert small["SEARCH"] is False and small["SPLIT"] is False
    assert _decode_call(200, 1) == small
    assert _decode_call(3, 2) == small
    # Where they are read, they still follow the batch: the split path's fold rows.
    split = [_decode_call(3, n, kv_ctas=2, blocks=300) for n in (1, 2)]  # 3 KV segments
    assert split[0]["SPLIT"] is True
    assert split[0]["MERGE_ROWS"] != split[1]["MERGE_ROWS"]


# Run without the interpreter (sm90_compile's subprocess): Triton's own launcher binder, for an
# sm_90 target, computes each launch's specialization from the real arguments; a batch-shape
# or graph-versus-eager difference must not show in it.
def _binder_script(module: str, kernel: str, body: str) -> str:
    """A script that binds ``module.kernel``'s launches for sm_90 (``binder``, ``Record``:
    a stand-in kernel keeping the last launch's arguments) and then runs ``body``."""
    return f"""
import json, sys
import torch
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import make_backend
from triton.runtime.jit import create_function_from_signature
from detlora.ops import {module} as mod

mod.check_same_device = lambda **tensors: None  # CPU tensors: nothing is launched here
kernel = mod.{kernel}
binder = create_function_from_signature(kernel.signature, kernel.params,
                                        make_backend(GPUTarget("cuda", 90, 32)))

class Record:
    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.args, self.kwargs = args, kwargs
        return launch
""" + body


_BINDER_SCRIPT = _binder_script("paged_attention", "_paged_attention_kernel", r"""
pa = mod

def key(num_seqs, blocks, views):
    hq, hk, d, page = 6, 2, 16, 4
    q = torch.zeros(num_seqs, hq, d, dtype=torch.bfloat16)
    k_cache = torch.zeros(400, page, hk, d, dtype=torch.bfloat16)  # an engine's: fixed
    tables = torch.zeros(num_seqs, blocks, dtype=torch.int32)
    lens = torch.full((num_seqs,), 9, dtype=torch.int32)
    qsl = torch.arange(num_seqs + 1, dtype=torch.int32)
    if views:  # a graph's static buffers: views one int32 in, not 16-byte aligned
        buf = torch.zeros(2 * num_seqs + 4, dtype=torch.int32)
        lens = buf[1:1 + num_seqs].copy_(lens)
        qsl = buf[num_seqs + 2:2 * num_seqs + 3].copy_(qsl)
    rec = Record()
    pa._paged_attention_kernel = rec
    try:
        pa.paged_attention(q, k_cache, k_cache.clone(), tables, lens, qsl, 0.25,
                           max_query_len=1, kv_ctas=1)
    finally:
        pa._paged_attention_kernel = kernel
    _, spec, _ = binder(*rec.args, **rec.kwargs)
    return [str(s) for s in spec]

cases = json.loads(sys.argv[1])
print(json.dumps([key(*c) for c in cases]))
""")


def test_graph_and_eager_launches_of_any_batch_share_a_specialization(sm90_compile):
    # (sequences, block-table width, index views): 1, 16 and 5 sequences; widths 16 and 17.
    cases = [(1, 16, False), (16, 17, True), (5, 12, True), (3, 16, False)]
    keys = sm90_compile(_BINDER_SCRIPT, cases)
    assert len(keys) == len(cases)
    assert all(k == keys[0] for k in keys[1:])


_CHOSEN_SCRIPT = _binder_script("softmax", "_chosen_logprob_kernel", r"""
softmax = mod

def key(rows, views):
    x = torch.zeros(rows, 1000, dtype=torch.bfloat16)
    index = torch.zeros(rows, dtype=torch.int64)
    out = torch.zeros(rows, dtype=torch.float64)
    if views:  # the sampler's head: a column of [T, 3], and an index sliced one element in
        out = torch.zeros(rows, 3, dtype=torch.float64)[:, 1]
        index = torch.zeros(rows + 1, dtype=torch.int64)[1:]
    rec = Record()
    softmax._chosen_logprob_kernel = rec
    try:
        softmax.chosen_logprob(x, index, out=out)
    finally:
        softmax._chosen_logprob_kernel = kernel
    _, spec, _ = binder(*rec.args, **rec.kwargs)
    return [str(s) for s in spec]

print(json.dumps([key(*c) for c in json.loads(sys.argv[1])]))
""")


def test_chosen_logprob_views_share_a_specialization(sm90_compile):
    """A column of the sampler's head or a contiguous output, an index sliced or not, any
    row count: one compiled variant."""
    keys = sm90_compile(_CHOSEN_SCRIPT, [(1, False), (16, True), (5, True), (64, False)])
    assert len(keys) == 4 and all(k == keys[0] for k in keys[1:])

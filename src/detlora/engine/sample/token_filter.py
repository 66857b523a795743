"""Temperature, top-k and top-p of the sampled rows, in token order and without a scatter.

``filter_logits(logits, temps, top_k, limit, log_softmax=..., kernels=...)`` returns fp32
[n, V]: ``x = logits.float() / temps[:, None]`` with the tokens the filters drop at -inf.

* Ranks come from a stable descending sort of ``logits`` in its own dtype (bf16 logits take
  a 16-bit radix sort on the GPU: half the passes of fp32): ties go to the lower token id,
  -0.0 and +0.0 are equal, NaN ranks above +inf (torch.sort's conventions). The order is
  defined on the raw logits: dividing by t > 0 keeps it, except where rounding makes two
  distinct logits equal in x (x is never sorted here).
* top-k keeps ranks < top_k. top-p, as the sampler has always done it: ``probs =
  exp(log_softmax(sorted_x))`` where sorted_x is x in rank order with ranks >= top_k at -inf,
  ``mass = floor(probs.double() * 2^40)``, and rank r is kept iff the mass of the ranks
  before it is below ``limit``; rank 0 always is. The kept ranks are a prefix of R ranks.
* The output is built in token order from the cut token c (rank R - 1) and its raw logit v:
  token j is kept iff ``logits[j] > v``, or ``logits[j] == v`` and ``j <= c``. That is
  exactly the set of the R best ranks of a stable descending sort, so no scatter is needed.

Every step is row-wise with a per-row fixed reduction order (the fixed-point sums are exact
integers), so a row's result never depends on the rest of the batch. The kernel path
(``kernels=True``: ``detlora.ops.sampling``'s ``scale_ranked``, ``kept_ranks`` and
``cut_filter``) gives the bits of the torch reference (``filter_logits_ref``).

Compared with the previous ``Sampler._filter`` (sort of x, then scatter): the same bits
whenever the raw logits and x rank alike (always for fp32 inputs without collisions after the
division, and for bf16 / fp16 logits, whose distinct values stay distinct in fp32). Top-k
alone with top_k < 1 keeps the best token here, none there (the sampler never passes it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from detlora.ops.checks import check_shape, check_tensor

_LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check(
    logits: object, temps: object, top_k: object, limit: object
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    logits = check_tensor("logits", logits, ndim=2, dtypes=_LOGIT_DTYPES)
    n, vocab = logits.shape
    if vocab == 0:
        raise ValueError(f"logits must have at least one column, got {tuple(logits.shape)}")
    temps = check_tensor("temps", temps, ndim=1, dtypes=(torch.float32,))
    check_shape("temps", temps, (n,))
    rows = {"temps": temps}
    if top_k is not None:
        rows["top_k"] = top_k = check_tensor("top_k", top_k, ndim=1, dtypes=(torch.int64,))
        check_shape("top_k", top_k, (n,))
    if limit is not None:
        rows["limit"] = limit = check_tensor("limit", limit, ndim=1, dtypes=(torch.int64,))
        check_shape("limit", limit, (n,))
    for name, t in rows.items():
        if t.device != logits.device:
            raise ValueError(f"{name} is on {t.device} but logits is on {logits.device}: "
                             "all tensors must share a device")
    return logits, temps, top_k, limit


def _filter(
    logits: torch.Tensor, temps: torch.Tensor, top_k: torch.Tensor | None,
    limit: torch.Tensor | None, log_softmax: Callable[[torch.Tensor], torch.Tensor],
    kernels: bool,
) -> torch.Tensor:
    from detlora.ops import sampling as ops  # here, not at import: it loads Triton

    cut_filter = ops.cut_filter if kernels else ops.cut_filter_ref
    if top_k is None and limit is None:
        return cut_filter(logits, temps, None, None)
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
    if limit is None:
        kept = top_k  # cut_filter clamps it to [1, V]
    else:
        scale_ranked = ops.scale_ranked if kernels else ops.scale_ranked_ref
        kept_ranks = ops.kept_ranks if kernels else ops.kept_ranks_ref
        # sorted_logits.float() / t is x.gather(1, order) bit for bit (elementwise ops).
        sorted_x = scale_ranked(sorted_logits, temps, top_k)
        probs = torch.exp(log_softmax(sorted_x).float())
        kept = kept_ranks(probs, limit, top_k)
    return cut_filter(logits, temps, order, kept)


def filter_logits_ref(
    logits: torch.Tensor, temps: torch.Tensor, top_k: torch.Tensor | None,
    limit: torch.Tensor | None, *, log_softmax: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """``filter_logits`` in torch ops alone (the CPU path and the kernels' oracle)."""
    logits, temps, top_k, limit = _check(logits, temps, top_k, limit)
    return _filter(logits, temps, top_k, limit, log_softmax, kernels=False)


def filter_logits(
    logits: torch.Tensor, temps: torch.Tensor, top_k: torch.Tensor | None,
    limit: torch.Tensor | None, *, log_softmax: Callable[[torch.Tensor], torch.Tensor],
    kernels: bool,
) -> torch.Tensor:
    """Temperature, then top-k and top-p, of the rows of ``logits`` (see the module doc).

    ``logits`` [n, V] fp32, bf16 or fp16; ``temps`` fp32 [n] (> 0, not checked);
    ``top_k`` int64 [n] (V = no limit) and ``limit`` int64 [n] (top-p mass in 2^-40 units,
    ``1 << 62`` = no limit) are None when no row uses that filter. ``log_softmax`` is the
    backend's row-wise fp32 log-softmax. ``kernels``: the Triton kernels (CUDA, or the CPU
    interpreter) or the torch reference; the same bits. Returns fp32 [n, V], dropped tokens
    at -inf; the inputs are never written.
    """
    logits, temps, top_k, limit = _check(logits, temps, top_k, limit)
    return _filter(logits, temps, top_k, limit, log_softmax, kernels)


__all__ = ["filter_logits", "filter_logits_ref"]

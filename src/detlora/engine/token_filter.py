"""Temperature, top-k and top-p of the sampled rows, in token order: no sort, no scatter.

``filter_logits(logits, temps, top_k, limit, log_softmax=..., kernels=...)`` returns fp32
[n, V]: ``x = logits.float() / temps[:, None]`` with the tokens the filters drop at -inf.

* Ranks are those of a stable descending sort of ``logits`` in its own dtype: ties go to
  the lower token id, -0.0 and +0.0 are equal, NaN ranks above +inf (torch.sort's
  conventions). The order is defined on the raw logits: dividing by t > 0 keeps it, except
  where rounding makes two distinct logits equal in x.
* top-k keeps ranks < top_k: ``rank_cut`` with unit weights and limit top_k gives the last
  kept token, and ``x_k`` is x with every token ranked after it at -inf.
* top-p: ``probs = exp(log_softmax(x_k))`` (in token order), ``mass = floor(probs.double()
  * 2^40)``; rank r is kept iff the mass of the ranks before it is below ``limit``; rank 0
  always is, and never a rank that top-k dropped. ``rank_cut`` finds the last kept token
  by radix selection on the logits' bits with exact integer mass sums.
* The output is built in token order from the cut token c and its raw logit v
  (``cut_filter``): token j is kept iff ``logits[j] > v``, or ``logits[j] == v`` and
  ``j <= c``: exactly the ranks up to c's of a stable descending sort.

Every step is row-wise with exact (integer) or per-row fixed reductions, so a row's result
never depends on the rest of the batch. The kernel path (``kernels=True``: the Triton
``rank_cut`` and ``cut_filter``) gives the bits of the torch reference
(``filter_logits_ref``, which sorts).

Compared with the sampler's first filter (sort of x, scatter back) and the second (sort of
the logits, top-p probabilities from a log_softmax over the sorted row): the kept ranks are
the same whenever the raw logits and x rank alike and the probabilities round alike; the
log_softmax here sums the row in token order, so a top-p cut within a rounding error of the
limit may fall one rank apart.
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
    from detlora.ops import rank_cut as rc  # here, not at import: it loads Triton
    from detlora.ops import sampling as ops

    cut_filter = ops.cut_filter if kernels else ops.cut_filter_ref
    rank_cut = rc.rank_cut if kernels else rc.rank_cut_ref
    cut = None if top_k is None else rank_cut(logits, None, top_k)
    if limit is None:
        return cut_filter(logits, temps, cut)
    probs = torch.exp(log_softmax(cut_filter(logits, temps, cut)).float())
    return cut_filter(logits, temps, rank_cut(logits, probs, limit, cut))


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

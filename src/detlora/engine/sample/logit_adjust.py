"""Per-row logit adjustments before sampling: vLLM's ``allowed_token_ids``, ``logit_bias``,
repetition, presence and frequency penalties, and ``min_p``, applied in vLLM's order.

Semantics, per logits row ``x`` (fp32: the sampler's upcast of the LM head's output), with
``out`` the row's output tokens so far and ``seen`` the set of its prompt and output tokens:

    if allowed_token_ids: x[t] = -inf for every t not in it
    x[t] += logit_bias[t]                                  for t in logit_bias
    x[t] = x[t] / rep if x[t] > 0 else x[t] * rep          for t in seen (rep != 1)
    x[t] = x[t] - frequency * out.count(t)                 for t in seen
    x[t] = x[t] - presence * (out.count(t) > 0)            for t in seen
    x[t] = -inf where x[t] < max(x) + temperature * ln(min_p)   (sampled rows, min_p > 0)

The last line is vLLM's ``p_t < min_p * max(p)`` for ``p = softmax(x / temperature)``, taken
on the logits, where the max is exact (no sum whose order could change a bit).

Every step touches one row's own entries with elementwise fp32 ops (and an exact max), so a
row's result does not depend on the other rows of the batch. ``adjust_row_ref`` is the torch
reference of one row.

Penalties are computed on the device from the rows' raw token ids: the host uploads each
penalized row's prompt and output ids as they are (no deduplication or counting in Python,
which cost the host milliseconds a step). The device sorts the (row, token) keys of every
id, so each seen entry is one run of equal keys; a run's output count is a difference of a
running sum of ones (exact integers), and every id of the run writes the same penalized
value, with the reference's arithmetic per element. The work follows the ids, not the
vocabulary, unlike a dense [rows, V] count table (see docs/decisions.md, "Penalties"). In a
step launched ahead (the engine's run-ahead) the row's last output token is still on the device,
where the sampler of the step before left it: the device reads it there as one more output id.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from detlora.config import SamplingParams


@dataclass(frozen=True)
class RowAdjust:
    """One row's adjustments, flattened for the sampler's upload."""

    allowed: tuple[int, ...] = ()
    bias_tokens: tuple[int, ...] = ()
    bias_values: tuple[float, ...] = ()
    # With penalties: the row's prompt ids and the output ids the host has read, as they are.
    prompt_tokens: tuple[int, ...] = ()
    output_tokens: tuple[int, ...] = ()
    repetition: float = 1.0
    presence: float = 0.0
    frequency: float = 0.0
    min_p_offset: float | None = None  # temperature * ln(min_p): the cut below the row's max
    # With penalties in a step launched ahead: the row's last output token is not in
    # output_tokens but on the device, at this index of the previous step's tokens.
    pending_src: int | None = None

    @property
    def penalized(self) -> bool:
        return self.repetition != 1.0 or self.presence != 0.0 or self.frequency != 0.0


def min_p_offset(params: SamplingParams) -> float | None:
    """How far below its max logit a sampled row keeps tokens; None without min_p."""
    if params.min_p <= 0.0 or params.greedy:
        return None
    return params.temperature * math.log(params.min_p)


def has_penalties(params: SamplingParams) -> bool:
    return (params.repetition_penalty != 1.0 or params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0)


def has_adjustments(params: SamplingParams) -> bool:
    """Whether a request's rows need ``row_adjust`` at all (cheap: checked every row of every
    step, so ``has_penalties`` and ``min_p_offset`` are written out here)."""
    return bool(params.repetition_penalty != 1.0 or params.presence_penalty != 0.0
                or params.frequency_penalty != 0.0 or params.logit_bias
                or params.allowed_token_ids or (params.min_p > 0.0 and params.temperature != 0.0))


def row_adjust(params: SamplingParams, prompt_ids: Sequence[int],
               output_ids: Sequence[int], pending_src: int | None = None) -> RowAdjust | None:
    """The adjustments of a row that samples after ``output_ids``; None when it has none.

    ``pending_src``: the last output token is not read yet (a negative placeholder); the
    device finds it at this index of the previous step's tokens."""
    if not has_adjustments(params):
        return None
    penalties = has_penalties(params)
    offset = min_p_offset(params)
    prompt: tuple[int, ...] = ()
    outputs: tuple[int, ...] = ()
    if not penalties:
        pending_src = None  # only penalties read the output tokens
    if penalties:
        if pending_src is not None:
            if not output_ids or output_ids[-1] >= 0 or pending_src < 0:
                raise RuntimeError("a pending output token must be the last one, unread, "
                                   "at a valid index of the previous step's tokens")
            output_ids = output_ids[:-1]
        if output_ids and min(output_ids) < 0:
            raise RuntimeError("penalties need every output token but the last on the host")
        prompt, outputs = tuple(prompt_ids), tuple(output_ids)
    bias = params.logit_bias or {}
    return RowAdjust(
        allowed=params.allowed_token_ids or (),
        bias_tokens=tuple(bias), bias_values=tuple(bias.values()),
        prompt_tokens=prompt, output_tokens=outputs, repetition=params.repetition_penalty,
        presence=params.presence_penalty, frequency=params.frequency_penalty,
        min_p_offset=offset, pending_src=pending_src,
    )


@dataclass(frozen=True)
class AdjustTensors:
    """The adjustments of one call's rows as flat index and value tensors (on the device)."""

    allowed_rows: torch.Tensor | None  # [A] row of each allowed entry
    allowed_cols: torch.Tensor | None
    masked_rows: torch.Tensor | None  # rows that have an allowed list
    bias_rows: torch.Tensor | None
    bias_cols: torch.Tensor | None
    bias_values: torch.Tensor | None  # fp32
    penalized_rows: torch.Tensor | None  # [R] the rows with penalties
    prompt_lens: torch.Tensor | None  # [R]
    prompt_tokens: torch.Tensor | None  # every penalized row's prompt ids, in row order
    output_lens: torch.Tensor | None  # [R] the output ids the host has read
    output_tokens: torch.Tensor | None  # (None when no row has one yet)
    repetition: torch.Tensor | None  # fp32 [R]
    presence: torch.Tensor | None
    frequency: torch.Tensor | None
    min_p_rows: torch.Tensor | None
    min_p_offsets: torch.Tensor | None  # fp32, one per min_p row
    pending_rows: torch.Tensor | None  # which penalized rows (0..R-1) have a token on the device
    pending_src: torch.Tensor | None  # its index in ``fed``
    fed: torch.Tensor | None = None  # the previous step's tokens (int64 or exact float64)


# (row, token) keys fit int32 up to here; int32 keys sort in half the radix passes of int64.
INT32_KEYS_UP_TO = 2**31 - 1


def _penalize(v: torch.Tensor, repetition: torch.Tensor, frequency: torch.Tensor,
              presence: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Repetition, frequency and presence penalties of seen entries (values ``v``)."""
    v = torch.where(v > 0, v / repetition, v * repetition)
    v = v - frequency * counts
    return v - presence * (counts > 0).to(v.dtype)


def fill_at(x: torch.Tensor, index: tuple[torch.Tensor, ...], value: float | bool) -> None:
    """``x[index] = value`` for index tensors, queued without a host sync: through
    ``__setitem__`` a Python scalar makes the host wait for the GPU, which undoes running
    ahead."""
    x.index_put_(index, torch.full((), value, dtype=x.dtype, device=x.device))


def _rows_of(lens: torch.Tensor, total: int) -> torch.Tensor:
    """Row 0..R-1 of every flat entry, from the rows' lengths (no host sync: total is known)."""
    return torch.repeat_interleave(torch.arange(lens.numel(), device=lens.device), lens,
                                   output_size=total)


def _apply_penalties(x: torch.Tensor, t: AdjustTensors) -> None:
    vocab, num_rows = x.shape[1], t.penalized_rows.numel()
    keys: list[torch.Tensor] = []  # row * vocab + token, rows local (0..R-1)
    is_output: list[torch.Tensor] = []
    for lens, tokens, output in ((t.prompt_lens, t.prompt_tokens, False),
                                 (t.output_lens, t.output_tokens, True)):
        if tokens is not None:
            rows = _rows_of(lens, tokens.numel())
            keys.append(rows * vocab + tokens)
            is_output.append(torch.full_like(rows, int(output)))
    if t.pending_rows is not None:
        if t.fed is None:
            raise ValueError("pending output tokens need the previous step's tokens (fed)")
        keys.append(t.pending_rows * vocab + t.fed[t.pending_src].long())
        is_output.append(torch.ones_like(t.pending_rows))
    if not keys:
        return  # no row has seen a token yet
    key_dtype = torch.int32 if num_rows * vocab <= INT32_KEYS_UP_TO else torch.int64
    key, order = torch.sort(torch.cat(keys).to(key_dtype))
    outputs_before = torch.cumsum(torch.cat(is_output)[order], 0)
    outputs_before = torch.cat([outputs_before.new_zeros(1), outputs_before])
    run_start = torch.searchsorted(key, key, side="left")
    run_end = torch.searchsorted(key, key, side="right")
    counts = (outputs_before[run_end] - outputs_before[run_start]).to(x.dtype)
    key = key.long()
    row = torch.div(key, vocab, rounding_mode="floor")
    index = (t.penalized_rows[row], key - row * vocab)
    # Duplicate indices write bit-identical values (same entry, same count): any write wins.
    x.index_put_(index, _penalize(x[index], t.repetition[row], t.frequency[row],
                                  t.presence[row], counts))


def apply_adjustments(x: torch.Tensor, t: AdjustTensors) -> None:
    """Adjust the fp32 logits ``x`` [N, V] in place (Semantics above)."""
    if t.allowed_rows is not None:
        keep = x[t.allowed_rows, t.allowed_cols]
        fill_at(x, (t.masked_rows,), float("-inf"))
        x[t.allowed_rows, t.allowed_cols] = keep
    if t.bias_rows is not None:
        x[t.bias_rows, t.bias_cols] = x[t.bias_rows, t.bias_cols] + t.bias_values
    if t.penalized_rows is not None:
        _apply_penalties(x, t)
    if t.min_p_rows is not None:
        rows = x[t.min_p_rows]
        cut = rows.amax(dim=-1, keepdim=True) + t.min_p_offsets[:, None]
        x[t.min_p_rows] = rows.masked_fill(rows < cut, float("-inf"))


def adjust_row_ref(x: torch.Tensor, params: SamplingParams, prompt_ids: Sequence[int],
                   output_ids: Sequence[int]) -> torch.Tensor:
    """Torch reference: one row [V] adjusted as Semantics says, element by element."""
    x = x.float().clone()
    if params.allowed_token_ids:
        keep = torch.full_like(x, float("-inf"))
        idx = torch.tensor(params.allowed_token_ids)
        keep[idx] = x[idx]
        x = keep
    for t, b in (params.logit_bias or {}).items():
        x[t] = x[t] + torch.tensor(b, dtype=torch.float32)
    if has_penalties(params):
        out = Counter(output_ids)
        rep = torch.tensor(params.repetition_penalty, dtype=torch.float32)
        for t in dict.fromkeys([*prompt_ids, *output_ids]):
            v = x[t] / rep if x[t] > 0 else x[t] * rep
            v = v - torch.tensor(params.frequency_penalty, dtype=torch.float32) * out[t]
            v = v - torch.tensor(params.presence_penalty, dtype=torch.float32) * (out[t] > 0)
            x[t] = v
    offset = min_p_offset(params)
    if offset is not None:
        cut = x.max() + torch.tensor(offset, dtype=torch.float32)
        x = torch.where(x < cut, torch.tensor(float("-inf")), x)
    return x

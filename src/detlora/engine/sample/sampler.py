"""Choosing each sequence's next token from its logits row, independently of the batch.

Every operation here works row by row, so a row's result depends on its own logits, sampling
parameters, seed and position, never on which other rows share the step:

* greedy (temperature 0): argmax, ties to the lowest token id;
* otherwise: logits / temperature, then top-k and top-p filters, then Gumbel-max: the token
  maximising ``logit + g`` (in float64) with ``g = -log(-log(u))``. ``u`` comes from a
  counter-based hash of (seed, position, token id) in 32-bit integer arithmetic (identical on
  CPU and GPU), so a draw depends on nothing but those three numbers. The hash and the
  Gumbel-max are ``detlora.ops.sampling``: its torch reference on the CPU, its Triton kernel
  on CUDA (the same bits);
* top-k keeps the k best ranks of a stable descending sort of the raw logits (the model's
  dtype; ties: lower token id first); top-p keeps the shortest prefix of that order whose
  probability reaches ``top_p``, with the running sum taken in 2^-40 fixed point: integer
  sums do not depend on the scan order (``detlora.engine.sample.token_filter``);
* before all of the above: a row's grammar mask (``structured_outputs``: every token the
  grammar does not allow goes to -inf, ``detlora.engine.sample.grammar``), its banned tokens
  (``min_tokens``), then its ``allowed_token_ids``, ``logit_bias``, penalties and ``min_p``
  adjust its fp32 logits (``detlora.engine.sample.logit_adjust``); a call with such a row
  ranks every row in fp32;
* logprobs (``LogprobsMode``, vLLM's ``logprobs_mode``): by default ``log_softmax`` of the
  raw logits (the model's distribution), fp32; on request of the processed logits (after the
  adjustments, temperature and filters), or those logits themselves. The chosen token's comes
  from ``chosen_logprob`` (that one column, the same bits); the full row only when a request
  wants top logprobs. Its rank is 1 + the number of tokens with a strictly higher logit in
  the same distribution (an integer count: batch-invariant);
* a row whose logits are not all finite (NaN, inf) is flagged (``SampleResult.finite``) and
  gets a safe token id on the device (``detlora.engine.sample.finite_rows``): no id outside
  the vocabulary ever comes out, and the flag travels in the same read as the tokens.

Logits arrive in the model's dtype (the LM head's output: no fp32 copy of [N, V]) or fp32;
every value the sampler computes is that of their fp32 upcast, so both give the same results.

Per call, the per-row parameters (row indices, keys, temperatures, top-k, top-p limits, banned
tokens) go to the device in one copy, and the results come back in one read.
"""

from __future__ import annotations

import array
import hashlib
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from detlora.config import LogprobsMode, SamplingParams
from detlora.engine.runner.copy_fence import PinnedStaging
from detlora.engine.sample.finite_rows import finite_rows, safe_tokens
from detlora.engine.sample.logit_adjust import AdjustTensors, RowAdjust, apply_adjustments, fill_at
from detlora.engine.sample.token_filter import filter_logits

_FIXED_POINT = 1 << 40  # top-p mass unit: exact int64 sums for up to 2^23 tokens
_SEED_KEYS_KEPT = 1 << 16  # seed keys a sampler caches before it starts over
_NO_LIMIT = 1 << 62  # top-p limit of a row with top_p = 1: above any row's total mass
# Moved to detlora.ops.sampling; still importable from here (see __getattr__).
_OPS_NAMES = ("_MASK32", "_mul32", "_mix32", "gumbel_noise", "token_hash", "uniform_noise")


def __getattr__(name: str) -> Any:
    # detlora.ops.sampling loads Triton, which must not happen when the engine is imported
    # (TRITON_INTERPRET is read when a kernel is defined): it is imported on first use.
    if name in _OPS_NAMES:
        from detlora.ops import sampling

        return getattr(sampling, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class SampleRequest(NamedTuple):
    """What the sampler needs for one logits row (a NamedTuple: the engine builds one per
    row every step, and a frozen dataclass costs several times as much to build)."""

    params: SamplingParams
    seed: int  # 64-bit
    position: int  # index the sampled token will take in its sequence
    banned_token_ids: tuple[int, ...] = ()  # e.g. EOS before min_tokens
    adjust: RowAdjust | None = None  # allowed tokens, logit bias, penalties, min_p
    token_mask: torch.Tensor | None = None  # a grammar's allowed tokens: int32 bitmask (CPU)


class SampleResult(NamedTuple):
    """One row's sampled token (a NamedTuple, as ``SampleRequest``: one per row per step)."""

    token_id: int
    logprobs: dict[int, float] | None  # chosen token first, then the top ``params.logprobs``
    finite: bool = True  # False: the row's logits held a NaN or inf (token_id is a stand-in)
    ranks: tuple[int, ...] | None = None  # each logprobs entry's rank, in its order


def derive_seed(engine_seed: int, index: int) -> int:
    """The seed of a request without one: a 64-bit hash of (engine seed, request index)."""
    digest = hashlib.blake2b(f"{engine_seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _seed_key(mix: Callable[[int], int], seed: int) -> int:
    """The part of a row's keys that depends on its seed alone."""
    k = mix((seed & 0xFFFFFFFF) ^ 0x9E3779B9)
    return mix(k ^ ((seed >> 32) & 0xFFFFFFFF))


def _position_keys(mix: Callable[[int], int], seed_key: int,
                   position: int) -> tuple[int, int]:
    k1 = mix(seed_key ^ (position & 0xFFFFFFFF))
    return k1, mix(k1 ^ 0x85EBCA6B)


def _row_keys(mix: Callable[[int], int], seed: int, position: int) -> tuple[int, int]:
    return _position_keys(mix, _seed_key(mix, seed), position)


def row_keys(seed: int, position: int) -> tuple[int, int]:
    """Two 32-bit keys for one (seed, position): the row's two hash streams."""
    from detlora.ops.sampling import _mix32

    return _row_keys(_mix32, seed, position)


def _rows(idx: list[int], n: int) -> slice | None:
    """``idx`` (ascending, distinct) as a slice when it is one run of rows, else None."""
    if idx and idx[-1] - idx[0] + 1 == len(idx):
        return slice(idx[0], idx[-1] + 1) if len(idx) < n else slice(None)
    return None


def _top_entry(token: int, value: float, rank: int, top_values: Sequence[float],
               top_ids: Sequence[float]) -> tuple[dict[int, float], tuple[int, ...]]:
    """{token: value, then the top tokens not already listed} and each entry's rank: the
    token's own, then the top ones' places 1, 2, ... in the sorted order."""
    entry = {token: value}
    ranks = [rank]
    for place, v in enumerate(top_values):
        t = int(top_ids[place])
        if t not in entry:
            entry[t] = v
            ranks.append(place + 1)
    return entry, tuple(ranks)


class _Upload:
    """int64 values gathered on the host during a call, sent to the device in one copy."""

    def __init__(self) -> None:
        self.values: list[int] = []

    def add(self, values: Sequence[int]) -> slice:
        start = len(self.values)
        self.values.extend(values)
        return slice(start, len(self.values))

    def rows(self, idx: list[int], n: int) -> slice | tuple[slice]:
        """A slice of the rows, or (section,) to be resolved as an index tensor."""
        run = _rows(idx, n)
        return run if run is not None else (self.add(idx),)

    def send(self, device: torch.device, staging: PinnedStaging) -> torch.Tensor:
        if device.type != "cuda":
            return torch.tensor(self.values, dtype=torch.int64)
        # Pinned + non_blocking: the copy queues behind the forward pass instead of waiting
        # for it, so the host keeps launching; the one sync is the read at the end.
        host = staging.take(len(self.values))
        host.numpy()[:] = self.values
        dev = host.to(device, non_blocking=True)
        staging.fence.record()
        return dev


def _column_of(
    log_softmax: Callable[[torch.Tensor], torch.Tensor],
) -> Callable[..., torch.Tensor]:
    """A ``chosen_logprob(x, index, *, out=None)`` from a full row-wise log-softmax: its fp32
    values of ``x.float()``, one column per row gathered."""

    def chosen_logprob(x: torch.Tensor, index: torch.Tensor, *,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        lp = log_softmax(x.float()).float().gather(1, index[:, None])[:, 0]
        return lp if out is None else out.copy_(lp)

    return chosen_logprob


def _plain_greedy(requests: Sequence[SampleRequest]) -> bool:
    """Every row greedy, without banned tokens, top logprobs, adjustments or a grammar mask
    (what the greedy head answers). A run of rows sharing one params object checks it once."""
    last = None
    for r in requests:
        if r.banned_token_ids or r.adjust is not None or r.token_mask is not None:
            return False
        params = r.params
        if params is not last:
            if not params.greedy or params.logprobs:
                return False
            last = params
    return True


def _fp32_bits(values: Sequence[float]) -> list[int]:
    """The fp32 bit patterns (as unsigned ints) of Python floats, rounded as torch rounds."""
    return array.array("I", array.array("f", values).tobytes()).tolist()


_FLOAT_FIELDS = ("bias_values", "repetition", "presence", "frequency", "min_p_offsets")


def _pack_adjustments(up: _Upload, rows: list[tuple[int, RowAdjust]]) -> dict[str, slice]:
    """Every adjusted row's entries, flat, into the upload: one section per field (floats as
    fp32 bits); ``_adjust_tensors`` reads them back on the device."""
    ints: dict[str, list[int]] = {k: [] for k in (
        "allowed_rows", "allowed_cols", "masked_rows", "bias_rows", "bias_cols",
        "penalized_rows", "prompt_lens", "prompt_tokens", "output_lens", "output_tokens",
        "min_p_rows", "pending_rows", "pending_src")}
    floats: dict[str, list[float]] = {k: [] for k in _FLOAT_FIELDS}
    for i, a in rows:
        if a.penalized:
            if a.pending_src is not None:
                ints["pending_rows"].append(len(ints["penalized_rows"]))
                ints["pending_src"].append(a.pending_src)
            ints["penalized_rows"].append(i)
            ints["prompt_lens"].append(len(a.prompt_tokens))
            ints["prompt_tokens"] += a.prompt_tokens
            ints["output_lens"].append(len(a.output_tokens))
            ints["output_tokens"] += a.output_tokens
            floats["repetition"].append(a.repetition)
            floats["presence"].append(a.presence)
            floats["frequency"].append(a.frequency)
        if a.min_p_offset is not None:
            ints["min_p_rows"].append(i)
            floats["min_p_offsets"].append(a.min_p_offset)
        if a.allowed:
            ints["masked_rows"].append(i)
            ints["allowed_rows"] += [i] * len(a.allowed)
            ints["allowed_cols"] += a.allowed
        ints["bias_rows"] += [i] * len(a.bias_tokens)
        ints["bias_cols"] += a.bias_tokens
        floats["bias_values"] += a.bias_values
    sections = {k: up.add(v) for k, v in ints.items() if v}
    sections |= {k: up.add(_fp32_bits(v)) for k, v in floats.items() if v}
    return sections


def _adjust_tensors(dev: torch.Tensor, sections: dict[str, slice],
                    fed: torch.Tensor | None = None) -> AdjustTensors:
    def get(name: str) -> torch.Tensor | None:
        if name not in sections:
            return None
        t = dev[sections[name]]
        return t.view(torch.float32)[::2] if name in _FLOAT_FIELDS else t  # low half first

    fields = [name for name in AdjustTensors.__dataclass_fields__ if name != "fed"]
    return AdjustTensors(**{name: get(name) for name in fields}, fed=fed)


class PendingSample:
    """Sampled tokens (or label logprobs) on their way to the host.

    ``tokens`` stays on the device (int64 or float64 ids, one per row, always inside the
    vocabulary) for a step launched before this one is read; ``result()`` waits for the copy
    and parses it, once.
    """

    def __init__(self, host: torch.Tensor, event: torch.cuda.Event | None,
                 tokens: torch.Tensor | None,
                 parse: Callable[[list], list]) -> None:
        self.tokens = tokens
        self._host = host
        self._event = event
        self._parse = parse
        self._results: list | None = None

    @classmethod
    def read(cls, values: torch.Tensor, tokens: torch.Tensor | None,
             parse: Callable[[list], list]) -> PendingSample:
        """Start copying ``values`` to the host: pinned and non-blocking on CUDA."""
        if values.device.type != "cuda":
            return cls(values, None, tokens, parse)
        host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        host.copy_(values, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return cls(host, event, tokens, parse)

    def result(self) -> list:
        if self._results is None:
            if self._event is not None:
                self._event.synchronize()
            self._results = self._parse(self._host.tolist())
        return self._results


class Sampler:
    """Turns logits [N, V] (fp32, or the 16-bit dtype of the LM head) into one token per row.

    ``argmax``, ``log_softmax`` and ``chosen_logprob`` come from the op backend, so on the GPU
    they are the batch-invariant kernels of the engine's determinism level;
    ``chosen_logprob(x, index, *, out=None)`` must give ``log_softmax(x.float())``'s column
    ``index`` bit for bit (without it, the sampler gathers that column from a full
    ``log_softmax``). The Gumbel-max and the top-p
    prefix are ``detlora.ops.sampling`` ops: ``kernels=True`` takes its Triton kernels (on the
    CPU that needs ``TRITON_INTERPRET=1``: tests), ``False`` its torch references; the op
    backend's ``sampling_kernels`` decides for an engine. Both give the same tokens (see
    ``detlora.ops.sampling`` on the float64 ``log``).
    ``logits_dtype``: a 16-bit dtype in which fp32 logits are exact (the LM head's); the
    filters then rank them in it (the same ranks and ties, half the key bits). Logits already
    in that dtype are ranked as they are. ``logprobs_mode``: what ``logprobs`` report.
    """

    def __init__(
        self,
        argmax: Callable[[torch.Tensor], torch.Tensor],
        log_softmax: Callable[[torch.Tensor], torch.Tensor],
        *,
        chosen_logprob: Callable[..., torch.Tensor] | None = None,
        kernels: bool = False,
        logits_dtype: torch.dtype | None = None,
        logprobs_mode: LogprobsMode | str = LogprobsMode.RAW_LOGPROBS,
    ) -> None:
        from detlora.ops import sampling  # here, not at import: it loads Triton

        if logits_dtype not in (None, torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"logits_dtype must be float32, bfloat16 or float16, "
                             f"got {logits_dtype}")
        self._ops = sampling
        self._kernels = kernels
        # fp32 logits that are exact in a 16-bit dtype (an LM head computed in it) rank alike
        # there: the filters then rank 16-bit keys and read half the bytes.
        self._rank_dtype = logits_dtype if logits_dtype != torch.float32 else None
        self._argmax = argmax
        self._log_softmax = log_softmax
        self._chosen_logprob = chosen_logprob or _column_of(log_softmax)
        self.logprobs_mode = LogprobsMode.parse(logprobs_mode)
        self._token_hash: dict[tuple[int, torch.device], torch.Tensor] = {}
        self._staging = PinnedStaging()
        # ``_seed_key`` of the seeds sampled lately: a request samples with one seed at
        # every step, so half of its row keys' hashing is done once.
        self._seed_keys: dict[int, int] = {}

    def _keys_of(self, requests: Sequence[SampleRequest], rows: list[int]) -> list[int]:
        """The two row keys of each of ``rows``, flat (``row_keys`` of its seed and
        position)."""
        mix = self._ops._mix32
        cache = self._seed_keys
        if len(cache) > _SEED_KEYS_KEPT:
            cache.clear()
        out: list[int] = []
        for i in rows:
            r = requests[i]
            k = cache.get(r.seed)
            if k is None:
                k = cache[r.seed] = _seed_key(mix, r.seed)
            out += _position_keys(mix, k, r.position)
        return out

    def token_hash(self, vocab: int, device: torch.device) -> torch.Tensor:
        key = (vocab, device)
        if key not in self._token_hash:
            self._token_hash[key] = self._ops.token_hash(vocab, device)
        return self._token_hash[key]

    def greedy_head(self, logits: torch.Tensor) -> torch.Tensor:
        """float64 [N, 3]: every row's greedy token id, its logprob, and 1.0 when the row's
        logits are all finite (else 0.0, the token a safe stand-in), as ``__call__`` gives
        them for a greedy row without banned tokens. Row-wise ops only, so it can run inside
        a decode graph and be handed back to ``__call__`` as ``greedy``: the flag travels in
        the graph's outputs."""
        # Both ops read the logits in their own dtype: the argmax of 16-bit values is that of
        # their fp32 upcast (exact), and chosen_logprob gives the upcast's bits.
        finite = finite_rows(logits)
        tokens = safe_tokens(self._argmax(logits).to(torch.int64), finite)
        head = torch.empty(logits.shape[0], 3, dtype=torch.float64, device=logits.device)
        head[:, 0].copy_(tokens)
        # A greedy row's processed logits are its raw ones (no temperature, no adjustment).
        self._chosen(logits, tokens, out=head[:, 1])
        head[:, 2].copy_(finite)
        return head

    def token_logprobs(self, logits: torch.Tensor,
                       token_ids: Sequence[Sequence[int]]) -> list[dict[int, float]]:
        """Per row of ``logits``: {t: logprob} for the ids ``token_ids[i]``, from
        ``log_softmax`` of the raw logits in fp32 (no temperature, filter or adjustment):
        row-wise, so batch-invariant with the backend's log_softmax; one read."""
        return self.launch_token_logprobs(logits, token_ids).result()

    def launch_token_logprobs(self, logits: torch.Tensor,
                              token_ids: Sequence[Sequence[int]]) -> PendingSample:
        """``token_logprobs`` without waiting: queued on the device, read by ``result()``
        (so a step launched ahead is not waited for when it reads labels)."""
        width = max(len(ids) for ids in token_ids)
        index = torch.tensor([list(ids) + [ids[0]] * (width - len(ids)) for ids in token_ids],
                             dtype=torch.int64).to(logits.device, non_blocking=True)
        values = self._log_softmax(logits.float()).float().gather(1, index)
        ids_of = [tuple(int(t) for t in ids) for ids in token_ids]

        def parse(rows: list[list[float]]) -> list[dict[int, float]]:
            return [dict(zip(ids, row, strict=False))
                    for ids, row in zip(ids_of, rows, strict=True)]

        return PendingSample.read(values, None, parse)

    def _chosen(self, x: torch.Tensor, index: torch.Tensor, *,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """Column ``index`` of each row of ``x`` as the mode reports it (fp32 values)."""
        if self.logprobs_mode.logprobs:
            return self._chosen_logprob(x, index, out=out)
        v = x.gather(1, index[:, None])[:, 0].float()
        return v if out is None else out.copy_(v)

    def _values(self, x: torch.Tensor) -> torch.Tensor:
        """Every column of ``x`` as the mode reports it, fp32 [N, V]."""
        return self._log_softmax(x.float()).float() if self.logprobs_mode.logprobs else x.float()

    @staticmethod
    def _rank(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """1 + how many tokens of each row of ``x`` beat column ``index`` (in x's own dtype:
        16-bit values compare as their exact fp32 upcast would)."""
        return (x > x.gather(1, index[:, None])).sum(-1) + 1

    def prompt_logprobs(self, logits: torch.Tensor, targets: Sequence[int],
                        top_n: Sequence[int]) -> list[tuple[dict[int, float], tuple[int, ...]]]:
        """Per row of ``logits``: ({targets[i]: its logprob, then the row's ``top_n[i]`` best
        tokens (ties: lower id first)}, each entry's rank), from ``log_softmax`` of the raw
        logits in fp32 (a prompt is scored, not sampled: no temperature or filters; logprobs
        whatever the mode). Row-wise, so batch-invariant with the backend's log_softmax; one
        read."""
        index = torch.tensor(list(targets), dtype=torch.int64).to(logits.device)
        lp = self._log_softmax(logits.float()).float()
        parts = [lp.gather(1, index[:, None])[:, 0].double(),
                 self._rank(logits, index).double()]
        n = max(top_n, default=0)
        if n == 1:  # lm-eval's case: the stable sort's first is the first maximum (argmax)
            ids = torch.argmax(lp, dim=-1, keepdim=True)
            parts += [lp.gather(1, ids).double().reshape(-1), ids.double().reshape(-1)]
        elif n:
            vals, ids = torch.sort(lp, dim=-1, descending=True, stable=True)
            parts += [vals[:, :n].double().reshape(-1), ids[:, :n].double().reshape(-1)]
        values = torch.cat(parts).tolist()  # fp32 logprobs and token ids are exact in float64
        rows = len(targets)
        top = values[2 * rows :]  # the top values, then their ids
        return [_top_entry(int(target), values[i], int(values[rows + i]),
                           top[i * n : i * n + want], top[rows * n + i * n :])
                for i, (target, want) in enumerate(zip(targets, top_n, strict=True))]

    def __call__(
        self, logits: torch.Tensor, requests: Sequence[SampleRequest],
        greedy: torch.Tensor | None = None,
    ) -> list[SampleResult]:
        """One token per row (``launch`` and its ``result`` in one go)."""
        return self.launch(logits, requests, greedy).result()

    def launch(
        self, logits: torch.Tensor, requests: Sequence[SampleRequest],
        greedy: torch.Tensor | None = None, fed: torch.Tensor | None = None,
    ) -> PendingSample:
        """Queue the sampling of one token per row; ``result()`` reads them.

        On CUDA nothing here waits for the device: the results travel to pinned memory
        behind the queued work, so the host can prepare (and launch) the next step first.
        ``greedy`` (from ``greedy_head`` of these logits) answers a batch whose rows are all
        greedy, without banned tokens or top logprobs, with no further kernel, and gives
        every row's finite flag. ``fed``: the previous step's tokens on the device, for rows
        whose penalties count a token not read yet (``RowAdjust.pending_src``)."""
        if logits.dim() != 2 or logits.shape[0] != len(requests):
            raise ValueError(
                f"logits must be [N, vocab] with N = {len(requests)} rows, "
                f"got {tuple(logits.shape)}"
            )
        if fed is None and any(r.adjust is not None and r.adjust.pending_src is not None
                               for r in requests):
            raise ValueError("a row's penalties count a pending token: pass fed, the previous "
                             "step's tokens")
        n, vocab = logits.shape
        if n == 0:
            return PendingSample.read(torch.empty(0, dtype=torch.int64), None, lambda v: [])
        if greedy is not None and tuple(greedy.shape) != (n, 3):
            raise ValueError(f"greedy must be [{n}, 3], got {tuple(greedy.shape)}")
        if greedy is not None and _plain_greedy(requests):
            def parse_greedy(values: list[float]) -> list[SampleResult]:
                # The argmax: no logit above it, rank 1.
                return [SampleResult(int(t), None, ok != 0.0) if r.params.logprobs is None
                        else SampleResult(int(t), {int(t): lp}, ok != 0.0, (1,))
                        for t, lp, ok, r in zip(values[::3], values[1::3], values[2::3],
                                                requests, strict=True)]

            return PendingSample.read(greedy.reshape(-1), greedy[:, 0], parse_greedy)
        device = logits.device
        kernels = self._kernels
        raw_mode = self.logprobs_mode.raw

        # ---- host: sort the rows and gather every per-row parameter for one upload.
        greedy_rows: list[int] = []
        sampled: list[int] = []
        want: list[int] = []
        banned_rows: list[int] = []
        banned_cols: list[int] = []
        adjusted: list[tuple[int, RowAdjust]] = []
        masked: list[int] = []
        for i, r in enumerate(requests):
            (greedy_rows if r.params.greedy else sampled).append(i)
            if r.params.logprobs is not None:
                want.append(i)
            if r.banned_token_ids:
                banned_rows += [i] * len(r.banned_token_ids)
                banned_cols += r.banned_token_ids
            if r.adjust is not None:
                adjusted.append((i, r.adjust))
            if r.token_mask is not None:
                masked.append(i)
        top_n = max((requests[i].params.logprobs for i in want), default=0)
        # The greedy head answers the greedy rows (token and chosen logprob) unless one bans
        # tokens or a row wants top logprobs: only the sampled rows are then computed here.
        use_head = (greedy is not None and bool(greedy_rows) and bool(sampled) and top_n == 0
                    and not any(requests[i].banned_token_ids or requests[i].adjust is not None
                                or requests[i].token_mask is not None for i in greedy_rows))
        up = _Upload()
        g_rows = up.rows(greedy_rows, n) if greedy_rows and sampled else slice(None)
        s_rows = up.rows(sampled, n) if greedy_rows and sampled else slice(None)
        w_rows = up.rows(want, n) if want else slice(None)
        if banned_rows:
            banned_sec = up.add(banned_rows), up.add(banned_cols)
        adjust_secs = _pack_adjustments(up, adjusted) if adjusted else None
        masked_sec = up.add(masked) if masked else None
        if sampled:
            params = [requests[i].params for i in sampled]
            keys_sec = up.add(self._keys_of(requests, sampled))
            temp_sec = up.add(_fp32_bits([p.temperature for p in params]))
            top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
            top_k_sec = up.add(top_k) if any(k < vocab for k in top_k) else None
            limit_sec = None
            if any(p.top_p < 1.0 for p in params):
                # top_p = 1 keeps everything (rounding may sum the mass a hair past 1).
                limit_sec = up.add([int(p.top_p * _FIXED_POINT) if p.top_p < 1.0 else _NO_LIMIT
                                    for p in params])
        if use_head:
            # Where the sampled rows' values go in the one read: each token at its row, each
            # chosen logprob and rank at its row's place among the wanted rows (a row that
            # does not want them: spare slots after the rows' finite flags, never read).
            place = {i: j for j, i in enumerate(want)}
            with_lp = any(i in place for i in sampled)
            head_dst = list(sampled)
            flat_size = 2 * n + 2 * len(want)
            if with_lp:
                for offset in (n, n + len(want)):  # logprobs, then ranks
                    for i in sampled:
                        head_dst.append(offset + place[i] if i in place else flat_size)
                        flat_size += int(i not in place)
            head_sec = up.add(head_dst)
        dev = up.send(device, self._staging) if up.values else None

        def resolve(rows: slice | tuple[slice]) -> slice | torch.Tensor:
            return rows if isinstance(rows, slice) else dev[rows[0]]

        g_sel, s_sel, w_sel = resolve(g_rows), resolve(s_rows), resolve(w_rows)

        # ---- device.
        # Rows with a NaN or inf get a safe token below, and their flag goes in the read.
        finite = finite_rows(logits) if greedy is None else greedy[:, 2] != 0
        raw = logits  # the model's dtype: the filters rank these (bf16: a 16-bit sort)
        if adjust_secs is not None or masked:
            # Adjusted values are not exact in 16 bits: this call works in fp32 (an unadjusted
            # row's fp32 upcast ranks and samples as its 16-bit values do).
            raw = logits.float() if logits.dtype != torch.float32 else logits.clone()
        if masked:
            from detlora.engine.sample.grammar import apply_token_bitmask

            masks = torch.stack([requests[i].token_mask for i in masked])
            apply_token_bitmask(raw, dev[masked_sec], masks.to(device, non_blocking=True))
        if banned_rows:
            if raw is logits:
                raw = logits.clone()  # the caller's logits stay untouched
            fill_at(raw, (dev[banned_sec[0]], dev[banned_sec[1]]), float("-inf"))
        if adjust_secs is not None:
            # After the bans: min_p's cut is relative to the best token still allowed (every
            # other adjustment keeps -inf at -inf).
            apply_adjustments(raw, _adjust_tensors(dev, adjust_secs, fed))
        # fp32 rows for the greedy rows the head does not answer (no copy when already fp32);
        # a batch of sampled rows alone never reads them.
        x = None if use_head or not greedy_rows else raw.float()
        tokens = tok_g = tok_s = filtered = None
        if greedy_rows and not use_head:
            tok_g = safe_tokens(self._argmax(x[g_sel]).to(torch.int64), finite[g_sel])
        if sampled:
            # Temperatures travel as fp32 bits in the low half of int64 slots (little-endian).
            temps = dev[temp_sec].view(torch.float32)[::2]
            top_k_t = dev[top_k_sec] if top_k_sec is not None else None
            limit_t = dev[limit_sec] if limit_sec is not None else None
            rows = raw[s_sel]  # 16-bit logits are gathered as they are: no fp32 round trip
            if (self._rank_dtype is not None and rows.dtype == torch.float32 and not adjusted
                    and not masked):
                rows = rows.to(self._rank_dtype)  # exact: the same values, ranks and ties
            filtered = filter_logits(rows, temps, top_k_t, limit_t,
                                     log_softmax=self._log_softmax, kernels=kernels)
            keys = dev[keys_sec].view(-1, 2)
            th = self.token_hash(vocab, device)
            ops = self._ops
            tok_s = (ops.gumbel_argmax if kernels else ops.gumbel_argmax_ref)(filtered, keys, th)
            tok_s = safe_tokens(tok_s, finite[s_sel])
        if use_head:
            return self._read_with_head(greedy, tok_s, logits[s_sel] if raw_mode else filtered,
                                        dev[head_sec], with_lp, w_sel, len(want), flat_size,
                                        self._parser(requests, want, 0))
        if tok_s is None:
            tokens = tok_g
        elif tok_g is None:
            tokens = tok_s
        else:
            tokens = torch.empty(n, dtype=torch.int64, device=device)
            tokens[g_sel] = tok_g
            tokens[s_sel] = tok_s

        if not want:
            reads = [tokens, finite]
            flat = torch.empty(2 * n, dtype=torch.float64, device=device)
            for k, t in enumerate(reads):
                flat[k * n : (k + 1) * n].copy_(t)
            return PendingSample.read(flat, tokens, self._parser(requests, want, 0))
        if raw_mode:
            source = logits  # the model's distribution, before anything above
        elif filtered is None:
            source = x
        elif tok_g is None:
            source = filtered
        else:
            source = x.clone() if x is logits else x  # x may be ours already
            source[s_sel] = filtered
        chosen_ids = tokens[w_sel]
        rows = source[w_sel]
        ranks = self._rank(rows, chosen_ids)
        if top_n == 0:  # the chosen tokens' values alone: one column, no [N, V] output
            reads = [tokens, self._chosen(rows, chosen_ids), ranks]
        else:
            lp = self._values(rows)
            # Stable descending sort: equal values list the lower token id first.
            top_vals, top_ids = torch.sort(lp, dim=-1, descending=True, stable=True)
            reads = [tokens, lp.gather(1, chosen_ids[:, None]), ranks, top_vals[:, :top_n],
                     top_ids[:, :top_n]]
        reads.append(finite)
        # One read: token ids, fp32 logprobs and flags are all exact in float64.
        flat = torch.empty(sum(t.numel() for t in reads), dtype=torch.float64, device=device)
        offset = 0
        for t in reads:
            flat[offset : offset + t.numel()].view(t.shape).copy_(t)
            offset += t.numel()

        return PendingSample.read(flat, tokens, self._parser(requests, want, top_n))

    def _read_with_head(
        self, greedy: torch.Tensor, tok_s: torch.Tensor, source: torch.Tensor,
        dst: torch.Tensor, with_lp: bool, w_sel: slice | torch.Tensor, num_want: int,
        size: int, parse: Callable[[list[float]], list[SampleResult]],
    ) -> PendingSample:
        """Tokens and chosen logprobs from the greedy head, the sampled rows replaced by
        theirs (row-wise kernels: the bits the full path gives those rows; ``source``: the
        sampled rows' logits as the mode reads them). The read, flat, is n tokens, the wanted
        rows' logprobs, their ranks, then every row's finite flag (then spare slots, not
        read): filled from the head (an argmax: rank 1), then the sampled rows' values
        [tokens | logprobs | ranks] put at ``dst`` in one index_copy_ (no clone of the head,
        no 2-D index_put)."""
        n, s = greedy.shape[0], tok_s.shape[0]
        w = num_want
        flat = torch.empty(size, dtype=torch.float64, device=greedy.device)
        if w == n:  # every row wants its logprob: both columns in one copy
            flat[: 2 * n].view(2, n).copy_(greedy[:, :2].t())
        else:
            flat[:n].copy_(greedy[:, 0])
            if w:
                flat[n : n + w].copy_(greedy[w_sel, 1])
        flat[n + w : n + 2 * w].fill_(1.0)
        flat[n + 2 * w : 2 * n + 2 * w].copy_(greedy[:, 2])
        values = torch.empty(3 if with_lp else 1, s, dtype=torch.float64, device=greedy.device)
        values[0].copy_(tok_s)
        if with_lp:
            self._chosen(source, tok_s, out=values[1])
            values[2].copy_(self._rank(source, tok_s))
        flat.index_copy_(0, dst, values.view(-1))
        return PendingSample.read(flat[: 2 * n + 2 * w], flat[:n], parse)

    @staticmethod
    def _parser(requests: Sequence[SampleRequest], want: list[int],
                top_n: int) -> Callable[[list[float]], list[SampleResult]]:
        """Parses the one read: n token ids, the wanted rows' chosen logprobs, their ranks,
        then per wanted row ``top_n`` values and (after all of them) their ids, then n finite
        flags."""
        n, w = len(requests), len(want)

        def parse(values: list[float]) -> list[SampleResult]:
            flags = values[len(values) - n :]
            token_list = [int(v) for v in values[:n]]
            if not w:
                return [SampleResult(t, None, f != 0.0)
                        for t, f in zip(token_list, flags, strict=True)]
            chosen = values[n : n + w]
            ranks = values[n + w : n + 2 * w]
            top = values[n + 2 * w :]
            ids_at = w * top_n
            entries: list[tuple[dict[int, float], tuple[int, ...]] | None] = [None] * n
            for j, i in enumerate(want):
                if top_n == 0:  # the chosen token alone (``_top_entry`` of no top tokens)
                    entries[i] = {token_list[i]: chosen[j]}, (int(ranks[j]),)
                else:
                    entries[i] = _top_entry(
                        token_list[i], chosen[j], int(ranks[j]),
                        top[j * top_n : j * top_n + requests[i].params.logprobs],
                        top[ids_at + j * top_n :])
            return [SampleResult(t, None, f != 0.0) if e is None else
                    SampleResult(t, e[0], f != 0.0, e[1])
                    for t, f, e in zip(token_list, flags, entries, strict=True)]

        return parse

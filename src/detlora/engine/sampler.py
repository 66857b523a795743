"""Choosing each sequence's next token from its logits row, independently of the batch.

Every operation here works row by row, so a row's result depends on its own logits, sampling
parameters, seed and position, never on which other rows share the step:

* greedy (temperature 0): argmax, ties to the lowest token id;
* otherwise: logits / temperature, then top-k and top-p filters, then Gumbel-max: the token
  maximising ``logit + g`` with ``g = -log(-log(u))``. ``u`` comes from a counter-based hash
  of (seed, position, token id) computed with integer tensor ops (identical on CPU and GPU),
  so a draw depends on nothing but those three numbers;
* top-k keeps the k best ranks of a stable descending sort (ties: lower token id first);
  top-p keeps the shortest prefix of that order whose probability reaches ``top_p``, with the
  running sum taken in 2^-40 fixed point: integer sums do not depend on the scan order;
* logprobs: ``log_softmax`` of the processed logits (after temperature and filters), fp32.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from detlora.config import SamplingParams

_MASK32 = 0xFFFFFFFF
_FIXED_POINT = 1 << 40  # top-p mass unit: exact int64 sums for up to 2^23 tokens


@dataclass(frozen=True)
class SampleRequest:
    """What the sampler needs for one logits row."""

    params: SamplingParams
    seed: int  # 64-bit
    position: int  # index the sampled token will take in its sequence
    banned_token_ids: tuple[int, ...] = ()  # e.g. EOS before min_tokens


@dataclass(frozen=True)
class SampleResult:
    token_id: int
    logprobs: dict[int, float] | None  # chosen token first, then the top ``params.logprobs``


def derive_seed(engine_seed: int, index: int) -> int:
    """The seed of a request without one: a 64-bit hash of (engine seed, request index)."""
    digest = hashlib.blake2b(f"{engine_seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _mul32(x: torch.Tensor | int, c: int) -> torch.Tensor | int:
    """(x * c) mod 2^32 for x in [0, 2^32), with no int64 overflow (16-bit halves of c)."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: torch.Tensor | int) -> torch.Tensor | int:
    """A 32-bit avalanche mix (xorshift-multiply, lowbias32 constants) on values < 2^32."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def row_keys(seed: int, position: int) -> tuple[int, int]:
    """Two 32-bit keys for one (seed, position): the row's two hash streams."""
    k = _mix32((seed & _MASK32) ^ 0x9E3779B9)
    k = _mix32(k ^ ((seed >> 32) & _MASK32))
    k1 = _mix32(k ^ (position & _MASK32))
    k2 = _mix32(k1 ^ 0x85EBCA6B)
    return int(k1), int(k2)


def uniform_noise(keys: torch.Tensor, token_hash: torch.Tensor) -> torch.Tensor:
    """u in (0, 1), float64 [N, V], from row keys [N, 2] int64 and token hashes [V] int64."""
    h1 = _mix32(keys[:, :1] ^ token_hash[None, :])
    h2 = _mix32(keys[:, 1:] ^ token_hash[None, :])
    bits53 = (h1 << 21) | (h2 >> 11)
    return (bits53.to(torch.float64) + 0.5) * (2.0**-53)


def gumbel_noise(keys: torch.Tensor, token_hash: torch.Tensor) -> torch.Tensor:
    return -torch.log(-torch.log(uniform_noise(keys, token_hash)))


class Sampler:
    """Turns fp32 logits [N, V] into one token per row.

    ``argmax`` and ``log_softmax`` come from the op backend, so on the GPU they are the
    batch-invariant kernels of the engine's determinism level.
    """

    def __init__(
        self,
        argmax: Callable[[torch.Tensor], torch.Tensor],
        log_softmax: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        self._argmax = argmax
        self._log_softmax = log_softmax
        self._token_hash: dict[tuple[int, torch.device], torch.Tensor] = {}

    def token_hash(self, vocab: int, device: torch.device) -> torch.Tensor:
        key = (vocab, device)
        if key not in self._token_hash:
            ids = torch.arange(vocab, dtype=torch.int64, device=device)
            self._token_hash[key] = _mix32(_mix32(ids ^ 0x27D4EB2F) ^ 0x165667B1)
        return self._token_hash[key]

    def __call__(
        self, logits: torch.Tensor, requests: Sequence[SampleRequest]
    ) -> list[SampleResult]:
        if logits.dim() != 2 or logits.shape[0] != len(requests):
            raise ValueError(
                f"logits must be [N, vocab] with N = {len(requests)} rows, "
                f"got {tuple(logits.shape)}"
            )
        logits = logits.float()
        banned = [(i, t) for i, r in enumerate(requests) for t in r.banned_token_ids]
        if banned:
            logits = logits.clone()
            rows, cols = zip(*banned, strict=True)
            logits[list(rows), list(cols)] = float("-inf")

        n = len(requests)
        tokens = torch.empty(n, dtype=torch.int64, device=logits.device)
        processed = logits
        greedy = [i for i, r in enumerate(requests) if r.params.greedy]
        sampled = [i for i, r in enumerate(requests) if not r.params.greedy]
        if greedy:
            g = torch.tensor(greedy, device=logits.device)
            tokens[g] = self._argmax(logits[g]).to(torch.int64)
        if sampled:
            s = torch.tensor(sampled, device=logits.device)
            filtered = self._filter([requests[i] for i in sampled], logits[s])
            keys = torch.tensor(
                [row_keys(requests[i].seed, requests[i].position) for i in sampled],
                dtype=torch.int64, device=logits.device,
            )
            noise = gumbel_noise(keys, self.token_hash(logits.shape[1], logits.device))
            # Masked tokens stay -inf after adding finite noise, so they are never chosen.
            tokens[s] = torch.argmax(filtered.double() + noise, dim=-1)
            processed = logits.clone()
            processed[s] = filtered

        token_list = tokens.tolist()
        want = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
        logprobs: dict[int, dict[int, float]] = {}
        if want:
            w = torch.tensor(want, device=logits.device)
            lp = self._log_softmax(processed[w]).float()
            chosen = lp.gather(1, tokens[w][:, None])[:, 0].tolist()
            top_n = max(requests[i].params.logprobs for i in want)
            top_ids = top_vals = None
            if top_n > 0:
                # Stable descending sort: equal logprobs list the lower token id first.
                top_vals, top_ids = torch.sort(lp, dim=-1, descending=True, stable=True)
                top_vals, top_ids = top_vals[:, :top_n].tolist(), top_ids[:, :top_n].tolist()
            for j, i in enumerate(want):
                entry = {token_list[i]: chosen[j]}
                k = requests[i].params.logprobs
                if top_ids is not None and top_vals is not None and k > 0:
                    for tid, val in zip(top_ids[j][:k], top_vals[j][:k], strict=True):
                        entry.setdefault(tid, val)
                logprobs[i] = entry
        return [SampleResult(token_list[i], logprobs.get(i)) for i in range(n)]

    def _filter(self, requests: Sequence[SampleRequest], logits: torch.Tensor) -> torch.Tensor:
        """Temperature, then top-k and top-p: rows [n, V] fp32, dropped tokens at -inf."""
        temps = torch.tensor(
            [r.params.temperature for r in requests], dtype=torch.float32, device=logits.device
        )
        x = logits / temps[:, None]
        vocab = x.shape[1]
        top_k = [r.params.top_k if 0 < r.params.top_k < vocab else vocab for r in requests]
        top_p = [r.params.top_p for r in requests]
        if all(k == vocab for k in top_k) and all(p >= 1.0 for p in top_p):
            return x
        order = torch.sort(x, dim=-1, descending=True, stable=True).indices
        rank_keep = torch.arange(vocab, device=x.device)[None, :] < torch.tensor(
            top_k, device=x.device
        )[:, None]
        if any(p < 1.0 for p in top_p):
            # Probabilities after top-k, in sorted order, summed in exact fixed point.
            sorted_x = x.gather(1, order).masked_fill(~rank_keep, float("-inf"))
            probs = torch.exp(self._log_softmax(sorted_x).float()).double()
            mass = torch.floor(probs * _FIXED_POINT).to(torch.int64)
            before = torch.cumsum(mass, dim=-1) - mass  # mass of the better-ranked tokens
            # top_p = 1 keeps everything (rounding may sum the mass a hair past 1).
            limit = torch.tensor(
                [int(p * _FIXED_POINT) if p < 1.0 else 1 << 62 for p in top_p],
                dtype=torch.int64, device=x.device,
            )
            rank_keep &= before < limit[:, None]
            rank_keep[:, 0] = True  # the best token always survives
        keep = torch.zeros_like(rank_keep).scatter(1, order, rank_keep)
        return x.masked_fill(~keep, float("-inf"))

"""Engine-wide settings: determinism levels, LoRA reduction choices, engine and sampling.

Frozen dataclasses and string enums only; nothing here imports torch kernels, so the CLI and
tests can read settings without touching the GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import TypeVar

E = TypeVar("E", bound=Enum)


def _parse_enum(cls: type[E], value: object, what: str) -> E:
    """``cls(value)``, or a ValueError naming ``what`` and every allowed value."""
    try:
        return cls(value)
    except ValueError:
        names = ", ".join(repr(member.value) for member in cls)
        raise ValueError(f"{what} must be one of {names}, got {value!r}") from None


class Determinism(str, Enum):
    """What the engine promises about the bits of an output (docs/design.md, "Determinism
    levels")."""

    FAST = "fast"  # no promise: atomic Split-K, vendor GEMMs
    RUN_TO_RUN = "run_to_run"  # same batch, same bits
    BATCH_INVARIANT = "batch_invariant"  # same request, same bits, whatever the batch

    @classmethod
    def parse(cls, value: str | Determinism) -> Determinism:
        return _parse_enum(cls, value, "determinism")


class LoRAReduction(str, Enum):
    """How the LoRA shrink sums over the hidden axis.

    ``ordered_bi`` is ``ordered`` with a split count and BLOCK_K fixed per (H, r): a row's bits
    do not depend on how many rows share the call. ``in_gemm`` has no shrink kernel: every
    slot's A rides as extra output columns of the base weight, so the level's own linear
    (cuBLAS, or the batch-invariant matmul) computes x A^T, rounded to the model dtype, in the
    same launch as x W^T; the expand scales it.
    """

    ATOMIC = "atomic"
    UNSPLIT = "unsplit"
    ORDERED = "ordered"
    ORDERED_BI = "ordered_bi"
    TREE = "tree"
    IN_GEMM = "in_gemm"

    @classmethod
    def parse(cls, value: str | LoRAReduction) -> LoRAReduction:
        return _parse_enum(cls, value, "reduction")


class LogprobsMode(str, Enum):
    """What ``logprobs`` report (vLLM's ``logprobs_mode``): the model's raw distribution, or
    the processed one the token was drawn from (after bans, allowed tokens, logit bias,
    penalties, min_p, temperature, top-k and top-p); as log-probabilities or as logits."""

    RAW_LOGPROBS = "raw_logprobs"
    RAW_LOGITS = "raw_logits"
    PROCESSED_LOGPROBS = "processed_logprobs"
    PROCESSED_LOGITS = "processed_logits"

    @classmethod
    def parse(cls, value: str | LogprobsMode) -> LogprobsMode:
        return _parse_enum(cls, value, "logprobs_mode")

    @property
    def raw(self) -> bool:
        return self in (LogprobsMode.RAW_LOGPROBS, LogprobsMode.RAW_LOGITS)

    @property
    def logprobs(self) -> bool:
        """Log-probabilities (else logits)."""
        return self in (LogprobsMode.RAW_LOGPROBS, LogprobsMode.PROCESSED_LOGPROBS)


# The level an engine (or a backend) gets when none is asked for, on every device.
DEFAULT_DETERMINISM = Determinism.BATCH_INVARIANT
# Adapter slots at most: the expands' row-tile table packs a group index (slots + 1 groups) into
# the upper half of an int32 entry (ops/adapter_groups.py).
MAX_ADAPTER_SLOTS = (1 << 15) - 2

# The reduction each level uses unless ``lora_reduction`` overrides it. The deterministic
# levels take in_gemm, faster than a shrink kernel beside the GEMM (see docs/decisions.md,
# "in_gemm by default").
DEFAULT_LORA_REDUCTION: dict[Determinism, LoRAReduction] = {
    Determinism.FAST: LoRAReduction.ATOMIC,
    Determinism.RUN_TO_RUN: LoRAReduction.IN_GEMM,
    Determinism.BATCH_INVARIANT: LoRAReduction.IN_GEMM,
}


# ----------------------------------------------------------------------------- engine


class RequestOutputKind(int, Enum):
    """What ``LLMEngine.step`` reports for a request (vLLM's ``RequestOutputKind``).

    ``CUMULATIVE``: every step that reads a token for it, the whole output so far;
    ``DELTA``: every such step, only what is new since the last report; ``FINAL_ONLY``: one
    report, when it finishes (``LLM.generate`` asks for this).
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrain a request's output (vLLM's ``StructuredOutputsParams``): exactly one of a JSON
    schema (``json``: a dict or its JSON text), any JSON object (``json_object=True``), a
    regular expression, a ``choice`` of strings, or an EBNF ``grammar``. A schema is kept as
    canonical JSON text, so equal schemas compare (and hash) equal."""

    json: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        import json as _json

        if self.json is not None:
            value = self.json
            if isinstance(value, str):
                try:
                    value = _json.loads(value)
                except ValueError as e:
                    raise ValueError(f"structured_outputs json is not valid JSON: {e}") from None
            if not isinstance(value, dict):
                raise ValueError("structured_outputs json must be a JSON schema object")
            object.__setattr__(self, "json", _json.dumps(value, sort_keys=True))
        if self.choice is not None:
            choice = self.choice
            if isinstance(choice, str) or not isinstance(choice, (list, tuple)) or not choice \
                    or not all(isinstance(c, str) and c for c in choice):
                raise ValueError("structured_outputs choice must be a non-empty list of "
                                 "non-empty strings")
            object.__setattr__(self, "choice", tuple(choice))
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"structured_outputs {name} must be a non-empty string")
        if not isinstance(self.json_object, bool):
            raise ValueError(f"json_object must be a bool, got {self.json_object!r}")
        given = [n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError("structured_outputs takes exactly one of json, json_object, regex, "
                             f"choice, grammar; got {given or 'none'}")

    @property
    def kind(self) -> str:
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name
        return "json_object"


@dataclass(frozen=True)
class SamplingParams:
    """How one request's tokens are chosen: vLLM's names and defaults (``temperature=1.0``,
    ``max_tokens=16``), minus what we lack.

    ``temperature == 0`` is greedy (argmax, ties to the lowest token id). Otherwise tokens are
    drawn by Gumbel-max with noise hashed from (seed, position, token id), so a seeded request
    draws the same tokens whatever shares its batch. ``seed=None`` uses the engine seed and the
    request's index, so a rerun of the same script repeats. With ``n > 1`` completion 0 uses
    ``seed`` and completion i > 0 a seed derived from (seed, i): the first of n completions is
    the one completion of ``n=1``.
    """

    max_tokens: int | None = 16  # None: until max_model_len
    n: int = 1  # completions per prompt
    temperature: float = 1.0  # 0: greedy
    top_k: int = -1  # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0  # keep tokens with probability >= min_p * the best one's (0: off)
    seed: int | None = None
    logprobs: int | None = None  # when set (>= 0): logprob of each chosen token
    prompt_logprobs: int | None = None  # when set (>= 0): logprob of each prompt token
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] | None = ()  # None: none
    min_tokens: int = 0
    stop: tuple[str, ...] | str | None = ()  # stop strings (a str is one; None: none)
    include_stop_str_in_output: bool = False
    # Logit adjustments, in vLLM's order (engine/sample/logit_adjust.py): allowed tokens, bias, then
    # penalties over the prompt and output tokens (repetition) or the output (the other two);
    # min_p (above) cuts last.
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = field(default=None, hash=False)  # clamped to +-100
    allowed_token_ids: tuple[int, ...] | None = None
    # How LLMEngine.step reports the request; LLM.generate takes FINAL_ONLY whatever is set.
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    detokenize: bool = True  # False: outputs carry token ids, no text (stop strings still work)
    structured_outputs: StructuredOutputsParams | None = None  # engine/sample/grammar.py

    def __post_init__(self) -> None:
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, low=1)
        _check_int("n", self.n, low=1)
        if _check_number("temperature", self.temperature) < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        _check_int("top_k", self.top_k, low=-1)
        if not 0.0 < _check_number("top_p", self.top_p) <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None:
            _check_int("seed", self.seed, low=0, high=2**64 - 1)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, low=0)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, low=0)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        ids = () if self.stop_token_ids is None else self.stop_token_ids
        if isinstance(ids, (str, bytes)) or not isinstance(ids, (tuple, list)):
            raise ValueError(f"stop_token_ids must be a sequence of ints, got {ids!r}")
        for t in ids:
            _check_int("stop_token_ids entries", t, low=0)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in ids))
        _check_int("min_tokens", self.min_tokens, low=0, high=self.max_tokens)
        stop = () if self.stop is None else (self.stop,) if isinstance(self.stop, str) \
            else self.stop
        if not isinstance(stop, (tuple, list)) or not all(isinstance(x, str) for x in stop):
            raise ValueError(f"stop must be a string or a sequence of strings, got {self.stop!r}")
        if any(x == "" for x in stop):
            raise ValueError("stop strings must not be empty")
        object.__setattr__(self, "stop", tuple(stop))
        if not isinstance(self.include_stop_str_in_output, bool):
            raise ValueError("include_stop_str_in_output must be a bool, got "
                             f"{self.include_stop_str_in_output!r}")
        if not 0.0 <= _check_number("min_p", self.min_p) <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        _check_number("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= _check_number(name, getattr(self, name)) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id to bias, "
                                 f"got {self.logit_bias!r}")
            bias = {}
            for t, b in self.logit_bias.items():
                _check_int("logit_bias token ids", t, low=0)
                bias[t] = min(100.0, max(-100.0, float(_check_number(f"logit_bias[{t}]", b))))
            object.__setattr__(self, "logit_bias", bias)
        ids = self.allowed_token_ids
        if ids is not None:
            if isinstance(ids, (str, bytes)) or not isinstance(ids, (tuple, list)) or not ids:
                raise ValueError(f"allowed_token_ids must be a non-empty sequence of ints, "
                                 f"got {ids!r}")
            for t in ids:
                _check_int("allowed_token_ids entries", t, low=0)
            object.__setattr__(self, "allowed_token_ids", tuple(dict.fromkeys(ids)))
        try:
            object.__setattr__(self, "output_kind", RequestOutputKind(self.output_kind))
        except ValueError:
            raise ValueError(f"output_kind must be a RequestOutputKind, got "
                             f"{self.output_kind!r}") from None
        if not isinstance(self.detokenize, bool):
            raise ValueError(f"detokenize must be a bool, got {self.detokenize!r}")
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be StructuredOutputsParams, got "
                             f"{type(so).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _check_number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _check_int(name: str, value: object, *, low: int | None = None, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {value}")
    return value

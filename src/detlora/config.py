"""Engine-wide settings: determinism levels, LoRA reduction choices, engine and sampling.

Frozen dataclasses and string enums only; nothing here imports torch kernels, so the CLI and
tests can read settings without touching the GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum


class Determinism(str, Enum):
    """What the engine promises about the bits of an output (docs/design.md, "Determinism
    levels")."""

    FAST = "fast"  # no promise: atomic Split-K, vendor GEMMs
    RUN_TO_RUN = "run_to_run"  # same batch, same bits
    BATCH_INVARIANT = "batch_invariant"  # same request, same bits, whatever the batch

    @classmethod
    def parse(cls, value: str | Determinism) -> Determinism:
        try:
            return cls(value)
        except ValueError:
            names = ", ".join(repr(level.value) for level in cls)
            raise ValueError(f"determinism must be one of {names}, got {value!r}") from None


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
        try:
            return cls(value)
        except ValueError:
            names = ", ".join(repr(r.value) for r in cls)
            raise ValueError(f"reduction must be one of {names}, got {value!r}") from None


# The level an engine (or a backend) gets when none is asked for, on every device.
DEFAULT_DETERMINISM = Determinism.BATCH_INVARIANT

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
    """How one request's tokens are chosen (vLLM's names and defaults, minus what we lack).

    ``temperature == 0`` is greedy (argmax, ties to the lowest token id). Otherwise tokens are
    drawn by Gumbel-max with noise hashed from (seed, position, token id), so a seeded request
    draws the same tokens whatever shares its batch. ``seed=None`` uses the engine seed and the
    request's index, so a rerun of the same script repeats. With ``n > 1`` completion 0 uses
    ``seed`` and completion i > 0 a seed derived from (seed, i): the first of n completions is
    the one completion of ``n=1``.
    """

    max_tokens: int | None = 16  # None: until max_model_len
    n: int = 1  # completions per prompt
    temperature: float = 0.0
    top_k: int = -1  # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0  # keep tokens with probability >= min_p * the best one's (0: off)
    seed: int | None = None
    logprobs: int | None = None  # when set (>= 0): logprob of each chosen token
    prompt_logprobs: int | None = None  # when set (>= 0): logprob of each prompt token
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    stop: tuple[str, ...] = ()  # stop strings (a str is one); engine/sample/stop_strings.py
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
        ids = self.stop_token_ids
        if isinstance(ids, (str, bytes)) or not isinstance(ids, (tuple, list)):
            raise ValueError(f"stop_token_ids must be a sequence of ints, got {ids!r}")
        for t in ids:
            _check_int("stop_token_ids entries", t, low=0)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in ids))
        _check_int("min_tokens", self.min_tokens, low=0, high=self.max_tokens)
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
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


@dataclass(frozen=True)
class EngineConfig:
    """Everything that shapes an engine; ``LLM(...)`` builds one from its arguments.

    ``determinism=None`` means batch_invariant, the default promise on every device (on the
    CPU every level runs the same batch-invariant torch code). ``lora_reduction=None`` means
    the level's default (``DEFAULT_LORA_REDUCTION``); ``max_model_len=None`` the model's
    ``max_position_embeddings``; ``num_kv_blocks=None`` sizes the KV cache from
    ``gpu_memory_utilization`` on CUDA (from the longest possible batch on the CPU);
    ``max_cpu_loras=None`` lets the host cache of adapters hold as many as fit in a share of
    the host memory available at start (``lora/host_cache.py``).
    ``enable_prefix_caching=None`` turns prefix caching on at batch_invariant only: there a
    cached prefix gives the bits its recompute would, while below it the cached K/V carry the
    bits of the batch that computed them, so a repeated ``generate`` could change its output.
    """

    model: str
    enable_lora: bool = False
    max_lora_rank: int = 16
    max_loras: int = 4
    max_cpu_loras: int | None = None  # adapters kept in host memory (None: sized from it)
    determinism: Determinism | None = None
    lora_reduction: LoRAReduction | None = None
    dtype: str = "auto"
    device: str = "auto"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.85
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool | None = None
    enforce_eager: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a model directory path, got {self.model!r}")
        if self.determinism is not None:
            object.__setattr__(self, "determinism", Determinism.parse(self.determinism))
        if self.lora_reduction is not None:
            object.__setattr__(self, "lora_reduction", LoRAReduction.parse(self.lora_reduction))
        for flag in ("enable_lora", "enable_chunked_prefill", "enforce_eager"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be a bool, got {getattr(self, flag)!r}")
        if self.enable_prefix_caching is not None and not isinstance(
                self.enable_prefix_caching, bool):
            raise ValueError("enable_prefix_caching must be a bool or None, got "
                             f"{self.enable_prefix_caching!r}")
        _check_int("max_lora_rank", self.max_lora_rank, low=1)
        _check_int("max_loras", self.max_loras, low=1)
        if self.max_cpu_loras is not None and _check_int(
                "max_cpu_loras", self.max_cpu_loras, low=1) < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                             f"({self.max_loras})")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if not isinstance(self.device, str) or not (
            self.device in ("auto", "cpu", "cuda")
            or (self.device.startswith("cuda:") and self.device[5:].isdigit())
        ):
            raise ValueError(
                f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}"
            )
        _check_int("max_num_seqs", self.max_num_seqs, low=1)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, low=1)
        if self.max_model_len is not None:
            _check_int("max_model_len", self.max_model_len, low=1)
        _check_int("block_size", self.block_size, low=1)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None:
            _check_int("num_kv_blocks", self.num_kv_blocks, low=1)
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0.0 < u <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {u!r}")
        _check_int("seed", self.seed, low=0, high=2**64 - 1)

    @property
    def resolved_determinism(self) -> Determinism:
        return self.determinism or DEFAULT_DETERMINISM

    @property
    def resolved_prefix_caching(self) -> bool:
        if self.enable_prefix_caching is not None:
            return self.enable_prefix_caching
        return self.resolved_determinism is Determinism.BATCH_INVARIANT

    @property
    def resolved_lora_reduction(self) -> LoRAReduction:
        return self.lora_reduction or DEFAULT_LORA_REDUCTION[self.resolved_determinism]


# "auto" follows config.json's torch_dtype on CUDA and uses float32 on the CPU.
_DTYPES = {"auto", "float32", "float16", "bfloat16", "fp32", "fp16", "bf16"}


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

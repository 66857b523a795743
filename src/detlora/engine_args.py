"""``EngineArgs``: every engine option in one place, with its default, help and validation.

``LLM(model, **kwargs)`` takes its keyword arguments from these fields, and every command
line (``detlora generate``, ``demo``, ``serve``, ...) builds its options from them with
``EngineArgs.add_cli_args(parser)`` and reads them back with ``EngineArgs.from_cli_args``:
names, defaults, help and checks are written once. Names are vLLM's where vLLM has the
option; values detlora cannot honour are refused with a clear error, never ignored.

Defaults that differ from vLLM on purpose: ``determinism`` (batch_invariant), prefix caching
on at batch_invariant only (vLLM: always on), ``gpu_memory_utilization`` 0.85 (vLLM 0.9: the
decode graphs and the sampler's buffers are not in the profile), ``logprobs_mode`` as vLLM's.
"""

from __future__ import annotations

import argparse
import difflib
import math
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from detlora.config import (
    DEFAULT_DETERMINISM,
    DEFAULT_LORA_REDUCTION,
    MAX_ADAPTER_SLOTS,
    Determinism,
    LogprobsMode,
    LoRAReduction,
    _check_int,
)

DTYPES = ("auto", "float32", "float16", "bfloat16", "fp32", "fp16", "bf16")


def _opt(default: Any, help: str, *, choices: Iterable[str] | None = None,
         default_help: str | None = None, metavar: str | None = None,
         group: str = "engine") -> Any:
    """A field with its command-line help; ``default_help`` says what a None default means."""
    return field(default=default, metadata={
        "help": help, "choices": tuple(choices) if choices else None,
        "default_help": default_help, "metavar": metavar, "group": group})


@dataclass(frozen=True)
class EngineArgs:
    """Everything that shapes an engine (see the module doc); frozen and checked on creation.

    ``determinism=None`` means batch_invariant, the default promise on every device (on the
    CPU every level runs the same batch-invariant torch code). ``lora_reduction=None`` means
    the level's default; ``max_model_len=None`` the model's ``max_position_embeddings``;
    ``num_kv_blocks=None`` sizes the KV cache from ``gpu_memory_utilization`` on CUDA (from
    the longest possible batch on the CPU). ``enable_prefix_caching=None`` turns prefix
    caching on at batch_invariant only: there a cached prefix gives the bits its recompute
    would, while below it the cached K/V carry the bits of the batch that computed them, so a
    repeated ``generate`` could change its output.
    """

    model: str = field(metadata={
        "help": "the model: a Hugging Face model directory, a Hub id (org/name) or a .gguf "
                "file", "group": "model", "metavar": "MODEL"})
    tokenizer: str | None = _opt(None, "tokenizer directory", default_help="the model's",
                                 group="model")
    tokenizer_mode: str = _opt("auto", "auto: the fast tokenizer when there is one; slow: "
                               "the Python one", choices=("auto", "slow"), group="model")
    skip_tokenizer_init: bool = _opt(False, "load no tokenizer: prompts must be token ids and "
                                     "outputs carry no text", group="model")
    trust_remote_code: bool = _opt(False, "let the tokenizer run code shipped with the "
                                   "checkpoint (the model always runs detlora's own code)",
                                   group="model")
    revision: str | None = _opt(None, "Hub revision (branch, tag or commit) of the model",
                                default_help="the default branch", group="model")
    tokenizer_revision: str | None = _opt(None, "Hub revision of the tokenizer",
                                          default_help="the model's", group="model")
    download_dir: str | None = _opt(None, "where Hub downloads go",
                                    default_help="the Hugging Face cache", group="model")
    dtype: str = _opt("auto", "weights and activations dtype; auto: the checkpoint's on CUDA "
                      "(bfloat16 for fp32 checkpoints), float32 on the CPU", choices=DTYPES)
    quantization: str | None = _opt(None, "quantized weights: not supported (GGUF files are "
                                    "dequantized at load)", default_help="none")
    kv_cache_dtype: str = _opt("auto", "KV cache dtype; auto: the model's dtype",
                               choices=("auto",))
    device: str = _opt("auto", "auto, cpu, cuda or cuda:N; auto: cuda when available")
    seed: int = _opt(0, "engine seed: requests without a seed of their own derive theirs from "
                     "it and their arrival index")
    determinism: Determinism | None = _opt(
        None, "what the engine promises about the bits of an output",
        choices=[d.value for d in Determinism], default_help=DEFAULT_DETERMINISM.value)
    lora_reduction: LoRAReduction | None = _opt(
        None, "how the LoRA shrink sums over the hidden axis",
        choices=[r.value for r in LoRAReduction], default_help="the level's default")
    logprobs_mode: LogprobsMode = _opt(
        LogprobsMode.RAW_LOGPROBS, "what logprobs report: the model's raw distribution or "
        "the processed one the token was drawn from, as logprobs or logits",
        choices=[m.value for m in LogprobsMode])
    max_model_len: int | None = _opt(None, "longest sequence (prompt + output) in tokens",
                                     default_help="the model's max_position_embeddings")
    max_num_seqs: int = _opt(256, "most sequences in one step", group="scheduler")
    max_num_batched_tokens: int = _opt(8192, "most tokens in one step", group="scheduler")
    enable_chunked_prefill: bool = _opt(True, "split long prompts over several steps",
                                        group="scheduler")
    enable_prefix_caching: bool | None = _opt(
        None, "reuse the KV pages of shared prompt prefixes", group="scheduler",
        default_help="on at batch_invariant only")
    block_size: int = _opt(16, "tokens per KV cache page (a power of two)", group="cache")
    num_kv_blocks: int | None = _opt(None, "KV cache pages (vLLM: num_gpu_blocks_override)",
                                     default_help="sized from gpu_memory_utilization",
                                     group="cache")
    gpu_memory_utilization: float = _opt(0.85, "fraction of the GPU's memory the engine may "
                                         "use (weights, activations and KV cache)",
                                         group="cache")
    swap_space: float = _opt(4.0, "CPU swap space in GiB per GPU: none is used (preempted "
                             "requests are recomputed, never swapped)", group="cache")
    cpu_offload_gb: float = _opt(0.0, "weights offloaded to the CPU: not supported (0 only)",
                                 group="cache")
    enforce_eager: bool = _opt(False, "no CUDA graphs")
    max_seq_len_to_capture: int = _opt(8192, "vLLM's limit for CUDA graphs; detlora's decode "
                                       "graphs cover every length up to max_model_len")
    disable_log_stats: bool = _opt(True, "no periodic statistics in the log")
    tensor_parallel_size: int = _opt(1, "GPUs (or CPU processes) the model is split over: 1, "
                                     "2, 4 or 8, every size with the bits of one",
                                     group="parallel")
    pipeline_parallel_size: int = _opt(1, "pipeline stages: not supported (1 only)",
                                       group="parallel")
    enable_lora: bool = _opt(False, "serve LoRA adapters", group="lora")
    max_loras: int = _opt(1, "adapters in one step (adapter slots on the device)",
                          group="lora")
    max_lora_rank: int = _opt(16, "largest adapter rank", group="lora")
    max_cpu_loras: int | None = _opt(None, "adapters kept in host memory (at least max_loras)",
                                     default_help="as many as fit in a share of the host "
                                     "memory available at start", group="lora")

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a model directory, Hub id or .gguf file, "
                             f"got {self.model!r}")
        for name in ("tokenizer", "revision", "tokenizer_revision", "download_dir"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string or None, got {value!r}")
        for name in ("skip_tokenizer_init", "trust_remote_code", "enable_lora",
                     "enable_chunked_prefill", "enforce_eager", "disable_log_stats"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.enable_prefix_caching is not None and not isinstance(
                self.enable_prefix_caching, bool):
            raise ValueError("enable_prefix_caching must be a bool or None, got "
                             f"{self.enable_prefix_caching!r}")
        _choice("tokenizer_mode", self.tokenizer_mode)
        _choice("dtype", self.dtype)
        if self.kv_cache_dtype != "auto":
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported: the KV "
                             "cache is kept in the model's dtype ('auto')")
        if self.quantization is not None:
            raise ValueError(f"quantization={self.quantization!r} is not supported: detlora "
                             "runs unquantized weights (a .gguf file is dequantized at load)")
        if not isinstance(self.device, str) or not (
            self.device in ("auto", "cpu", "cuda")
            or (self.device.startswith("cuda:") and self.device[5:].isdigit())
        ):
            raise ValueError(
                f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        _check_int("seed", self.seed, low=0, high=2**64 - 1)
        if self.determinism is not None:
            object.__setattr__(self, "determinism", Determinism.parse(self.determinism))
        if self.lora_reduction is not None:
            object.__setattr__(self, "lora_reduction", LoRAReduction.parse(self.lora_reduction))
        object.__setattr__(self, "logprobs_mode", LogprobsMode.parse(self.logprobs_mode))
        if self.max_model_len is not None:
            _check_int("max_model_len", self.max_model_len, low=1)
        _check_int("max_num_seqs", self.max_num_seqs, low=1)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, low=1)
        _check_int("block_size", self.block_size, low=1)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None:
            _check_int("num_kv_blocks", self.num_kv_blocks, low=1)
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0.0 < u <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {u!r}")
        _check_number("swap_space", self.swap_space, low=0.0)
        if _check_number("cpu_offload_gb", self.cpu_offload_gb, low=0.0) != 0:
            raise ValueError(f"cpu_offload_gb={self.cpu_offload_gb} is not supported: every "
                             "weight stays on the device (0 only)")
        _check_int("max_seq_len_to_capture", self.max_seq_len_to_capture, low=1)
        _check_int("tensor_parallel_size", self.tensor_parallel_size, low=1)
        if self.tensor_parallel_size not in (1, 2, 4, 8):
            raise ValueError(f"tensor_parallel_size must be one of [1, 2, 4, 8] (the sizes "
                             f"whose bits equal one device's), got {self.tensor_parallel_size}")
        _check_int("pipeline_parallel_size", self.pipeline_parallel_size, low=1)
        if self.pipeline_parallel_size != 1:
            raise ValueError(f"pipeline_parallel_size={self.pipeline_parallel_size} is not "
                             "supported (1 only)")
        _check_int("max_loras", self.max_loras, low=1, high=MAX_ADAPTER_SLOTS)
        _check_int("max_lora_rank", self.max_lora_rank, low=1)
        if self.max_cpu_loras is not None and _check_int(
                "max_cpu_loras", self.max_cpu_loras, low=1) < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                             f"({self.max_loras})")

    # ---- resolved values ----

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

    # ---- keyword arguments (LLM) ----

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_kwargs(cls, where: str = "EngineArgs", **kwargs: Any) -> EngineArgs:
        """Build from keyword arguments, taking vLLM's aliases (``num_gpu_blocks_override``);
        an unknown name is a TypeError that lists the close matches."""
        known = set(cls.names())
        args: dict[str, Any] = {}
        for name, value in kwargs.items():
            target = ALIASES.get(name, name)
            if target not in known:
                raise TypeError(unknown_argument(where, name, [*known, *ALIASES]))
            if target in args:
                raise TypeError(f"{where} got {target!r} twice (once as {name!r})")
            args[target] = value
        return cls(**args)

    # ---- command lines ----

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, *,
                     defaults: Mapping[str, Any] | None = None,
                     exclude: Iterable[str] = ()) -> argparse.ArgumentParser:
        """Add every engine option (``--max-model-len`` style) to ``parser``, with its help
        and default; ``defaults`` overrides a command's defaults (a ``model`` default makes
        ``--model`` optional), ``exclude`` leaves options out."""
        defaults = dict(defaults or {})
        skip = set(exclude)
        groups: dict[str, argparse._ArgumentGroup] = {}
        for f in fields(cls):
            if f.name in skip:
                continue
            meta = f.metadata
            title = _GROUPS[meta.get("group", "engine")]
            group = groups.get(title) or groups.setdefault(
                title, parser.add_argument_group(title))
            flags = [_flag(f.name)] + [_flag(a) for a, t in ALIASES.items() if t == f.name]
            default = defaults.get(f.name, f.default)
            if default is MISSING:
                group.add_argument(*flags, dest=f.name, required=True,
                                   metavar=meta.get("metavar"), help=meta["help"])
                continue
            if isinstance(default, (Determinism, LoRAReduction, LogprobsMode)):
                default = default.value
            shown = meta.get("default_help") if default is None else default
            help_text = f"{meta['help']} (default: {_shown(shown)})"
            kind = _kind(f.type)
            if kind is bool:
                group.add_argument(*flags, dest=f.name, default=default, help=help_text,
                                   action=argparse.BooleanOptionalAction)
            else:
                group.add_argument(*flags, dest=f.name, default=default, help=help_text,
                                   type=kind, choices=meta.get("choices"),
                                   metavar=meta.get("metavar") or (
                                       None if meta.get("choices") else _METAVARS[kind]))
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **overrides: Any) -> EngineArgs:
        """The ``EngineArgs`` of parsed options (those ``add_cli_args`` added), with
        ``overrides`` on top."""
        values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        values.update(overrides)
        return cls(**values)


# vLLM's names for options detlora calls otherwise.
ALIASES: Mapping[str, str] = {"num_gpu_blocks_override": "num_kv_blocks"}

_GROUPS = {"model": "model", "engine": "engine", "scheduler": "scheduler",
           "cache": "KV cache", "parallel": "parallelism", "lora": "LoRA adapters"}


def unknown_argument(where: str, name: str, known: Iterable[str]) -> str:
    """The message for an unknown keyword argument: its close matches, or where to look."""
    close = difflib.get_close_matches(name, list(known), n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else \
        " (see help(detlora.EngineArgs) for the engine options)"
    return f"{where} got an unexpected keyword argument {name!r}{hint}"


_METAVARS = {int: "N", float: "X", str: "TEXT"}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _shown(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _kind(annotation: Any) -> type:
    """The argparse type of a field from its annotation (a string here)."""
    text = str(annotation)
    for name, kind in (("bool", bool), ("int", int), ("float", float)):
        if text.split(" |")[0] == name:
            return kind
    return str


def _choice(name: str, value: object) -> None:
    choices = next(f.metadata["choices"] for f in fields(EngineArgs) if f.name == name)
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, "
                         f"got {value!r}")


def _check_number(name: str, value: object, *, low: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value < low:
        raise ValueError(f"{name} must be a finite number >= {low}, got {value!r}")
    return float(value)

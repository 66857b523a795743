"""The engine: requests in, one scheduled step at a time, outputs out.

``LLMEngine`` wires the pieces together (model + op backend, block manager, scheduler, model
runner, LoRA manager, sampler, fingerprint). It keeps all state on the instance and does one
step per ``step()`` call, so ``LLM.generate`` and the server's engine loop drive it the same
way. ``step()`` reports every request that read a token in the step, as its
``SamplingParams.output_kind`` asks (the whole output so far, what is new, or only the final
output); ``step_sequences()`` is the same step returning the sequences themselves.
"""

from __future__ import annotations

import dataclasses
import errno
import itertools
import json
import os
import stat
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from detlora.config import Determinism, LoRAReduction, RequestOutputKind, SamplingParams
from detlora.distributed.sharding import check_size
from detlora.distributed.workers import refuse_in_spawn_bootstrap
from detlora.engine.detokenizer import IncrementalDetokenizer
from detlora.engine.fingerprint import engine_fingerprint_parts, fingerprint
from detlora.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from detlora.engine.prompts import token_id_list
from detlora.engine.runner import kernel_cache, kv_sizing
from detlora.engine.runner.model_runner import ModelRunner
from detlora.engine.runner.step_inputs import StepInputs, build_step_inputs
from detlora.engine.runner.tp_driver import (
    TensorParallelDriver,
    launched_as_torchrun_worker,
    serve_as_torchrun_worker,
)
from detlora.engine.sample.grammar import GrammarBackend, GrammarMatcher
from detlora.engine.sample.logit_adjust import has_adjustments, row_adjust
from detlora.engine.sample.sampler import (
    PendingSample,
    Sampler,
    SampleRequest,
    SampleResult,
    derive_seed,
)
from detlora.engine.sample.stop_strings import match_stop_string
from detlora.engine.sched.block_hashes import UNREAD
from detlora.engine.sched.block_manager import BlockManager
from detlora.engine.sched.grouped_block_manager import GroupedBlockManager
from detlora.engine.sched.scheduler import Scheduler, SchedulerOutput
from detlora.engine.sched.sequence import FinishReason, SequenceStatus
from detlora.engine.sched.sequence import Sequence as Seq
from detlora.engine.tokenizer import Tokenizer
from detlora.engine_args import EngineArgs
from detlora.layers.backend import make_backend
from detlora.log import get_logger
from detlora.lora.request import LoRARequest
from detlora.lora.stats import LoRAStats

if TYPE_CHECKING:
    from detlora.lora.manager import LoRAManager

logger = get_logger(__name__)

PROMPT_BLOCK = 256  # prompt rows per LM head call when scoring prompts
PREFETCH_DEPTH = 2  # adapters read ahead: this many times max_loras, from the waiting queue
# What an engine holds on the device (directly or through its parts): dropped by shutdown().
_HELD = ("runner", "model", "lora_manager", "sampler", "backend")


@dataclasses.dataclass(frozen=True)
class _InFlight:
    """A launched step: its sampling sequences (row order) and where their tokens go."""

    seqs: list[Seq]
    positions: list[int]  # index of each row's token in its sequence's token_ids
    pending: PendingSample
    step: int  # the engine step that launched it (LLMEngine.num_steps), for error messages
    # Sequences reading label logprobs in this step, and those logprobs on their way
    labels: tuple[list[Seq], PendingSample] | None = None


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
           "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def _is_dir(path: str) -> bool:
    """``Path(path).is_dir()`` without building a Path (a server checks every request's
    adapter directory): False where it is not one or cannot be reached, as pathlib ignores
    ENOENT, ENOTDIR, EBADF and ELOOP; other errors (a permission) are raised as there."""
    try:
        return stat.S_ISDIR(os.stat(path).st_mode)
    except OSError as e:
        if e.errno not in (errno.ENOENT, errno.ENOTDIR, errno.EBADF, errno.ELOOP):
            raise
        return False
    except ValueError:  # an embedded NUL
        return False


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} but CUDA is not available (use device='cpu')")
    return device


def resolve_dtype(name: str, checkpoint: torch.dtype, device: torch.device) -> torch.dtype:
    """``auto``: float32 on the CPU; on CUDA the checkpoint's dtype, bfloat16 for fp32 ones
    (the kernels take 16-bit inputs)."""
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    return checkpoint if checkpoint in (torch.float16, torch.bfloat16) else torch.bfloat16


def conversion_dtype(name: str, device: torch.device) -> torch.dtype:
    """The dtype a checkpoint without one of its own (a GGUF file) is dequantized to: the
    asked one, else float32 on the CPU and bfloat16 on CUDA (what ``auto`` runs)."""
    if name != "auto":
        return _DTYPES[name]
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def stop_token_ids_of(model_dir: str | Path) -> tuple[int, ...]:
    """EOS ids from config.json and generation_config.json (an int or a list in each)."""
    ids: list[int] = []
    for name in ("config.json", "generation_config.json"):
        path = Path(model_dir) / name
        if not path.is_file():
            continue
        try:
            value = json.loads(path.read_text()).get("eos_token_id")
        except (json.JSONDecodeError, AttributeError):
            continue
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, int) and not isinstance(v, bool) and v not in ids:
                ids.append(v)
    return tuple(ids)


class LLMEngine:
    def __init__(
        self,
        config: EngineArgs,
        *,
        detokenize: Callable[[list[int]], str] | None = None,
        token_text: Callable[[int], str] | None = None,
        extra_eos_token_ids: Sequence[int] = (),
        tokenizer: Tokenizer | None = None,
    ) -> None:
        """``tokenizer``: the model's, for structured outputs (``detokenize`` defaults to its
        ``decode``); ``token_text``: one token alone, as text (the ``decoded_token`` of
        logprobs). Without them outputs carry no text."""
        self.is_shut_down = False
        try:
            self._build(config, detokenize, token_text, extra_eos_token_ids, tokenizer)
        except BaseException as e:
            # A failed construction holds nothing: what it loaded is released now, and its
            # traceback (which a notebook keeps as sys.last_traceback) keeps no frame's
            # locals, such as the model being sized.
            self.shutdown()
            traceback.clear_frames(e.__traceback__)
            raise

    def _build(
        self,
        config: EngineArgs,
        detokenize: Callable[[list[int]], str] | None,
        token_text: Callable[[int], str] | None,
        extra_eos_token_ids: Sequence[int],
        tokenizer: Tokenizer | None,
    ) -> None:
        from detlora.layers.lora_slots import LoRAConfig
        from detlora.models.loader import load_model
        from detlora.models.sources import resolve_model
        from detlora.models.spec import ModelSpec

        self.config = config
        self.tokenizer = tokenizer
        self.detokenize = detokenize or (tokenizer.decode if tokenizer is not None else None)
        self.token_text = token_text
        self._grammars: GrammarBackend | None = None
        self.tp_driver: TensorParallelDriver | None = None
        if config.tensor_parallel_size > 1:
            check_size(config.tensor_parallel_size)
            refuse_in_spawn_bootstrap()  # a script without the __main__ guard, in a worker
            if launched_as_torchrun_worker(config.tensor_parallel_size):
                serve_as_torchrun_worker()  # ends the process when rank 0 shuts down
        self.device = resolve_device(config.device)
        self.model_dir = resolve_model(
            config.model, revision=config.revision, download_dir=config.download_dir,
            dtype=conversion_dtype(config.dtype, self.device))
        spec = ModelSpec.from_dir(self.model_dir)
        if spec.hybrid is not None and config.tensor_parallel_size > 1:
            raise ValueError(f"tensor parallelism does not support hybrid (Mamba-2) models "
                             f"yet: {spec.architecture} runs with tensor_parallel_size=1")
        self.dtype = resolve_dtype(config.dtype, spec.dtype, self.device)
        self.determinism = config.resolved_determinism
        self.lora_reduction = config.resolved_lora_reduction
        self.max_model_len = config.max_model_len or spec.max_position_embeddings
        if self.max_model_len > spec.max_position_embeddings:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's "
                             f"max_position_embeddings={spec.max_position_embeddings}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if not config.enable_chunked_prefill and \
                config.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill, max_num_batched_tokens "
                f"({config.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len}) so that every prompt fits in one step"
            )

        # Memory this process held before the engine: named if the KV cache finds no room.
        self._allocated_before = (torch.cuda.memory_allocated(self.device)
                                  if self.device.type == "cuda" else 0)
        backend = make_backend(self.device, self.determinism, self.lora_reduction,
                               dtype=self.dtype, max_lora_rank=config.max_lora_rank)
        self.backend = backend
        lora_config = (LoRAConfig(config.max_loras, config.max_lora_rank)
                       if config.enable_lora else None)
        if config.tensor_parallel_size > 1:
            # Workers load their shards while this process loads rank 0's; they stop with
            # the engine (``shutdown``, or when it is collected), also if building it fails.
            self._start_tensor_parallel(spec, lora_config)
        tp = self.tp_driver
        started = time.perf_counter()
        self.model = load_model(self.model_dir, dtype=self.dtype, device=self.device,
                                backend=backend, lora_config=lora_config,
                                max_positions=self.max_model_len,
                                tp=tp.group if tp is not None else None)
        self.spec = self.model.spec
        logger.info("loaded %s (%s, %s) in %.1f s", config.model,
                    self.spec.architecture, str(self.dtype).replace("torch.", ""),
                    time.perf_counter() - started)
        self.lora_manager = None
        if config.enable_lora:
            from detlora.lora.manager import LoRAManager

            self.lora_manager = LoRAManager(self.model, max_cpu_loras=config.max_cpu_loras)
            if tp is not None:  # its slot writes reach every rank's shard
                self.lora_manager.writer = tp.mirror_slot_writer(self.lora_manager.writer)

        started = time.perf_counter()
        num_blocks = config.num_kv_blocks or self._default_num_blocks()
        # Per KV group where the model keeps several (sliding windows): group 0 gets
        # ``num_blocks``, each window group the pages its sequences can hold at once.
        kv_blocks = kv_sizing.group_blocks(
            self.model, num_blocks, block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens)
        if config.num_kv_blocks is None and self.device.type == "cuda":
            logger.info("KV cache sized from gpu_memory_utilization=%s in %.1f s",
                        config.gpu_memory_utilization, time.perf_counter() - started)
        use_graphs = not config.enforce_eager and self.device.type == "cuda"
        # The runner hands over the LM head's output in the model's dtype (not upcast).
        self.sampler = Sampler(backend.argmax, backend.log_softmax,
                               chosen_logprob=backend.chosen_logprob, logits_dtype=self.dtype,
                               kernels=backend.sampling_kernels,
                               logprobs_mode=config.logprobs_mode)
        started = time.perf_counter()
        runner_args = dict(
            num_blocks=kv_blocks, block_size=config.block_size,
            max_num_seqs=config.max_num_seqs, max_model_len=self.max_model_len,
            num_adapters=config.max_loras if config.enable_lora else None,
            use_cuda_graphs=use_graphs, max_num_batched_tokens=config.max_num_batched_tokens,
        )

        kernel_key = kernel_cache.kernel_key(
            self.model.spec.canonical(), self.dtype, self.device, self.determinism.value,
            config.tensor_parallel_size) if use_graphs else None
        if kernel_key is not None and not kernel_cache.kernels_cached(kernel_key):
            logger.info("first start of this model and detlora build on this GPU: compiling "
                        "its kernels (a minute or more); Triton keeps them in %s, so later "
                        "starts load them", kernel_cache.triton_cache_dir())

        def local_runner() -> ModelRunner:
            # Rank 0's only: the bar over the graph capture (the workers capture alongside).
            return ModelRunner(self.model, greedy_head=self.sampler.greedy_head,
                               device=self.device, progress=True, **runner_args)

        # Under tensor parallelism every rank builds its runner (and captures its graphs)
        # at once; the workers' runners compute logits but sample nothing.
        self.runner = local_runner() if tp is None else tp.runner(local_runner, runner_args)
        if self.runner.uses_cuda_graphs:
            built = time.perf_counter() - started
            logger.info("CUDA graphs captured in %.1f s", built)
            if kernel_key is not None:
                kernel_cache.mark_kernels_cached(kernel_key, built)
        caching = config.resolved_prefix_caching
        if caching and spec.hybrid is not None:
            logger.info("prefix caching is off for %s: a hybrid model's Mamba-2 states are "
                        "not cached at page boundaries yet, and a hit without them could "
                        "not resume with the bits of a miss", spec.architecture)
            caching = False
        if isinstance(kv_blocks, int):
            self.block_manager = BlockManager(
                num_blocks, config.block_size, enable_caching=caching,
                num_state_slots=config.max_num_seqs if spec.hybrid is not None else 0)
        else:
            self.block_manager = GroupedBlockManager(
                kv_blocks, [g.window for g in self.model.kv_groups], config.block_size,
                enable_caching=caching)
        self.scheduler = Scheduler(
            self.block_manager, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            enable_chunked_prefill=config.enable_chunked_prefill,
            max_loras=config.max_loras if config.enable_lora else None,
            position_offset=(self.model.position_offset if self.model.position_offsets_vary
                             else None),
        )
        eos = list(stop_token_ids_of(self.model_dir))
        eos += [t for t in extra_eos_token_ids if t not in eos]
        self.eos_token_ids = tuple(eos)
        # Below batch_invariant the bits depend on how steps are batched, so what shapes the
        # batches is part of the fingerprint; at batch_invariant none of it matters.
        # The tensor-parallel size joins them: at batch_invariant every size gives the same
        # bits, below it the ranks' all-reduce adds in another order.
        settings = {} if self.determinism is Determinism.BATCH_INVARIANT else {
            "block_size": config.block_size, "max_loras": config.max_loras,
            "cuda_graphs": self.runner.uses_cuda_graphs, "max_num_seqs": config.max_num_seqs,
            "max_num_batched_tokens": config.max_num_batched_tokens,
            "enable_chunked_prefill": config.enable_chunked_prefill, "num_kv_blocks": num_blocks,
            "enable_prefix_caching": caching,
            **({"tensor_parallel_size": config.tensor_parallel_size}
               if config.tensor_parallel_size > 1 else {}),
        }
        if config.logprobs_mode.value != "raw_logprobs":  # what logprobs report
            settings["logprobs_mode"] = config.logprobs_mode.value
        self._fingerprint_parts = engine_fingerprint_parts(
            weights_hash=self.model.weights_hash(), dtype=self.dtype, device=self.device,
            backend=backend.describe(), settings=settings,
        )
        self._fingerprints: dict[str | None, str] = {}  # adapter hash -> fingerprint
        self._counter = itertools.count()
        self.num_steps = 0
        self.num_steps_ahead = 0  # steps launched before the previous one was read
        self.num_admitted_ahead = 0  # requests admitted into steps launched ahead
        self._inflight: _InFlight | None = None  # a launched step not read yet
        self._failed: list[Seq] = []  # finished before their step ran, not returned yet
        # Running ahead pays where the GPU runs behind the host; on the CPU it would only
        # add work (tests turn it on there to compare bits).
        self.run_ahead = self.runner.uses_cuda_graphs
        kv_gib = sum(n * b for n, b in zip(
            [kv_blocks] if isinstance(kv_blocks, int) else kv_blocks,
            self.model.kv_page_bytes(config.block_size), strict=True)) / 2**30
        logger.info(
            "engine ready: %s on %s, %s, determinism %s (LoRA reduction %s), KV cache %d "
            "blocks of %d tokens (%.2f GiB), %s, fingerprint %s", config.model, self.device,
            str(self.dtype).replace("torch.", ""), self.determinism.value,
            self.lora_reduction.value, num_blocks, config.block_size, kv_gib,
            "CUDA graphs" if self.runner.uses_cuda_graphs else "eager",
            self.fingerprint_of(None))
        if getattr(self.runner, "state_cache", None) is not None:
            logger.info("state cache: %d slots of %s (%s) for the Mamba-2 layers, "
                        "chunk grid of %d positions", self.runner.state_cache.num_slots,
                        kv_sizing.size_text(self.model.state_bytes_per_slot()),
                        kv_sizing.size_text(self.runner.state_cache.nbytes),
                        self.model.mamba_chunk_size)

    # ---- setup ----

    def _start_tensor_parallel(self, spec, lora_config) -> None:
        """Start (or, under torchrun, meet) the workers of ranks 1..N-1; they load their
        shards while this process loads rank 0's."""
        from detlora.distributed.nccl_env import pin_nccl_for_run_to_run
        from detlora.distributed.tp_sizes import TensorParallelDims, check_tensor_parallel
        from detlora.engine.runner.tp_driver import TensorParallelDriver, next_group_name
        from detlora.engine.runner.tp_worker import ShardPayload
        from detlora.json_files import read_json_object

        c = self.config
        if spec.gemma is not None:  # before any worker starts (models/gemma3.py refuses too)
            raise ValueError(f"{spec.architecture}: tensor parallelism is not supported for "
                             "Gemma models yet (use tensor_parallel_size=1)")
        # The rule docs/tensor_parallel.md's table is computed with, on the same config.json.
        config_json = read_json_object(Path(self.model_dir), "config.json", "model",
                                       "a model directory")
        check_tensor_parallel(TensorParallelDims.from_config(config_json),
                              c.tensor_parallel_size)
        if (c.enable_lora and self.determinism is Determinism.BATCH_INVARIANT
                and self.lora_reduction is not LoRAReduction.IN_GEMM):
            raise ValueError("tensor parallelism at batch_invariant reduces the LoRA shrink of "
                             "row-parallel layers inside the base GEMM: use "
                             "lora_reduction='in_gemm' (the default)")
        if self.device.type == "cuda":
            if self.determinism is Determinism.RUN_TO_RUN:
                pin_nccl_for_run_to_run()
            index = self.device.index if self.device.index is not None else 0
            if index + c.tensor_parallel_size > torch.cuda.device_count():
                raise ValueError(f"tensor_parallel_size={c.tensor_parallel_size} from "
                                 f"cuda:{index} needs {index + c.tensor_parallel_size} GPUs, "
                                 f"{torch.cuda.device_count()} are visible")
        payload = ShardPayload(
            model=str(self.model_dir), dtype=self.dtype, device=self.device.type,
            device_index=self.device.index or 0, determinism=self.determinism,
            lora_reduction=self.lora_reduction, max_lora_rank=c.max_lora_rank, lora=lora_config,
            max_positions=self.max_model_len, num_threads=torch.get_num_threads(),
            group_name=next_group_name())
        self.tp_driver = TensorParallelDriver.start(c.tensor_parallel_size, payload)
        self.device = self.tp_driver.group.device

    def _default_num_blocks(self) -> int:
        c = self.config
        if self.device.type == "cpu":
            return kv_sizing.cpu_num_blocks(self.model, block_size=c.block_size,
                                            max_num_seqs=c.max_num_seqs,
                                            max_model_len=self.max_model_len,
                                            max_num_batched_tokens=c.max_num_batched_tokens)
        runner_args = dict(block_size=c.block_size, max_num_seqs=c.max_num_seqs,
                           max_model_len=self.max_model_len,
                           num_adapters=c.max_loras if c.enable_lora else None)
        sizing = dict(block_size=c.block_size, max_num_batched_tokens=c.max_num_batched_tokens,
                      max_num_seqs=c.max_num_seqs, max_model_len=self.max_model_len,
                      gpu_memory_utilization=c.gpu_memory_utilization)

        def factory(n: int) -> ModelRunner:
            return ModelRunner(self.model, device=self.device, num_blocks=n,
                               use_cuda_graphs=False, **runner_args)

        def local() -> int:
            return kv_sizing.cuda_num_blocks(factory, self.model, device=self.device,
                                             allocated_before=self._allocated_before, **sizing)

        if self.tp_driver is None:
            return local()
        return self.tp_driver.min_kv_blocks(local, {"runner": runner_args, "sizing": sizing})

    @property
    def num_kv_blocks(self) -> int:
        return self.block_manager.num_blocks

    # ---- requests ----

    def grammar_backend(self) -> GrammarBackend:
        """The structured-output compiler for this model's tokenizer (built on first use)."""
        if self._grammars is None:
            if self.tokenizer is None:
                raise ValueError("structured outputs need the model's tokenizer, and this "
                                 "engine has none")
            self._grammars = GrammarBackend(self.tokenizer.hf, self.spec.vocab_size,
                                            self.eos_token_ids)
        return self._grammars

    def check_request(self, prompt_token_ids: Sequence[int], params: SamplingParams,
                      lora: LoRARequest | None,
                      label_token_ids: Sequence[int] | None = None) -> None:
        """Raise ValueError for a request the engine could never run."""
        self.check_requests([(prompt_token_ids, params, lora, label_token_ids)])

    def check_requests(
        self, requests: Sequence[tuple[Sequence[int], SamplingParams, LoRARequest | None,
                                       Sequence[int] | None]],
    ) -> list[list[int]]:
        """``check_request`` for each (prompt ids, params, lora, label ids): what depends only
        on the params or the adapter is checked once per distinct object, so a call of
        thousands of short requests sharing them costs microseconds a request. A ValueError
        names the request's index when there is more than one. Returns each request's prompt
        ids as a list of ints (what ``add_request(..., checked=True)`` takes)."""
        self._check_running()
        params_seen: set[int] = set()
        loras_seen: set[int] = set()
        several = len(requests) > 1
        out: list[list[int]] = []
        for i, (prompt_token_ids, params, lora, label_token_ids) in enumerate(requests):
            try:
                if id(params) not in params_seen:
                    self._check_params(params)
                    params_seen.add(id(params))
                if lora is not None and id(lora) not in loras_seen:
                    self._check_lora(lora)
                    loras_seen.add(id(lora))
                out.append(self._check_prompt(prompt_token_ids, params, label_token_ids))
            except ValueError as e:
                if several:
                    raise type(e)(f"request {i}: {e}") from None
                raise
        return out

    def _check_params(self, params: SamplingParams) -> None:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        vocab = self.spec.vocab_size
        if params.stop and self.detokenize is None:
            raise ValueError("stop strings need the model's tokenizer, and this engine has "
                             "none: use stop_token_ids")
        for name, ids in (("logit_bias", params.logit_bias or ()),
                          ("allowed_token_ids", params.allowed_token_ids or ())):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise ValueError(f"{name} names token ids outside the vocabulary [0, {vocab}): "
                                 f"{bad[:5]}")
        if params.structured_outputs is not None:
            self.grammar_backend().compile(params.structured_outputs)
        for name in ("logprobs", "prompt_logprobs"):
            want = getattr(params, name)
            if want is not None and want > vocab:
                raise ValueError(f"{name}={want} asks for more top tokens than the "
                                 f"vocabulary holds ({vocab})")

    def _check_lora(self, lora: LoRARequest) -> None:
        if self.lora_manager is None:
            raise ValueError("a lora_request was given but the engine was built with "
                             "enable_lora=False")
        if not isinstance(lora, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora).__name__}")
        self.lora_manager.check(lora)
        if not _is_dir(lora.real_path):  # the rest is checked when it is read
            raise FileNotFoundError(f"adapter directory {lora.path} does not exist "
                                    f"(LoRARequest {lora.name!r}, id {lora.id})")

    def _check_prompt(self, prompt_token_ids: Sequence[int], params: SamplingParams,
                      label_token_ids: Sequence[int] | None) -> list[int]:
        """The prompt's ids as a list of ints, once they pass."""
        ids = token_id_list(prompt_token_ids, "prompt_token_ids")
        n = len(ids)
        if n == 0:
            raise ValueError("a prompt must have at least one token")
        vocab = self.spec.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:  # in C; then the first bad one, for the message
            bad = next(t for t in ids if not 0 <= t < vocab)
            raise ValueError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})")
        if label_token_ids is not None and (not label_token_ids or any(
                isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab
                for t in label_token_ids)):
            raise ValueError(f"label_token_ids must be token ids in [0, {vocab}), "
                             f"got {list(label_token_ids)[:5]}")
        if n >= self.max_model_len:
            raise ValueError(
                f"prompt of {n} tokens is too long: max_model_len={self.max_model_len} leaves "
                f"room for prompts of at most {self.max_model_len - 1} tokens"
            )
        pages = self.block_manager.blocks_for(self._max_len(n, params) - 1)
        if pages > self.block_manager.num_blocks:
            outputs = params.max_tokens or f"up to max_model_len={self.max_model_len}"
            raise ValueError(
                f"the KV cache ({self.block_manager.num_blocks} blocks of "
                f"{self.config.block_size} tokens) cannot hold one sequence of "
                f"{n} prompt + {outputs} output tokens; raise num_kv_blocks"
            )
        return ids

    def _max_len(self, prompt_len: int, params: SamplingParams) -> int:
        """Prompt + max_tokens, capped at max_model_len (max_tokens=None: the cap)."""
        if params.max_tokens is None:
            return self.max_model_len
        return min(prompt_len + params.max_tokens, self.max_model_len)

    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        lora: LoRARequest | None = None,
        prompt: str | None = None,
        request_id: str | None = None,
        sample_index: int = 0,
        label_token_ids: Sequence[int] | None = None,
        checked: bool = False,
    ) -> Seq:
        """One completion of a prompt: ``sample_index`` i < ``params.n`` picks its seed (see
        ``SamplingParams``). ``label_token_ids``: report the raw logprobs of the first output
        position at these ids (``RequestOutput.label_logprobs``; decisions read them).
        ``checked``: the caller has passed these very arguments through ``check_requests``
        and gives the prompt ids it returned (a bulk caller checks once, not twice)."""
        self._check_running()
        if checked:
            ids = prompt_token_ids  # check_requests' list of ints
        else:
            ids = self.check_requests([(prompt_token_ids, params, lora, label_token_ids)])[0]
        index = next(self._counter)
        if params.seed is None:
            seed = derive_seed(self.config.seed, index)
        else:
            seed = params.seed if sample_index == 0 else derive_seed(params.seed, sample_index)
        seq = Seq(
            seq_id=index,
            request_id=request_id if request_id is not None else str(index),
            prompt=prompt,
            prompt_token_ids=ids,
            params=params,
            sample_seed=seed,
            max_len=self._max_len(len(ids), params),
            lora=lora,
            label_token_ids=None if label_token_ids is None else tuple(label_token_ids),
            arrival_time=time.time(),
        )
        if params.structured_outputs is not None:
            seq.grammar = self.grammar_backend().matcher(params.structured_outputs)
        self.scheduler.add(seq)
        return seq

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def abort_request(self, request_id: str | Sequence[str]) -> None:
        """Drop the unfinished requests with these ids (vLLM's ``abort_request``): their
        pages are freed, and ``step`` returns nothing for them. Finished or unknown ids are
        ignored. A row of theirs in a step already launched is read and dropped."""
        ids = {request_id} if isinstance(request_id, str) else set(request_id)
        for seq in [*self.scheduler.waiting, *self.scheduler.running]:
            if seq.request_id in ids:
                self.scheduler.abort(seq)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached page (vLLM's ``reset_prefix_cache``); True when done."""
        self.block_manager.reset_cache()
        return True

    def abort_all(self) -> None:
        """Drop every unfinished request (and a step in flight) and free its pages."""
        self._inflight = None
        self._failed = []
        self.scheduler.abort_all()

    # ---- adapters ----

    def register_lora(self, request: LoRARequest) -> None:
        """Register an adapter by path without reading it: it is read, checked and copied
        into a slot when a request first needs it. A server registers its adapters up front
        and maps names to them with ``registered_loras``. FileNotFoundError for a missing
        directory; ValueError when the id already names another path or the name another
        id."""
        self._lora_manager_or_raise().register(request)

    def add_lora(self, request: LoRARequest) -> bool:
        """Register an adapter and read, check and convert it into the host cache now
        (vLLM's ``add_lora``), so that its first request waits for no disk read. Raises what
        reading it raises; True once it is cached."""
        manager = self._lora_manager_or_raise()
        manager.register(request)
        manager.load(request)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        """Forget an adapter (vLLM's ``remove_lora``): its slot is freed, and its id may name
        another directory afterwards. Refused while unfinished requests use it. True if the
        id was known."""
        manager = self._lora_manager_or_raise()
        in_use = {s.lora.id for s in [*self.scheduler.waiting, *self.scheduler.running]
                  if s.lora is not None}
        return manager.unregister(lora_id, in_use=in_use)

    def list_loras(self) -> set[int]:
        """Ids of the registered adapters (vLLM's ``list_loras``), registered explicitly or
        by a request's first successful use."""
        return {r.id for r in self.registered_loras()}

    def registered_loras(self) -> list[LoRARequest]:
        """The registered adapters' requests, in registration order ([] without LoRA)."""
        return [] if self.lora_manager is None else self.lora_manager.registry.requests()

    @property
    def lora_stats(self) -> LoRAStats | None:
        """Adapter traffic counters (slot and host-cache hits and misses, swaps and their
        time), None without LoRA."""
        return None if self.lora_manager is None else self.lora_manager.stats

    def _prefetch_adapters(self, launched: SchedulerOutput) -> None:
        """Read the adapters the next admissions will want into the host cache, and copy
        them into free or idle slots (never waiting for disk; decides no schedule). A slot
        whose running requests all reach their length in the step just ``launched`` is
        idle: the next wave's adapter is copied into it behind that step on the GPU."""
        assert self.lora_manager is not None
        upcoming = self.scheduler.upcoming_adapters(PREFETCH_DEPTH * self.config.max_loras)
        if upcoming:
            ending = {id(it.seq) for it in launched.scheduled
                      if it.samples and len(it.seq.token_ids) + 1 >= it.seq.max_len}
            keep = {s.lora.id for s in self.scheduler.running
                    if s.lora is not None and id(s) not in ending}
            self.lora_manager.prefetch(upcoming, keep)

    def _lora_manager_or_raise(self) -> LoRAManager:
        if self.lora_manager is None:
            raise ValueError("this engine was built with enable_lora=False: it has no adapters")
        return self.lora_manager

    def shutdown(self) -> None:
        """Drop every request and let go of the model, KV cache, CUDA graphs (reset, with
        their memory pool), adapters and pinned buffers, so that their memory returns to the
        device now, and stop the tensor-parallel workers; the engine cannot run afterwards.
        Calling it again does nothing. Dropping the last reference to an engine frees the
        same: no reference cycle keeps it alive."""
        if self.is_shut_down:
            return
        self.is_shut_down = True
        self._inflight = None
        if hasattr(self, "scheduler"):
            self.scheduler.abort_all()
        if getattr(self, "runner", None) is not None:
            self.runner.close()  # graphs reset, KV cache unbound from the model
        if getattr(self, "lora_manager", None) is not None:
            self.lora_manager.shutdown()
        for name in _HELD:
            if hasattr(self, name):
                delattr(self, name)
        self._grammars = None
        if getattr(self, "tp_driver", None) is not None:
            self.tp_driver.shutdown()
        import gc

        gc.collect()  # anything a user's own cycles held of it
        device = getattr(self, "device", None)
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()

    def _check_running(self) -> None:
        if self.is_shut_down:
            raise RuntimeError("this engine was shut down: build a new one")

    # ---- the step ----

    def step(self) -> list[RequestOutput]:
        """One step (``step_sequences``); an output for each request that read a token in it,
        as its ``output_kind`` asks: CUMULATIVE and DELTA every time (``finished=False``
        until the last), FINAL_ONLY once it finishes."""
        outputs = []
        for seq in self.step_sequences():
            kind = seq.params.output_kind
            if kind is RequestOutputKind.FINAL_ONLY and not seq.is_finished:
                continue
            outputs.append(self.output_of(seq, delta=kind is RequestOutputKind.DELTA))
        return outputs

    def step_sequences(self) -> list[Seq]:
        """Schedule, run the model, sample; return the sequences that read a token (finished
        ones included, in row order).

        With decode graphs (``run_ahead``) the engine runs one step ahead: while a step is in
        flight, the next one (every running sequence decodes again, and waiting requests the
        scheduler admits prefill) is scheduled and launched with the decode input tokens left
        on the device by the sampler, and only then is the first one read. The host's work
        then hides behind the GPU's, also while requests arrive or queue for a sequence slot.
        A row computed ahead for a sequence that the read step finished (a stop token) is
        dropped, and a queued request takes the freed slot one step later; under
        batch_invariant the bits do not depend on either (``_launch_ahead``).
        """
        self._check_running()
        if self._inflight is None:
            sched = self.scheduler.schedule()
            if not sched.scheduled:
                if self.scheduler.has_unfinished():
                    raise RuntimeError("the scheduler could not schedule any waiting sequence "
                                       "(KV cache too small for the next prompt?)")
                return []
            self._inflight = self._launch(sched)
            if self._inflight is None:
                return self._take_failed()  # a prefill chunk: nothing sampled yet
        current = self._inflight
        self._inflight = self._launch_ahead(current)
        touched = self._collect(current)
        if self._inflight is not None and not self.scheduler.running:
            self._collect(self._inflight)  # every row of it belongs to a finished sequence
            self._inflight = None
        return self._take_failed() + touched

    def _take_failed(self) -> list[Seq]:
        """The sequences that failed before their step ran (an adapter that would not load),
        once."""
        failed, self._failed = self._failed, []
        return failed

    def _launch(self, sched: SchedulerOutput,
                fed_rows: list[int | None] | None = None) -> _InFlight | None:
        """Run the model and queue the sampling of ``sched``; None when no row samples.
        ``fed_rows[i]``: the previous step's row whose token is sequence i's input (None: a
        sequence admitted in this step, whose prompt tokens the host has)."""
        self.num_steps += 1
        seqs = [s.seq for s in sched.scheduled]
        now = time.time()
        for seq in seqs:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
        slots = [-1] * len(seqs)
        if self.lora_manager is not None:
            sched, fed_rows, slots = self._activate_adapters(sched, fed_rows)
            if not sched.scheduled:
                return None
            seqs = [s.seq for s in sched.scheduled]
        step = build_step_inputs(sched, slots, self.config.block_size, fed_rows)
        out = self.runner.execute(step, sched.is_decode_only)
        if self.lora_manager is not None:
            self._prefetch_adapters(sched)  # while the step runs
        if step.prompt_rows:
            assert out is not None and out.prompt_hidden is not None
            self._score_prompts(step, seqs, out.prompt_hidden)
        register = self.block_manager.register
        sampling = []
        for seq, num_tokens, samples in sched.scheduled:
            seq.num_computed += num_tokens
            register(seq)
            if samples:
                sampling.append(seq)
        if not sampling:
            return None
        assert out is not None
        # A step launched ahead: sequence i's last token is row fed_rows[i] of ``fed_tokens``.
        fed_of = {} if fed_rows is None else {
            id(item.seq): r for item, r in zip(sched.scheduled, fed_rows, strict=True)
            if r is not None}
        labels = self._read_labels(sampling, out.logits)
        sample_request = self._sample_request
        requests = ([sample_request(s, fed_of.get(id(s))) for s in sampling] if fed_of
                    else [sample_request(s) for s in sampling])
        pending = self.sampler.launch(out.logits, requests, greedy=out.greedy,
                                      fed=self.runner.fed_tokens if fed_of else None)
        if pending.tokens is not None and self.run_ahead:
            self.runner.feed(pending.tokens)
        positions = []
        for s in sampling:  # the token's place, filled when the step is read
            positions.append(len(s.token_ids))
            s.token_ids.append(UNREAD)
        return _InFlight(sampling, positions, pending, self.num_steps, labels)

    def _activate_adapters(
        self, sched: SchedulerOutput, fed_rows: list[int] | None,
    ) -> tuple[SchedulerOutput, list[int] | None, list[int]]:
        """Every scheduled sequence's adapter slot (-1: none). A sequence whose adapter
        cannot be loaded (unreadable, refused by its checks, changed on disk) leaves the step
        and finishes with finish_reason "error": its own requests fail, not the batch."""
        assert self.lora_manager is not None
        items = list(sched.scheduled)
        self.lora_manager.begin_step([it.seq.lora for it in items])
        slot_of: dict[int, int] = {}
        failed: dict[int, Exception] = {}
        for it in items:
            lora = it.seq.lora
            if lora is None or lora.id in slot_of or lora.id in failed:
                continue
            try:
                slot_of[lora.id] = self.lora_manager.slot_for(lora)
            except (ValueError, TypeError, OSError) as e:  # OSError: a file that vanished
                failed[lora.id] = e
        if failed:
            kept = [k for k, it in enumerate(items)
                    if it.seq.lora is None or it.seq.lora.id not in failed]
            for k, it in enumerate(items):
                if k not in kept:
                    lora = it.seq.lora
                    self._fail(it.seq, f"adapter {lora.name!r} (id {lora.id}, {lora.path}) "
                                       f"could not be loaded: {failed[lora.id]}")
            sched = dataclasses.replace(sched, scheduled=tuple(items[k] for k in kept))
            fed_rows = None if fed_rows is None else [fed_rows[k] for k in kept]
        slots = []
        last, slot = None, -1
        for it in sched.scheduled:  # runs of one adapter object look it up once
            lora = it.seq.lora
            if lora is not last:
                last, slot = lora, -1 if lora is None else slot_of[lora.id]
            slots.append(slot)
        return sched, fed_rows, slots

    def _fail(self, seq: Seq, message: str) -> None:
        """Finish ``seq`` with finish_reason "error" before its step runs; ``step_sequences``
        returns it."""
        while seq.token_ids and seq.token_ids[-1] == UNREAD:  # a token it will not read
            seq.token_ids.pop()
        seq.error = message
        self.scheduler.finish(seq, FinishReason.ERROR)
        self._failed.append(seq)

    def _read_labels(self, sampling: list[Seq], logits: torch.Tensor
                     ) -> tuple[list[Seq], PendingSample] | None:
        """Queue the raw logprobs at their label ids of the rows sampling a first output
        token; ``_collect`` hands them to their sequences with the step's tokens."""
        rows = [i for i, s in enumerate(sampling) if s.label_token_ids is not None
                and s.label_logprobs is None and s.num_output_tokens == 0]
        if not rows:
            return None
        if rows[-1] - rows[0] + 1 == len(rows):  # one run of rows (a step of decisions): a view
            picked = logits[rows[0]: rows[-1] + 1]
        else:
            index = torch.tensor(rows, dtype=torch.int64).to(logits.device, non_blocking=True)
            picked = logits.index_select(0, index)
        pending = self.sampler.launch_token_logprobs(
            picked, [sampling[i].label_token_ids for i in rows])
        return [sampling[i] for i in rows], pending

    def _launch_ahead(self, current: _InFlight) -> _InFlight | None:
        """Launch the next step before ``current`` is read, when every running sequence is
        sure to decode in it or to end with it: each sampled in ``current``, and either the
        KV pages for its next token are free, or ``current`` brings it to its length (it
        ends when ``current`` is read, whatever its token: it is left out). Waiting requests
        that the scheduler admits join the step with their prompts (vLLM's async
        scheduling), so arrivals do not stop the run-ahead, and a wave of one-token requests
        (each ending in its first step) prefills the next wave while its own step runs. A
        slot that ``current`` frees (a stop token the host has not read) is filled one step
        later than step by step would: batches then differ, never a batch_invariant row's
        bits."""
        running = self.scheduler.running
        if (
            not self.run_ahead
            or not running
            or len(running) > self.config.max_num_batched_tokens
            # A grammar's next mask needs the token the step in flight samples.
            or any(seq.grammar is not None for seq in running)
        ):
            return None
        rows = {id(seq): r for r, seq in enumerate(current.seqs)}
        offset = self.scheduler.position_offset
        needs = []
        ending: set[int] = set()  # reach their length in ``current``
        for seq in running:
            length = len(seq.token_ids)  # with the unread token
            if id(seq) not in rows or length - seq.num_computed != 1:  # its pending tokens
                return None
            if length >= seq.max_len:  # max_tokens or max_model_len
                ending.add(id(seq))
                continue
            if offset is not None and offset(length) != seq.position_offset:
                return None  # LongRoPE past its original context: recomputed once read
            needs.append((seq, length))
        if not self.block_manager.fits(needs):  # pages for every next token, in every group
            return None
        if len(ending) == len(running) and not self.scheduler.waiting:
            return None  # nothing would run in it
        decoding = len(running) - len(ending)
        sched = self.scheduler.schedule(ending=ending)
        items = sched.scheduled
        if (sched.preempted or len(items) < decoding
                or any(it.num_tokens != 1 or id(it.seq) not in rows for it in items[:decoding])):
            raise RuntimeError("a step scheduled ahead did not decode every running sequence")
        if not items:
            return None  # every sequence ends, and no waiting one fits yet
        self.num_steps_ahead += 1
        self.num_admitted_ahead += len(items) - decoding
        return self._launch(sched, [rows[id(it.seq)] for it in items[:decoding]]
                            + [None] * (len(items) - decoding))

    def _collect(self, inflight: _InFlight) -> list[Seq]:
        """Read a launched step's tokens into its sequences; the sequences that got one."""
        results = inflight.pending.result()
        if inflight.labels is not None:
            seqs, pending = inflight.labels
            for seq, logprobs in zip(seqs, pending.result(), strict=True):
                seq.label_logprobs = logprobs
        touched: list[Seq] = []
        now = time.time()
        vocab = self.spec.vocab_size
        register = self.block_manager.register
        finish_reason = self._finish_reason
        finished = SequenceStatus.FINISHED
        for seq, pos, result in zip(inflight.seqs, inflight.positions, results, strict=True):
            if seq.status is finished:
                continue  # finished by the step before: this row ran ahead for nothing
            token = result.token_id
            if not result.finite or not 0 <= token < vocab:
                del seq.token_ids[pos:]  # its unread token (and one launched ahead)
                seq.error = self._nonfinite_message(seq, pos, inflight.step, result)
                self.scheduler.finish(seq, FinishReason.ERROR)
                touched.append(seq)
                continue
            seq.token_ids[pos] = token
            seq.last_token_time = now
            if seq.first_token_time is None:
                seq.first_token_time = now
            if result.logprobs is not None:
                seq.logprobs.append(result.logprobs)
                seq.logprob_ranks.append(result.ranks)
            reason = finish_reason(seq, token, pos + 1)
            if reason is None and seq.grammar is not None \
                    and isinstance(seq.grammar, GrammarMatcher):
                seq.grammar.accept(token)
                if seq.grammar.is_terminated:  # complete, and only a stop token fits now
                    reason = FinishReason.STOP
            if reason is None:
                register(seq)  # a page that waited for this token
            else:
                del seq.token_ids[pos + 1:]  # the unread token of a step launched ahead
                self.scheduler.finish(seq, reason)  # registers its pages as it frees them
            touched.append(seq)
        return touched

    def _nonfinite_message(self, seq: Seq, pos: int, step: int, result: SampleResult) -> str:
        """Why a row's sampling failed: whose logits, and where."""
        lora = seq.lora
        who = ("the base model" if not isinstance(lora, LoRARequest) else
               f"adapter {lora.name!r} (id {lora.id}, {lora.path})")
        what = ("were not finite (NaN or inf)" if not result.finite else
                f"gave token id {result.token_id}, outside the vocabulary "
                f"[0, {self.spec.vocab_size})")
        return (f"the logits of {who} {what} when sampling output token "
                f"{pos - seq.num_prompt_tokens + 1} (engine step {step}); the request was "
                "stopped, the others go on")

    def _score_prompts(self, step: StepInputs, seqs: list[Seq], hidden: torch.Tensor) -> None:
        """Append the prompt logprobs of ``step.prompt_rows`` (their hidden states) to their
        sequences, in position order (a sequence's rows come in order, chunk after chunk).
        The LM head runs ``PROMPT_BLOCK`` rows at a time, so a long prefill chunk never holds
        all its [rows, V] logits at once."""
        owners = [seqs[k] for k in step.prompt_row_seqs]
        targets = [seq.token_ids[p + 1]
                   for seq, p in zip(owners, step.prompt_row_positions, strict=True)]
        top_n = [seq.params.prompt_logprobs for seq in owners]
        scored: list[tuple[dict[int, float], tuple[int, ...]]] = []
        for lo in range(0, len(owners), PROMPT_BLOCK):
            logits = self.runner.prompt_logits(hidden[lo: lo + PROMPT_BLOCK])
            scored += self.sampler.prompt_logprobs(logits, targets[lo: lo + PROMPT_BLOCK],
                                                   top_n[lo: lo + PROMPT_BLOCK])
        for seq, p, (entry, ranks) in zip(owners, step.prompt_row_positions, scored,
                                          strict=True):
            assert p == len(seq.prompt_logprobs)
            seq.prompt_logprobs.append(entry)
            seq.prompt_logprob_ranks.append(ranks)

    def _stop_ids(self, seq: Seq) -> tuple[int, ...]:
        eos = () if seq.params.ignore_eos else self.eos_token_ids
        return tuple(dict.fromkeys((*eos, *seq.params.stop_token_ids)))

    def _sample_request(self, seq: Seq, fed_row: int | None = None) -> SampleRequest:
        """``fed_row``: in a step launched ahead, where the sequence's unread last token is."""
        params = seq.params
        banned = (self._stop_ids(seq) if params.min_tokens
                  and seq.num_output_tokens < params.min_tokens else ())
        # Most rows have no adjustment: skip copying their output tokens every step.
        adjust = (row_adjust(params, seq.prompt_token_ids, seq.output_token_ids, fed_row)
                  if has_adjustments(params) else None)
        mask = None
        if seq.grammar is not None and isinstance(seq.grammar, GrammarMatcher):
            mask = torch.empty(seq.grammar.mask_words, dtype=torch.int32)
            seq.grammar.fill_mask(mask)
        return SampleRequest(params, seq.sample_seed, len(seq.token_ids), banned, adjust,
                             token_mask=mask)

    def _finish_reason(self, seq: Seq, token: int, length: int) -> FinishReason | None:
        """Why ``seq`` ends with ``token`` as its ``length``-th token, if it does (vLLM's
        order: EOS, stop strings, stop token ids, length); sets ``seq.stop_reason``."""
        params = seq.params
        if not params.ignore_eos and token in self.eos_token_ids:
            return FinishReason.STOP
        if params.stop and length - seq.num_prompt_tokens >= params.min_tokens:
            assert self.detokenize is not None  # check_request: stop strings need a tokenizer
            match = match_stop_string(self.detokenize, seq.token_ids[seq.num_prompt_tokens:length],
                                      params.stop, params.include_stop_str_in_output)
            if match is not None:
                seq.stop_reason, seq.text_end = match.stop, match.text_end
                return FinishReason.STOP
        if token in params.stop_token_ids:
            seq.stop_reason = token
            return FinishReason.STOP
        if length >= seq.max_len:  # max_tokens or max_model_len
            return FinishReason.LENGTH
        return None

    # ---- results ----

    def fingerprint_of(self, lora: LoRARequest | None) -> str:
        adapter = None
        if lora is not None and self.lora_manager is not None:
            adapter = self.lora_manager.adapter_hash(lora.lora_int_id)
        # Every output carries one: hashed once per adapter content, not per output.
        known = self._fingerprints.get(adapter)
        if known is None:
            known = self._fingerprints[adapter] = fingerprint(self._fingerprint_parts, adapter)
        return known

    @property
    def fingerprint_parts(self) -> dict:
        """What the engine puts into every fingerprint (``engine_fingerprint_parts``): an
        audit log records it, so a mismatch can name the input that differs."""
        return self._fingerprint_parts

    def adapter_hash(self, lora: LoRARequest | None) -> str | None:
        """The content hash of a loaded adapter (None for the base model)."""
        if lora is None or self.lora_manager is None:
            return None
        return self.lora_manager.adapter_hash(lora.lora_int_id)

    def _output_fingerprint(self, seq: Seq) -> str:
        """``fingerprint_of`` the request's adapter; one that never loaded (the request
        failed) has no content hash, so its path stands in for it."""
        try:
            return self.fingerprint_of(seq.lora)
        except ValueError:
            if seq.finish_reason is not FinishReason.ERROR:
                raise
            return fingerprint(self._fingerprint_parts, f"not loaded: {seq.lora.real_path}")

    def output_of(self, seq: Seq, *, delta: bool = False) -> RequestOutput:
        """The request's output so far (its read tokens), or with ``delta`` only the tokens,
        logprobs and text not reported by an earlier delta. Text needs a tokenizer and
        ``params.detokenize``; an unfinished request's text grows by whole characters."""
        params = seq.params
        finished = seq.status is SequenceStatus.FINISHED
        num_prompt = len(seq.prompt_token_ids)
        num_read = (len(seq.token_ids) - num_prompt if finished
                    else seq.num_read_output_tokens)
        out_ids = seq.token_ids[num_prompt: num_prompt + num_read]
        start = seq.num_reported if delta else 0
        text = self._text_of(seq, out_ids, delta)
        lps = cumulative = None
        if params.logprobs is not None:
            entry = self._logprobs_entry
            lps = [entry(d, ranks) for d, ranks in
                   zip(seq.logprobs[start:num_read], seq.logprob_ranks[start:num_read],
                       strict=True)]
            # Each entry lists the chosen token first; summed in token order.
            cumulative = sum([next(iter(d.values())) for d in seq.logprobs[:num_read]])
        reason = seq.finish_reason
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=out_ids[start:] if start else out_ids,  # a copy already
            logprobs=lps,
            finish_reason=reason.value if reason else None,
            stop_reason=seq.stop_reason,
            cumulative_logprob=cumulative,
            error=seq.error,
        )
        first = not delta or seq.num_reported == 0
        seq.num_reported = num_read
        return RequestOutput(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=list(seq.prompt_token_ids),
            outputs=[completion],
            finished=finished,
            fingerprint=self._output_fingerprint(seq),
            prompt_logprobs=None if params.prompt_logprobs is None or not first else [None, *(
                self._logprobs_entry(d, ranks)
                for d, ranks in zip(seq.prompt_logprobs, seq.prompt_logprob_ranks, strict=True))],
            num_cached_tokens=seq.num_cached_tokens or 0,
            label_logprobs=seq.label_logprobs,
            lora_request=seq.lora,
            metrics=RequestMetrics(
                arrival_time=seq.arrival_time,
                first_scheduled_time=seq.first_scheduled_time,
                first_token_time=seq.first_token_time,
                last_token_time=seq.last_token_time,
                finished_time=time.time() if finished else None,
            ),
        )

    def _text_of(self, seq: Seq, out_ids: list[int], delta: bool) -> str:
        """The output text (or, with ``delta``, its new part). A finished request gets the
        exact ``decode(ids)[:text_end]``; a running one the incremental detokenizer's text."""
        if self.detokenize is None or not seq.params.detokenize:
            return ""
        if seq.is_finished and seq.detokenizer is None:  # a one-off report: decode once
            text = self.detokenize(out_ids)
            return text if seq.text_end is None else text[: seq.text_end]
        if seq.detokenizer is None:
            hold = max((len(s) for s in seq.params.stop), default=1) - 1
            seq.detokenizer = IncrementalDetokenizer(self.detokenize, hold_back=hold)
        detok = seq.detokenizer
        assert isinstance(detok, IncrementalDetokenizer)
        new = (detok.finish(out_ids, seq.text_end) if seq.is_finished
               else detok.update(out_ids))
        return new if delta else detok.text

    def _logprobs_entry(self, values: dict[int, float],
                        ranks: Sequence[int]) -> dict[int, Logprob]:
        """One position's {token id: Logprob}, ``ranks`` in the entries' order."""
        text = self.token_text
        if len(values) == 1 and len(ranks) == 1:  # the chosen token alone (logprobs=0)
            (token, value), = values.items()
            return {token: Logprob(value, ranks[0], None if text is None else text(token))}
        return {token: Logprob(value, rank, None if text is None else text(token))
                for (token, value), rank in zip(values.items(), ranks, strict=True)}

"""One request's state as it moves through the engine: tokens, KV pages, progress, result.

A sequence holds its prompt and the tokens generated so far in one list. ``num_computed``
counts the leading tokens whose K/V sit in the cache; the scheduler gives a step the tokens
``[num_computed, num_computed + n)``, and once every token is computed the step's logits row
samples the next token. Preemption sets ``num_computed`` back to zero and frees the pages, so
the recompute is an ordinary prefill of prompt + generated tokens (or, with prefix caching,
a prefill after the pages still cached). ``page_keys`` are the content keys of the full pages
of ``token_ids`` (``block_hashes``); the first ``num_registered_pages`` of ``block_table`` are
in the prefix cache. While the step that samples
a token is in flight (the engine runs one step ahead), its place in ``token_ids`` holds -1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from detlora.config import SamplingParams


class SequenceStatus(str, Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, Enum):
    LENGTH = "length"  # max_tokens or max_model_len reached
    STOP = "stop"  # an EOS or stop token was generated, or a stop string completed
    ABORT = "abort"  # dropped by LLMEngine.abort_request
    ERROR = "error"  # the request could not go on (``Sequence.error`` says why)


@dataclass(eq=False)
class Sequence:
    """Mutable per-request state; owned by one engine, driven by its scheduler."""

    seq_id: int  # engine-wide arrival index: decides the default seed and the FCFS order
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    sample_seed: int  # params.seed, or derived from (engine seed, seq_id)
    max_len: int  # prompt + max_tokens, capped at max_model_len
    lora: object | None = None  # a LoRARequest, or None for the base model
    # Added to every position the model sees (the model's position_offset of the prompt:
    # LongRoPE's long table for long prompts; 0 for most models). Fixed at arrival.
    position_offset: int = 0
    token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed: int = 0  # leading tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    logprob_ranks: list[tuple[int, ...]] = field(default_factory=list)  # per logprobs entry
    prompt_logprobs: list[dict[int, float]] = field(default_factory=list)  # tokens 1, 2, ...
    prompt_logprob_ranks: list[tuple[int, ...]] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    text_end: int | None = None  # characters of the output text kept (set by a stop string)
    error: str | None = None  # why it finished with FinishReason.ERROR
    num_preemptions: int = 0
    # Models with several KV page groups (engine/sched/grouped_block_manager.py): the block
    # tables of groups 1.. (group 0's is ``block_table``), and per group how many leading
    # entries are -1 (pages behind a sliding window, released or never allocated).
    group_tables: list[list[int]] = field(default_factory=list)
    released: list[int] = field(default_factory=list)
    page_keys: list[bytes] = field(default_factory=list)
    num_registered_pages: int = 0
    num_computing_end: int = 0  # pages [num_registered_pages, this) are marked as computing
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache at admission
    state_slot: int = -1  # its slot in a hybrid model's state cache while it holds pages
    num_reported: int = 0  # output tokens already reported (RequestOutputKind.DELTA)
    detokenizer: object | None = None  # its IncrementalDetokenizer, for per-step text
    grammar: object | None = None  # a GrammarMatcher (structured_outputs), at its read tokens
    label_token_ids: tuple[int, ...] | None = None  # raw logprobs wanted at the first output
    label_logprobs: dict[int, float] | None = None  # ... and there they are
    adapter_wait_since: int | None = None  # schedule() call since which its adapter found no slot
    # When it arrived, first ran, got its first and its latest token (time.time()).
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_read_output_tokens(self) -> int:
        """Output tokens read to the host (a step launched ahead leaves -1 at the end)."""
        ids, prompt = self.token_ids, len(self.prompt_token_ids)
        n = len(ids)
        while n > prompt and ids[n - 1] < 0:
            n -= 1
        return n - prompt

    @property
    def num_pending(self) -> int:
        """Tokens still to run through the model before the next one can be sampled."""
        return len(self.token_ids) - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int, logprobs: dict[int, float] | None,
                     ranks: tuple[int, ...] | None = None) -> None:
        self.token_ids.append(token_id)
        if logprobs is not None:
            if ranks is None or len(ranks) != len(logprobs):
                raise ValueError("logprobs need one rank per entry")
            self.logprobs.append(logprobs)
            self.logprob_ranks.append(ranks)

    def reset_for_recompute(self) -> None:
        """Preempted: the pages are gone, so every token is computed again later."""
        self.num_computed = 0
        self.block_table = []
        self.group_tables = []
        self.released = []
        self.num_registered_pages = 0
        self.status = SequenceStatus.WAITING
        self.num_preemptions += 1

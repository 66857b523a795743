"""Continuous batching: which sequences run in the next step, and how many tokens each.

Policy (one step, a token budget of ``max_num_batched_tokens``):

1. Running sequences first, oldest first. Each gets its pending tokens (1 for a decode, the
   rest of its prompt for a prefill that was cut into chunks), as far as the budget goes. When
   its pages cannot grow, the newest running sequence is preempted by recompute: its pages are
   freed and it goes back to the front of the waiting queue (it may be the sequence itself).
2. Then, unless something was preempted this step, waiting sequences in arrival order, while
   fewer than ``max_num_seqs`` run and budget is left. With chunked prefill a prompt longer
   than the remaining budget runs its first part now and the rest in later steps; without it,
   a prompt waits for a step with room for all of it. A sequence whose adapter would make the
   step use more than ``max_loras`` adapters waits and the next one is considered, so the
   waiting requests of the adapters already running join them (locality); one that cannot
   get pages stops admission (so a long prompt is not starved by short ones). A request kept
   waiting for an adapter slot for ``max_adapter_wait`` schedules is overdue: from then on
   nothing behind it may take an adapter other than its own, nor join a running adapter
   unless it is bound to finish no later than that adapter's running requests (its
   remaining tokens, up to ``max_len``, are not more than theirs), so the running adapters
   drain and the next free slot is its own. No request waits for a slot longer than that
   plus the longest running request, and requests that arrive together with their adapter
   still run together (a wave of equal-length requests is not cut short). With
   prefix caching a sequence first takes the cached pages of its prefix (``BlockManager``)
   and is given only the tokens after them; one whose next page a running sequence is
   computing waits (keeping its place) until that page is cached; a request for prompt
   logprobs computes every position, so it takes none.
0. Before both, where the model's rotary rows depend on a sequence's length (LongRoPE,
   ``position_offset``), a running sequence that grew into other rows is recomputed from
   the start with them, ahead of the queue; a waiting one takes its rows when admitted.

A sequence is sampled in a step when the step computes its last pending token. Nothing here
touches tensors or global state: an engine owns one scheduler and drives it step by step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from detlora.engine.sched.block_manager import BlockManager
from detlora.engine.sched.sequence import FinishReason, Sequence, SequenceStatus

# Schedules a request may wait for an adapter slot before the running adapters are drained
# for it (about two waves of 32-token requests).
MAX_ADAPTER_WAIT = 64


class ScheduledSequence(NamedTuple):
    """One sequence's part of a step (a NamedTuple: one per running sequence every step,
    cheaper to build than a frozen dataclass)."""

    seq: Sequence
    num_tokens: int  # tokens computed this step: [seq.num_computed, + num_tokens)
    samples: bool  # this step computes the last pending token, so it samples the next one


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: tuple[ScheduledSequence, ...]
    preempted: tuple[Sequence, ...]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_decode_only(self) -> bool:
        """Every sequence computes one token and samples: the CUDA-graph path."""
        return bool(self.scheduled) and all(s.num_tokens == 1 and s.samples for s in self.scheduled)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool,
        max_loras: int | None = None,
        max_adapter_wait: int = MAX_ADAPTER_WAIT,
        position_offset: Callable[[int], int] | None = None,
    ) -> None:
        """``position_offset``: the model's, where a sequence's rotary rows depend on its
        length (LongRoPE); None where they never do."""
        self.blocks = block_manager
        self.position_offset = position_offset
        self.num_offset_recomputes = 0  # sequences recomputed as they grew past an offset
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.max_loras = max_loras
        if isinstance(max_adapter_wait, bool) or not isinstance(max_adapter_wait, int) \
                or max_adapter_wait < 0:
            raise ValueError(f"max_adapter_wait must be an int >= 0, got {max_adapter_wait!r}")
        self.max_adapter_wait = max_adapter_wait
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._waiting_loras: dict[object, int] = {}  # adapter -> waiting sequences (> 0)
        self.num_preemptions = 0
        self.num_schedules = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self._count_waiting(seq, 1)

    def _count_waiting(self, seq: Sequence, delta: int) -> None:
        if seq.lora is not None:
            count = self._waiting_loras.get(seq.lora, 0) + delta
            if count:
                self._waiting_loras[seq.lora] = count
            else:
                del self._waiting_loras[seq.lora]

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def upcoming_adapters(self, limit: int) -> list[object]:
        """The first ``limit`` distinct adapters of waiting sequences, in queue order, that no
        running sequence uses: the ones the next admissions will ask for."""
        seen = set()
        last: object = seen  # no sequence's adapter
        for s in self.running:  # runs of one adapter object add it once
            if s.lora is not last:
                last = s.lora
                seen.add(last)
        if all(lora in seen for lora in self._waiting_loras):
            return []  # every waiting request's adapter runs: no queue to walk
        out: list[object] = []
        for seq in self.waiting:
            if len(out) >= limit:
                break
            if seq.lora is not None and seq.lora not in seen:
                seen.add(seq.lora)
                out.append(seq.lora)
        return out

    def schedule(self, ending: set[int] | frozenset[int] = frozenset()) -> SchedulerOutput:
        """The next step. ``ending``: ids (``id(seq)``) of running sequences that end when
        the step in flight is read (they reach their length in it): left out of this one,
        and their places count as free for admissions (the engine launches this step before
        reading the one in flight)."""
        self.num_schedules += 1
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        preempted: list[Sequence] = []
        if self.position_offset is not None:
            self._recompute_grown()

        running, blocks = self.running, self.blocks
        block_size = blocks.block_size
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            if ending and id(seq) in ending:
                i += 1
                continue
            pending = len(seq.token_ids) - seq.num_computed
            n = min(pending, budget)
            end = seq.num_computed + n
            # Most steps find the sequence's last page with room: no page to take.
            if -(-end // block_size) > len(seq.block_table):
                while not blocks.can_allocate(seq, end):
                    victim = running.pop()
                    self._preempt(victim)
                    preempted.append(victim)
                    if victim is seq:
                        break
                if seq.status is not SequenceStatus.RUNNING:
                    break  # it preempted itself: nothing after it is left either
                blocks.allocate(seq, end)
            scheduled.append(ScheduledSequence(seq, n, n == pending))
            budget -= n
            i += 1

        if not preempted and self.waiting:
            budget = self._admit(budget, scheduled, len(ending))
        return SchedulerOutput(tuple(scheduled), tuple(preempted))

    def _admit(self, budget: int, scheduled: list[ScheduledSequence], num_ending: int = 0) -> int:
        # Per running adapter, the most tokens any of its sequences may still produce: when
        # its slot frees at the latest. (Runs of one adapter object are folded before the
        # dict sees them: a wave of one adapter's requests hashes it once.)
        drains: dict[object, int] = {}
        last: object = None
        most = 0
        for s in self.running:
            lora = s.lora
            if lora is None:
                continue
            left = s.max_len - len(s.token_ids)  # _tokens_left(s)
            if lora is last:
                if left > most:
                    most = left
                continue
            if last is not None:
                drains[last] = max(drains.get(last, 0), most)
            last, most = lora, left
        if last is not None:
            drains[last] = max(drains.get(last, 0), most)
        adapters = set(drains)
        skipped: list[Sequence] = []
        overdue: Sequence | None = None  # the first request kept from a slot too long
        limit = self.max_num_seqs + num_ending
        waiting, running, blocks = self.waiting, self.running, self.blocks
        caching, block_size = blocks.enable_caching, blocks.block_size
        waiting_loras = self._waiting_loras
        while waiting and budget > 0 and len(running) < limit:
            seq = waiting[0]
            if self.position_offset is not None:
                _set_offset(seq, self.position_offset(len(seq.token_ids)))
            if self.max_loras is not None and seq.lora is not None:
                if (overdue is not None and seq.lora != overdue.lora
                        and _tokens_left(seq) > drains.get(seq.lora, -1)):
                    # The slot the overdue request waits for is not ours, and joining a
                    # running adapter would keep its slot longer.
                    skipped.append(waiting.popleft())
                    continue
                if len(adapters) >= self.max_loras and seq.lora not in adapters:
                    if seq.adapter_wait_since is None:
                        seq.adapter_wait_since = self.num_schedules
                    if overdue is None and \
                            self.num_schedules - seq.adapter_wait_since >= self.max_adapter_wait:
                        overdue = seq
                    skipped.append(waiting.popleft())
                    continue
            lookup = caching and seq.params.prompt_logprobs is None
            cached = blocks.cached_prefix(seq) if lookup else []
            if lookup and blocks.next_page_computing(seq, cached):
                # A running sequence is computing the next page: take it from the cache once
                # it is registered instead of computing it twice.
                skipped.append(waiting.popleft())
                continue
            length = len(seq.token_ids)
            start = len(cached) * block_size
            n = length - start
            if n > budget:
                if not self.enable_chunked_prefill:
                    break
                n = budget
            if not blocks.can_admit(seq, cached, start + n):
                break
            waiting.popleft()
            lora = seq.lora
            if lora is not None:  # _count_waiting(seq, -1)
                count = waiting_loras.get(lora, 0) - 1
                if count:
                    waiting_loras[lora] = count
                else:
                    del waiting_loras[lora]
            seq.adapter_wait_since = None
            if lookup:
                blocks.share(seq, cached)
                if seq.num_cached_tokens is None:
                    seq.num_cached_tokens = seq.num_computed
            blocks.allocate(seq, seq.num_computed + n)
            blocks.mark_computing(seq)
            seq.status = SequenceStatus.RUNNING
            running.append(seq)
            if lora is not None:
                adapters.add(lora)
                left = seq.max_len - length  # _tokens_left(seq)
                if left > drains.get(lora, 0):
                    drains[lora] = left
                elif lora not in drains:
                    drains[lora] = 0
            scheduled.append(ScheduledSequence(seq, n, n == length - seq.num_computed))
            budget -= n
        # Skipped sequences keep their place ahead of everything that arrived after them.
        if skipped:
            waiting.extendleft(reversed(skipped))
        return budget

    def _recompute_grown(self) -> None:
        """Running sequences whose length now reads other rotary rows (LongRoPE past its
        original context) give up their pages and are computed again from the start with
        them, ahead of the queue: what transformers' generate does (ops/longrope.py). The
        engine does not run a step ahead of such a sequence, so its tokens are all read."""
        offset = self.position_offset
        assert offset is not None
        grown = [s for s in self.running if offset(len(s.token_ids)) != s.position_offset]
        for seq in reversed(grown):  # appendleft: keep their order
            self.running.remove(seq)
            self.blocks.free(seq)
            seq.reset_for_recompute()
            self.waiting.appendleft(seq)
            self._count_waiting(seq, 1)
            self.num_offset_recomputes += 1

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.free(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        self._count_waiting(seq, 1)
        self.num_preemptions += 1

    def abort_all(self) -> None:
        for seq in self.running:
            self.blocks.free(seq, register=False)
            seq.status = SequenceStatus.FINISHED
        for seq in self.waiting:
            seq.status = SequenceStatus.FINISHED
        self.running.clear()
        self.waiting.clear()
        self._waiting_loras.clear()

    def abort(self, seq: Sequence) -> None:
        """Drop an unfinished ``seq``, waiting or running; its computed pages stay cached."""
        if seq in self.waiting:
            self.waiting.remove(seq)
            self._count_waiting(seq, -1)
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = FinishReason.ABORT
        elif seq.status is SequenceStatus.RUNNING:
            self.finish(seq, FinishReason.ABORT)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """``seq`` is done: release its pages and drop it from the running list."""
        self.blocks.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.running.remove(seq)


def _set_offset(seq: Sequence, offset: int) -> None:
    """A waiting sequence's position offset at admission; its page keys follow it."""
    if offset != seq.position_offset:
        seq.position_offset = offset
        seq.page_keys.clear()


def _tokens_left(seq: Sequence) -> int:
    """Tokens ``seq`` may still add before it must finish (max_tokens or max_model_len)."""
    return seq.max_len - len(seq.token_ids)

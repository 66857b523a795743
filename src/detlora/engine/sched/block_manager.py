"""Paged KV cache bookkeeping: which pages (blocks) each sequence owns, and the prefix cache.

Pages are handed out from a FIFO free list, so the page numbers a run uses depend only on the
order of allocations and frees (attention reads pages through the block table, so page numbers
never change bits; the order just keeps runs easy to compare). A sequence frees its pages
last page first, so with prefix caching the pages of a shared prefix are the last evicted.

Prefix caching (``enable_caching``): every full page whose K/V are computed is registered
under its content key (``block_hashes``). A new sequence whose leading pages match registered
ones shares them (their reference count rises) and starts computing after them; at least its
last token is always computed, so its step has a row to sample from. A page nobody references
keeps its key while it waits in the free list, and loses it only when it is handed out again:
the least recently freed cached page is evicted first. Shared pages are full, so nobody writes
to them again.

State slots (hybrid models): with ``num_state_slots`` every sequence that holds pages also
holds one slot of the Mamba layers' state cache (``Sequence.state_slot``), taken with its
first page and given back with its pages, from a FIFO free list like the pages. A running
sequence always holds pages, and at most ``max_num_seqs`` run, so that many slots never run
out. A slot's number never changes bits: a sequence starting at position 0 reads nothing
from it.

Pages being computed: from its admission until each page is registered, a running sequence
marks the keys of its known full pages (``mark_computing``). A waiting sequence whose next
uncached page is one of them is better off waiting for it than computing it a second time
(``next_page_computing``): n completions of one prompt, or a burst of requests with one system
prompt, then compute the shared pages once.
"""

from __future__ import annotations

from collections import OrderedDict

from detlora.engine.sched.block_hashes import extend_page_keys
from detlora.engine.sched.sequence import Sequence


class OutOfBlocksError(RuntimeError):
    """Raised when an allocation needs more free pages than there are."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_caching: bool = False,
                 num_state_slots: int = 0) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        # A FIFO queue that also drops a revived page in O(1). Not a plain dict: taking its
        # first key skips every key deleted before it, quadratic over a run.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._ref_count = [0] * num_blocks
        self._cached: dict[bytes, int] = {}  # content key -> page
        self._key_of: dict[int, bytes] = {}  # page -> its content key, for registered pages
        self._computing: dict[bytes, int] = {}  # key -> running sequences computing that page
        self._free_states: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_state_slots))
        self.num_state_slots = num_state_slots
        self.num_queried_tokens = 0  # tokens of admitted sequences looked up in the cache
        self.num_hit_tokens = 0  # of which found

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Pages needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New pages ``seq`` needs so that its first ``num_tokens`` tokens have slots."""
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= len(self._free)

    def fits(self, needs: list[tuple[Sequence, int]]) -> bool:
        """Whether every (sequence, tokens) of ``needs`` can get its pages at once."""
        return sum(self.blocks_needed(seq, n) for seq, n in needs) <= len(self._free)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow ``seq.block_table`` to cover ``num_tokens`` tokens (all or nothing)."""
        need = -(-num_tokens // self.block_size) - len(seq.block_table)  # blocks_needed
        if need <= 0 and (not self.num_state_slots or seq.state_slot >= 0):
            return
        if need > len(self._free):
            raise OutOfBlocksError(
                f"sequence {seq.request_id} needs {need} more KV blocks, "
                f"only {len(self._free)} of {self.num_blocks} are free"
            )
        if self.num_state_slots and seq.state_slot < 0:
            self._take_state_slot(seq)
        for _ in range(need):
            block, _ = self._free.popitem(last=False)
            key = self._key_of.pop(block, None)
            if key is not None:  # evict: the page's old K/V are about to be overwritten
                del self._cached[key]
            self._ref_count[block] = 1
            seq.block_table.append(block)

    def free(self, seq: Sequence, *, register: bool = True) -> None:
        """Drop ``seq``'s references, last page first; pages nobody references go back to the
        free list (a registered page keeps its key there until it is handed out again).
        ``register=False`` (an aborted run) adds no page to the cache."""
        if register:
            self.register(seq)
        self._unmark(seq, seq.num_computing_end)
        for block in reversed(seq.block_table):
            count = self._ref_count[block]
            if count < 1:
                raise RuntimeError(f"KV block {block} freed more often than it was allocated")
            self._ref_count[block] = count - 1
            if count == 1:
                self._free[block] = None
        seq.block_table = []
        seq.num_registered_pages = 0
        if seq.state_slot >= 0:
            self._free_states[seq.state_slot] = None
            seq.state_slot = -1

    def _take_state_slot(self, seq: Sequence) -> None:
        if not self._free_states:
            raise RuntimeError(f"all {self.num_state_slots} state slots are taken: more "
                               "sequences hold pages than max_num_seqs")
        seq.state_slot, _ = self._free_states.popitem(last=False)

    # ---- prefix cache ----

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """Pages holding the longest cached run of ``seq``'s leading full pages, short enough
        that its last token is still computed; [] without caching."""
        if not self.enable_caching:
            return []
        keys = extend_page_keys(seq.page_keys, seq.token_ids, self.block_size, seq.lora,
                                seq.position_offset)
        pages: list[int] = []
        for key in keys[: (len(seq.token_ids) - 1) // self.block_size]:
            page = self._cached.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def can_admit(self, seq: Sequence, cached: list[int], num_tokens: int) -> bool:
        """Whether ``seq`` (no pages yet) can share ``cached`` and get pages for its first
        ``num_tokens`` tokens; a shared page that sits in the free list counts against it."""
        ref = self._ref_count
        revived = sum(1 for page in cached if ref[page] == 0) if cached else 0
        need = max(0, -(-num_tokens // self.block_size) - len(cached))
        return need + revived <= len(self._free)

    def share(self, seq: Sequence, cached: list[int]) -> None:
        """Give ``seq`` (no pages yet) the pages ``cached``: its first tokens are computed."""
        assert not seq.block_table, "share() is for a sequence without pages"
        for page in cached:
            if self._ref_count[page] == 0:
                del self._free[page]
            self._ref_count[page] += 1
        seq.block_table = list(cached)
        if self.num_state_slots and seq.state_slot < 0:
            self._take_state_slot(seq)
        seq.num_registered_pages = len(cached)
        seq.num_computed = len(cached) * self.block_size
        self.num_queried_tokens += len(seq.token_ids)
        self.num_hit_tokens += seq.num_computed

    def register(self, seq: Sequence) -> None:
        """Register ``seq``'s full pages whose K/V are computed and whose tokens are known.
        A key already cached keeps its page (two sequences computed the same page at once)."""
        full = min(seq.num_computed, len(seq.token_ids)) // self.block_size
        if not self.enable_caching or full <= seq.num_registered_pages:
            return
        keys = extend_page_keys(seq.page_keys, seq.token_ids, self.block_size, seq.lora,
                                seq.position_offset)
        end = min(full, len(keys), len(seq.block_table))
        for i in range(seq.num_registered_pages, end):
            page, key = seq.block_table[i], keys[i]
            if key not in self._cached and page not in self._key_of:
                self._cached[key] = page
                self._key_of[page] = key
        self._unmark(seq, end)
        seq.num_registered_pages = max(seq.num_registered_pages, end)

    def mark_computing(self, seq: Sequence) -> None:
        """``seq`` was just admitted: the keys of its known full pages past the registered
        ones are being computed, until ``register`` (or ``free``) clears them."""
        if not self.enable_caching:
            return
        keys = extend_page_keys(seq.page_keys, seq.token_ids, self.block_size, seq.lora,
                                seq.position_offset)
        for key in keys[seq.num_registered_pages:]:
            self._computing[key] = self._computing.get(key, 0) + 1
        seq.num_computing_end = len(keys)

    def next_page_computing(self, seq: Sequence, cached: list[int]) -> bool:
        """Whether the page ``seq`` would compute first after ``cached`` is one that a running
        sequence is computing now (and ``seq`` could share it once it is registered)."""
        i = len(cached)
        if not self._computing or i >= (len(seq.token_ids) - 1) // self.block_size:
            return False
        keys = extend_page_keys(seq.page_keys, seq.token_ids, self.block_size, seq.lora,
                                seq.position_offset)
        return i < len(keys) and keys[i] in self._computing

    def _unmark(self, seq: Sequence, end: int) -> None:
        """Clear ``seq``'s computing marks on its pages before ``end`` (registered or freed)."""
        for key in seq.page_keys[seq.num_registered_pages:min(end, seq.num_computing_end)]:
            count = self._computing[key] - 1
            if count:
                self._computing[key] = count
            else:
                del self._computing[key]
        if end >= seq.num_computing_end:
            seq.num_computing_end = 0

    @property
    def num_cached_pages(self) -> int:
        return len(self._cached)

    def reset_cache(self) -> None:
        """Forget every registered page (pages in use stay with their sequences)."""
        self._cached.clear()
        self._key_of.clear()

    def ref_count(self, block: int) -> int:
        return self._ref_count[block]

    def slot(self, seq: Sequence, position: int) -> int:
        """Flat cache slot (page * block_size + offset) of ``seq``'s token at ``position``."""
        return seq.block_table[position // self.block_size] * self.block_size + (
            position % self.block_size
        )

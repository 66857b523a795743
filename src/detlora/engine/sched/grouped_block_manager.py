"""KV pages of a model whose layers keep them in several groups (models/layer_spec.py):
full-attention layers keep every page of a sequence, sliding-window layers only the pages
their window touches; layers that read another layer's K/V keep none.

``GroupedBlockManager`` has ``BlockManager``'s interface (the scheduler and the engine drive
it alike) over one ``PagePool`` per group. A sequence holds one block table per group, all of
one length (entry i holds positions [i * block_size, (i + 1) * block_size)): group 0's is
``seq.block_table``, group g's ``seq.group_tables[g - 1]``. In a windowed group (window W) a
page is released as soon as no query to come can see it, i.e. once it lies wholly before
``num_computed - W + 1``: its entry becomes -1 (the attention kernels start every query's
visit at its window and never read it), and its reference goes back to the pool, where it
keeps its content key like any freed page. The pages a step computes are all allocated,
those behind the window too, since the step's own earlier queries read them; so a window
group holds about ``W / block_size + 2`` pages per sequence plus the step's new tokens.

Prefix caching: a page's key (sha256 over the adapter and every token up to its end) names
its K/V in every group, since a layer's K/V at a position depend on the whole prefix. A hit
of P pages needs, in every full group, pages 0..P-1, and in a window group only the pages
from the one holding ``P * block_size - W + 1`` on (the window of the first computed
token): entries before that are -1, never allocated. The longest P for which every group has
its pages cached is taken. So a cached prefix gives the bits a recompute gives: the kernels
read the same K/V at the same positions. (A window group's pages are evicted from its
smaller pool sooner, which only shortens hits.)
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from detlora.engine.sched.block_hashes import extend_page_keys
from detlora.engine.sched.block_manager import OutOfBlocksError
from detlora.engine.sched.page_pool import PagePool
from detlora.engine.sched.sequence import Sequence


class CachedPrefix(list):
    """``cached_prefix``'s answer: group 0's pages (its length is the hit in pages), with
    ``groups`` holding every group's, -1 where a window group needs no page."""

    groups: list[list[int]]


class GroupedBlockManager:
    def __init__(self, group_blocks: Seq[int], windows: Seq[int | None], block_size: int, *,
                 enable_caching: bool = False) -> None:
        if len(group_blocks) != len(windows) or not group_blocks:
            raise ValueError(f"one page count per group and window, got {list(group_blocks)} "
                             f"and {list(windows)}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if any(w is not None and w < 1 for w in windows):
            raise ValueError(f"windows must be >= 1 or None, got {list(windows)}")
        self.pools = [PagePool(n) for n in group_blocks]
        self.windows = tuple(windows)
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.num_blocks = group_blocks[0]
        self._computing: dict[bytes, int] = {}  # key -> running sequences computing that page
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    # ---- tables ----

    def table(self, seq: Sequence, group: int) -> list[int]:
        if group == 0:
            return seq.block_table
        while len(seq.group_tables) < len(self.pools) - 1:
            seq.group_tables.append([])
        return seq.group_tables[group - 1]

    def _released(self, seq: Sequence) -> list[int]:
        """Per group, how many leading entries of its table are -1 (released or never
        allocated)."""
        while len(seq.released) < len(self.pools):
            seq.released.append(0)
        return seq.released

    # ---- BlockManager's interface ----

    @property
    def num_free(self) -> int:
        """Free pages of group 0."""
        return self.pools[0].num_free

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New pages of group 0 (each group needs as many) for ``num_tokens`` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        need = self.blocks_needed(seq, num_tokens)
        return all(need <= pool.num_free for pool in self.pools)

    def fits(self, needs: Seq[tuple[Sequence, int]]) -> bool:
        """Whether every (sequence, tokens) of ``needs`` can get its pages at once."""
        need = sum(self.blocks_needed(seq, n) for seq, n in needs)
        return all(need <= pool.num_free for pool in self.pools)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow every table of ``seq`` to cover ``num_tokens`` tokens (all or nothing)."""
        need = self.blocks_needed(seq, num_tokens)
        for g, pool in enumerate(self.pools):
            if need > pool.num_free:
                raise OutOfBlocksError(
                    f"sequence {seq.request_id} needs {need} more KV blocks in group {g}, "
                    f"only {pool.num_free} of {pool.num_blocks} are free")
        for g, pool in enumerate(self.pools):
            table = self.table(seq, g)
            for _ in range(need):
                table.append(pool.take())

    def free(self, seq: Sequence, *, register: bool = True) -> None:
        """Drop ``seq``'s references in every group, last page first."""
        if register:
            self.register(seq)
        self._unmark(seq, seq.num_computing_end)
        for g, pool in enumerate(self.pools):
            for block in reversed(self.table(seq, g)):
                if block >= 0:
                    pool.release(block)
        seq.block_table = []
        seq.group_tables = []
        seq.released = []
        seq.num_registered_pages = 0

    def release_behind_windows(self, seq: Sequence) -> None:
        """Release the pages of ``seq``'s window groups that no query to come can see:
        those wholly before ``num_computed - window + 1``."""
        released = None
        for g, (pool, window) in enumerate(zip(self.pools, self.windows, strict=True)):
            if window is None:
                continue
            released = released or self._released(seq)
            table = self.table(seq, g)
            end = min(max(0, seq.num_computed - window + 1) // self.block_size, len(table))
            for i in range(released[g], end):
                if table[i] >= 0:
                    pool.release(table[i])
                    table[i] = -1
            released[g] = max(released[g], end)

    # ---- prefix cache ----

    def cached_prefix(self, seq: Sequence) -> CachedPrefix:
        """Per group, the cached pages of ``seq``'s longest prefix that every group holds
        (module docstring), short enough that its last token is still computed."""
        out = CachedPrefix()
        out.groups = [[] for _ in self.pools]
        if not self.enable_caching:
            return out
        keys = extend_page_keys(seq.page_keys, seq.token_ids, self.block_size, seq.lora,
                                seq.position_offset)
        limit = min(len(keys), (len(seq.token_ids) - 1) // self.block_size)
        found = [[pool.lookup(k) for k in keys[:limit]] for pool in self.pools]
        for g, window in enumerate(self.windows):
            if window is None:  # a full group needs every page before the hit
                limit = min(limit, next((i for i, p in enumerate(found[g]) if p is None),
                                        limit))
        hit = 0
        for p in range(limit, 0, -1):
            if all(all(found[g][i] is not None for i in range(self._first_needed(p, w), p))
                   for g, w in enumerate(self.windows) if w is not None):
                hit = p
                break
        for g, window in enumerate(self.windows):
            first = self._first_needed(hit, window)
            out.groups[g] = [-1] * first + [int(found[g][i]) for i in range(first, hit)]
        out.extend(out.groups[0])
        return out

    def _first_needed(self, pages: int, window: int | None) -> int:
        """The first page a computation starting at page ``pages`` reads in a group."""
        if window is None:
            return 0
        return min(pages, max(0, pages * self.block_size - window + 1) // self.block_size)

    def can_admit(self, seq: Sequence, cached: list[int], num_tokens: int) -> bool:
        groups = getattr(cached, "groups", None) or [list(cached)] + [[]] * (len(self.pools) - 1)
        for pool, pages in zip(self.pools, groups, strict=True):
            revived = sum(1 for page in pages if page >= 0 and pool.ref_count(page) == 0)
            need = max(0, self.blocks_for(num_tokens) - len(pages))
            if need + revived > pool.num_free:
                return False
        return True

    def share(self, seq: Sequence, cached: list[int]) -> None:
        """Give ``seq`` (no pages yet) the cached pages of every group."""
        assert not seq.block_table, "share() is for a sequence without pages"
        groups = getattr(cached, "groups", None) or [list(cached)] + [[]] * (len(self.pools) - 1)
        released = self._released(seq)
        for g, (pool, pages) in enumerate(zip(self.pools, groups, strict=True)):
            for page in pages:
                if page >= 0:
                    pool.hold(page)
            table = self.table(seq, g)
            table[:] = pages
            released[g] = next((i for i, p in enumerate(pages) if p >= 0), len(pages))
        seq.num_registered_pages = len(cached)
        seq.num_computed = len(cached) * self.block_size
        self.num_queried_tokens += len(seq.token_ids)
        self.num_hit_tokens += seq.num_computed

    def register(self, seq: Sequence) -> None:
        """Register ``seq``'s computed full pages in every group that holds them, then
        release what its windows left behind."""
        full = min(seq.num_computed, len(seq.token_ids)) // self.block_size
        if self.enable_caching and full > seq.num_registered_pages:
            keys = extend_page_keys(seq.page_keys, seq.token_ids, self.block_size, seq.lora,
                                    seq.position_offset)
            end = min(full, len(keys), len(seq.block_table))
            for g, pool in enumerate(self.pools):
                table = self.table(seq, g)
                for i in range(seq.num_registered_pages, min(end, len(table))):
                    if table[i] >= 0:
                        pool.register(table[i], keys[i])
            self._unmark(seq, end)
            seq.num_registered_pages = max(seq.num_registered_pages, end)
        self.release_behind_windows(seq)

    def mark_computing(self, seq: Sequence) -> None:
        if not self.enable_caching:
            return
        keys = extend_page_keys(seq.page_keys, seq.token_ids, self.block_size, seq.lora,
                                seq.position_offset)
        for key in keys[seq.num_registered_pages:]:
            self._computing[key] = self._computing.get(key, 0) + 1
        seq.num_computing_end = len(keys)

    def next_page_computing(self, seq: Sequence, cached: list[int]) -> bool:
        i = len(cached)
        if not self._computing or i >= (len(seq.token_ids) - 1) // self.block_size:
            return False
        keys = extend_page_keys(seq.page_keys, seq.token_ids, self.block_size, seq.lora,
                                seq.position_offset)
        return i < len(keys) and keys[i] in self._computing

    def _unmark(self, seq: Sequence, end: int) -> None:
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
        return self.pools[0].num_cached

    def reset_cache(self) -> None:
        for pool in self.pools:
            pool.reset_cache()

    def ref_count(self, block: int, group: int = 0) -> int:
        return self.pools[group].ref_count(block)

    def slot(self, seq: Sequence, position: int, group: int = 0) -> int:
        table = self.table(seq, group)
        return table[position // self.block_size] * self.block_size + (
            position % self.block_size)

    def num_free_of(self, group: int) -> int:
        return self.pools[group].num_free

"""How many KV pages an engine gets when ``num_kv_blocks`` is not given.

CUDA: run the largest step the scheduler can build (``max_num_batched_tokens`` prompt tokens,
every sequence sampling) on a throw-away cache, note the peak memory, and give the pages
``gpu_memory_utilization`` of the device minus that peak. When nothing is left, the error
names who holds the memory (``no_room_message``). CPU: room for ``max_num_seqs`` full
sequences, capped at ``CPU_KV_BYTES``.

A model whose layers keep their pages in several groups (models/layer_spec.py) gets, in each
sliding-window group, the pages its sequences can hold at once (``window_pages``: every
running sequence's window plus a step's new tokens, so a window group never runs out), and
the rest of the room in group 0 (the full-attention layers'); the sizes above count group 0.
Layers that read another layer's K/V count nothing.
Hybrid models also hold a state cache of ``max_num_seqs + 1`` slots
(``models/state_cache.py``), allocated by the runner, so the profiled peak counts it; before
profiling, ``state_room`` refuses a ``max_num_seqs`` whose states alone do not fit, naming
the largest that does. Both budgets are the allowance less this process's live tensors and
the memory outside PyTorch, measured once the caching allocator has emptied its cache
(``memory_use``): blocks it keeps from freed tensors (an earlier test's, say) count for
neither, while an earlier engine still alive counts for both.
"""

from __future__ import annotations

import torch

from detlora.engine.runner.step_inputs import StepInputs
from detlora.log import get_logger

logger = get_logger(__name__)

CPU_KV_BYTES = 256 * 2**20


def block_bytes(model: torch.nn.Module, block_size: int) -> int:
    """Bytes of one KV page of group 0 on this rank (its KV heads only, under tensor
    parallelism; every layer's for a one-group model)."""
    pages = getattr(model, "kv_page_bytes", None)
    if pages is None:
        return block_size * model.kv_cache_bytes_per_token()
    return pages(block_size)[0]


def window_pages(window: int, *, block_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int) -> int:
    """Pages a sliding-window group needs at most: each of ``max_num_seqs`` sequences keeps
    the pages touching its last ``window - 1`` tokens (two more for where they sit on
    pages), and a step adds its ``max_num_batched_tokens`` tokens
    (engine/sched/grouped_block_manager.py)."""
    return max_num_seqs * (-(-(window - 1) // block_size) + 2) \
        + -(-max_num_batched_tokens // block_size)


def group_blocks(model: torch.nn.Module, num_blocks: int, *, block_size: int,
                 max_num_seqs: int, max_num_batched_tokens: int) -> int | tuple[int, ...]:
    """Pages per KV group: ``num_blocks`` for group 0 and ``window_pages`` for every window
    group after it; the plain ``num_blocks`` for a model with one full-attention group."""
    groups = getattr(model, "kv_groups", ())
    if len(groups) <= 1 and (not groups or groups[0].window is None):
        return num_blocks
    return tuple(num_blocks if g == 0 else window_pages(
        group.window, block_size=block_size, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens) for g, group in enumerate(groups))


def fixed_bytes(model: torch.nn.Module, *, block_size: int, max_num_seqs: int,
                max_num_batched_tokens: int) -> int:
    """Bytes of the pages of the groups after group 0 (their sizes do not depend on the
    room left)."""
    blocks = group_blocks(model, 1, block_size=block_size, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens)
    if isinstance(blocks, int):
        return 0
    pages = model.kv_page_bytes(block_size)
    return sum(n * b for n, b in zip(blocks[1:], pages[1:], strict=True))


def cpu_num_blocks(model: torch.nn.Module, *, block_size: int, max_num_seqs: int,
                   max_model_len: int, max_num_batched_tokens: int = 0) -> int:
    per_seq = -(-max_model_len // block_size)
    room = CPU_KV_BYTES - fixed_bytes(model, block_size=block_size, max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_num_batched_tokens)
    cap = max(per_seq, room // block_bytes(model, block_size))
    return min(max_num_seqs * per_seq, cap)


def profile_step(*, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                 block_size: int) -> StepInputs:
    """The largest prefill step: prompts of up to ``max_model_len - 1`` tokens, each sampling,
    laid on pages 0, 1, 2, ... of a throw-away cache."""
    lens: list[int] = []
    left = max_num_batched_tokens
    while left > 0 and len(lens) < max_num_seqs:
        n = min(left, max_model_len - 1)
        lens.append(n)
        left -= n
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    tables: list[list[int]] = []
    qsl = [0]
    page = 0
    for n in lens:
        pages = -(-n // block_size)
        table = list(range(page, page + pages))
        page += pages
        ids += [0] * n
        pos += list(range(n))
        slots += [table[p // block_size] * block_size + p % block_size for p in range(n)]
        tables.append(table)
        qsl.append(qsl[-1] + n)
    return StepInputs(ids, pos, slots, [-1] * len(ids), tables, lens, qsl,
                      [q - 1 for q in qsl[1:]], state_slots=list(range(len(lens))))


def size_text(n: int) -> str:
    """Bytes in the largest of GiB, MiB and KiB that keeps a unit or more (a tiny model's
    state is KiB, not "0.0 MiB")."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n / 2**10:.1f} KiB"


def state_room(model: torch.nn.Module, *, max_num_seqs: int, budget: int,
               holders: str = "") -> int:
    """Bytes of a hybrid model's state cache (0 for other models): a slot per sequence and
    one for the decode graphs' padding rows, logged; ValueError when they exceed ``budget``
    (bytes left under gpu_memory_utilization by this process's live tensors, the weights
    among them, and the memory outside PyTorch), naming the most sequences that fit, or,
    when not one does, ``holders`` (``no_room_message``: who has the memory)."""
    per_seq = getattr(model, "state_bytes_per_slot", lambda: 0)()
    if not per_seq:
        return 0
    total = per_seq * (max_num_seqs + 1)
    logger.info("state cache: %d slots (max_num_seqs + 1) x %s = %s of Mamba-2 state (conv "
                "state, fp32 SSM state, open-chunk rows), counted before the KV pages",
                max_num_seqs + 1, size_text(per_seq), size_text(total))
    if total <= budget:
        return total
    need = (f"max_num_seqs={max_num_seqs} needs {size_text(total)} of Mamba-2 state "
            f"({size_text(per_seq)} per sequence: conv state, fp32 SSM state and the open "
            f"chunk's rows of every Mamba layer) but gpu_memory_utilization leaves "
            f"{size_text(max(budget, 0))} after the weights")
    fit = max(budget, 0) // per_seq - 1
    if fit >= 1:
        raise ValueError(f"{need}: lower max_num_seqs to at most {fit} (fewer, to leave room "
                         "for KV pages and activations) or raise gpu_memory_utilization")
    raise ValueError(f"{need}, not one sequence's: "
                     + (holders or "raise gpu_memory_utilization or free GPU memory"))


def memory_use(device: torch.device) -> tuple[int, int, int]:
    """(free, total, other) bytes of the device once the caching allocator has given back
    what no live tensor uses (memory an earlier step or test freed); ``other``: what lies
    outside PyTorch's allocator (CUDA context, cuBLAS workspaces, other processes)."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return free, total, max(total - free - torch.cuda.memory_reserved(device), 0)


def cuda_num_blocks(runner_factory, model: torch.nn.Module, *, device: torch.device,
                    block_size: int, max_num_batched_tokens: int, max_num_seqs: int,
                    max_model_len: int, gpu_memory_utilization: float,
                    allocated_before: int = 0) -> int:
    """``runner_factory(num_blocks)`` builds an eager runner on a throw-away cache;
    ``allocated_before``: bytes this process had allocated before the engine loaded its
    model (named when they leave no room)."""
    step = profile_step(max_num_batched_tokens=max_num_batched_tokens,
                        max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                        block_size=block_size)
    scratch_blocks = max(max(row) for row in step.block_tables) + 1
    # The state cache is checked against what the KV pages get below: the allowance less
    # this process's live tensors and the memory outside PyTorch (not less the cached
    # blocks that no tensor holds).
    free, total, other = memory_use(device)
    live = torch.cuda.memory_allocated(device)
    state_room(model, max_num_seqs=max_num_seqs,
               budget=int(total * gpu_memory_utilization) - live - other,
               holders=no_room_message(
                   total=total, free=free, gpu_memory_utilization=gpu_memory_utilization,
                   allocated_before=allocated_before, other=other,
                   engine_peak=live - allocated_before, max_num_batched_tokens=None,
                   what="the Mamba-2 state"))
    torch.cuda.reset_peak_memory_stats(device)
    runner = runner_factory(scratch_blocks)
    runner.execute(step, decode_only=False)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del runner
    # The peak counts the throw-away state cache; the real runner's replaces it (not beside).
    getattr(model, "release_state_cache", lambda: None)()
    free, total, other = memory_use(device)
    # The peak keeps the throw-away state cache in, which the real one replaces.
    budget = int(total * gpu_memory_utilization) - peak - other
    budget -= fixed_bytes(model, block_size=block_size, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens)
    num = budget // block_bytes(model, block_size)
    if num < 1:
        raise ValueError(no_room_message(
            total=total, free=free, gpu_memory_utilization=gpu_memory_utilization,
            allocated_before=allocated_before, other=other,
            engine_peak=peak - allocated_before,
            max_num_batched_tokens=max_num_batched_tokens))
    return int(num)


def no_room_message(*, total: int, free: int, gpu_memory_utilization: float,
                    allocated_before: int, other: int, engine_peak: int,
                    max_num_batched_tokens: int | None, what: str = "the KV cache") -> str:
    """Why ``what`` found no room, the largest holder of the memory first: this process's
    earlier allocations (an engine not shut down), other processes, or this engine's model
    (and its profiling step of ``max_num_batched_tokens`` tokens, None before profiling).
    Byte counts in, one sentence out."""

    def gib(n: int) -> str:
        return f"{n / 2**30:.2f} GiB"

    if max_num_batched_tokens is None:
        own = (f"this engine's model takes {gib(engine_peak)} (weights, adapter slots, "
               "kernel workspaces)")
    else:
        own = (f"this engine's model and a profiling step of {max_num_batched_tokens} "
               f"tokens peak at {gib(engine_peak)} (lower max_num_batched_tokens, or raise "
               "gpu_memory_utilization)")
    holders = [
        (allocated_before, f"{gib(allocated_before)} were already allocated by this process "
         "before this engine was built (an earlier engine or tensors still alive: call "
         "shutdown() on an LLM you are done with, or drop every reference to it)"),
        (other, f"{gib(other)} are used outside PyTorch's allocator (other processes on this "
         "GPU, the CUDA context)"),
        (engine_peak, own),
    ]
    holders.sort(key=lambda h: -h[0])
    return (f"no GPU memory left for {what}: gpu_memory_utilization="
            f"{gpu_memory_utilization} allows {gib(int(total * gpu_memory_utilization))} of "
            f"{gib(total)}, and {gib(free)} are free now; "
            + "; ".join(text for _, text in holders))

"""Steps that compile the eager path's kernel variants before a server takes traffic.

A step larger than every step graph runs eagerly, and its kernels specialize on what the
graphs never meet: thousands of rows, and attention over prompts of equal length (each
sequence's query tiles numbered directly) or beside decode rows (the tiles searched, with
``search_block``'s two sizes). Each new variant would compile in the middle of serving, the
first time a burst of arrivals meets the running sequences (docs/decisions.md, "The engine
steps in a process of its own"). These synthetic steps meet each variant once at start-up
instead: their rows write no KV page (slot -1), read page 0, and their logits are thrown
away, so no state changes.
"""

from __future__ import annotations

from detlora.engine.runner.step_inputs import StepInputs


def eager_warmup_steps(
    *,
    graph_tokens: int,  # the largest step graph's token count (0: no step graphs)
    graph_seqs: int,  # the largest step graph's sequence count
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    block_size: int,
    num_adapters: int | None,
) -> list[StepInputs]:
    """Prefill-only and mixed steps too large for the step graphs, one per attention variant
    (see the module docstring); empty when every step the scheduler can form has a graph."""
    tokens = min(max_num_batched_tokens, 2 * max(graph_tokens, 1))
    length = min(max_model_len, tokens)
    steps: list[StepInputs] = []
    # Equal prompts (direct tile numbering), then prompts beside decode rows (searched
    # tiles) with each of the search's two block sizes.
    from detlora.ops.paged_attention import SEARCH_BLOCK_SMALL as small  # loads Triton

    for total in sorted({0, min(max_num_seqs, small), min(max_num_seqs, small + 1)}):
        prompts = min(-(-tokens // length), max_num_seqs)
        decodes = max(0, total - prompts)
        prompts = min(prompts, (max_num_batched_tokens - decodes) // length)
        if (total and decodes == 0) or prompts < 1:
            continue  # no decode rows fit beside the prompts
        if prompts * length + decodes <= graph_tokens and prompts + decodes <= graph_seqs:
            continue  # a step graph holds it
        steps.append(_step([length] * prompts + [1] * decodes, block_size, num_adapters))
    return steps


def _step(query_lens: list[int], block_size: int, num_adapters: int | None) -> StepInputs:
    ids, positions, adapters, tables, qsl, last = [], [], [], [], [0], []
    for i, q in enumerate(query_lens):  # each row's context is its own query (a decode: 1)
        ids += [i % 7 + 1] * q
        positions += list(range(q))
        # Rows with and without an adapter, as real steps mix them.
        adapters += [0 if num_adapters and i % 2 == 0 else -1] * q
        tables.append([0] * -(-q // block_size))
        qsl.append(qsl[-1] + q)
        last.append(qsl[-1] - 1)
    return StepInputs(input_ids=ids, positions=positions, slot_mapping=[-1] * len(ids),
                      token_adapter=adapters, block_tables=tables,
                      seq_lens=list(query_lens), query_start_loc=qsl, logits_indices=last)


__all__ = ["eager_warmup_steps"]

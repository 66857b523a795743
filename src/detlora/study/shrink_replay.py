"""Section 1, identical-input replay: the LoRA shrink of a model's shapes run N times on the
same inputs, every execution compared with the first (the paper's section 6.1).

Shapes: the q|k|v shrink (hidden -> 3 x rank) and the down-projection shrink (intermediate ->
rank) of the model under study, at the adapter's rank, for each row count M of the plan (M =
1 is a decode step, larger M a prefill). Every shrink reduction runs as its Triton kernel; the
``in_gemm`` row replays x [W; A]^T through cuBLAS (the run_to_run linear) and compares the A
columns. On a CPU the kernels run in Triton's interpreter, which executes CTAs one after
another: there even ``atomic`` repeats.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from detlora import LoRAReduction
from detlora.models.spec import ModelSpec
from detlora.ops._runtime import interpreting
from detlora.study.replay import replay

SHRINK_REDUCTIONS = tuple(r.value for r in LoRAReduction if r is not LoRAReduction.IN_GEMM)


def replay_available(device: torch.device) -> bool:
    return device.type == "cuda" or interpreting()


def shapes_of(spec: ModelSpec, rank: int) -> list[tuple[str, int, int, int]]:
    """(name, hidden, slices, out features of the base weight) of the replayed shrinks (the
    first layer's, where layers differ); a hybrid model's Mamba in_proj (hidden ->
    [z | xBC | dt]) too."""
    a = spec.attention(0)
    q, kv = spec.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    shapes = [("qkv", spec.hidden_size, 3, q + 2 * kv),
              ("down", spec.intermediate_size, 1, spec.hidden_size)]
    h = spec.hybrid
    if h is not None:
        shapes.append(("in_proj", spec.hidden_size, 1,
                       h.d_inner + h.conv_dim + h.mamba_num_heads))
    return shapes


def shrink_replay_rows(model: str, spec: ModelSpec, rank: int, rows: Sequence[int],
                       executions: int, device: torch.device, seed: int = 0,
                       tick: Callable[[], None] = lambda: None) -> list[dict]:
    from detlora.ops.adapter_groups import group_tokens
    from detlora.ops.lora_shrink import lora_shrink

    # The interpreter computes bf16 tl.dot wrongly, so the CPU replays fp16.
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    gen = torch.Generator(device=device).manual_seed(seed)
    out_rows = []
    for name, hidden, slices, n_base in shapes_of(spec, rank):
        for m in rows:
            x = torch.randn(m, hidden, generator=gen, device=device).to(dtype)
            a = (torch.randn(1, slices, rank, hidden, generator=gen, device=device)
                 / hidden ** 0.5).to(dtype)
            ids = torch.zeros(m, dtype=torch.int32, device=device)
            groups = group_tokens(ids, 1)
            scale = torch.full((1,), 2.0, device=device)
            ops: dict[str, Callable[[], torch.Tensor]] = {}
            for red in SHRINK_REDUCTIONS:
                buf = torch.empty(slices, m, rank, dtype=torch.float32, device=device)
                ops[red] = (lambda red=red, buf=buf, x=x, a=a, g=groups, s=scale:
                            lora_shrink(x, a, g, s, reduction=red, out=buf))
            w = (torch.randn(n_base, hidden, generator=gen, device=device)
                 / hidden ** 0.5).to(dtype)
            wa = torch.cat([w, a[0].reshape(slices * rank, hidden)])
            ops[LoRAReduction.IN_GEMM.value] = (
                lambda x=x, wa=wa, n=n_base: torch.nn.functional.linear(x, wa)[:, n:])
            for red, op in ops.items():
                stats = replay(op, executions)
                out_rows.append({
                    "model": model, "reduction": red, "shape": name, "M": m,
                    "phase": "decode" if m == 1 else "prefill",
                    "comparisons": stats.comparisons, "differing": stats.differing,
                    "differing_element_fraction": stats.differing_element_fraction,
                    "mean_abs_diff": stats.mean_abs_diff, "max_abs_diff": stats.max_abs_diff})
                tick()
    return out_rows


def replay_totals(rows: Sequence[dict]) -> dict[str, tuple[int, int]]:
    """reduction -> (differing, comparisons) over every shape and model."""
    out: dict[str, tuple[int, int]] = {}
    for r in rows:
        d, c = out.get(r["reduction"], (0, 0))
        out[r["reduction"]] = (d + r["differing"], c + r["comparisons"])
    return out

"""``detlora replay``: the paper's section 5.2 table on a built-in shape.

On a GPU the real kernels run; on a CPU the torch reference and the kernels in Triton's
interpreter run (the interpreter executes CTAs one after another, so atomic cannot vary there:
the CPU table shows correctness and repeatability, the GPU table shows the atomic variance).
"""

from __future__ import annotations

import sys
import time

import torch
from tqdm import tqdm

from detlora.ops.adapter_groups import group_tokens
from detlora.ops.lora_shrink import lora_shrink, lora_shrink_ref
from detlora.study.replay import replay

REDUCTIONS = ("atomic", "unsplit", "ordered", "ordered_bi", "tree")


def run_replay_table(
    on_gpu: bool, executions: int | None = None, hidden: int | None = None, rank: int = 16,
    slices: int = 3, adapters: int = 2, progress: bool | None = None,
) -> list[dict]:
    """Print the table (stdout) and return its rows. ``progress``: a bar over the replays on
    stderr; None shows it when stderr is a terminal."""
    device = torch.device("cuda" if on_gpu else "cpu")
    # Triton's interpreter computes bf16 tl.dot wrongly, so the CPU run uses fp16.
    dtype = torch.bfloat16 if on_gpu else torch.float16
    executions = executions or (200 if on_gpu else 4)
    hidden = hidden or (3072 if on_gpu else 320)
    ms = (1, 8, 64, 256, 2048) if on_gpu else (1, 8, 33)
    where = torch.cuda.get_device_name() if on_gpu else "CPU (Triton interpreter)"
    print(f"detlora replay: LoRA shrink, H={hidden}, r={rank}, {slices} slices, {adapters} "
          f"adapters + rows without, {dtype}, {executions} executions each, on {where}")
    print(f"{'M':>5} {'reduction':>10} {'differing':>11} {'elem frac':>10} {'mean |d|':>10} "
          f"{'max |d|':>10} {'rel err':>9} {'ms/run':>8}")
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    # One step a replay: every reduction and the torch reference, at every M.
    with tqdm(total=len(ms) * (1 + len(REDUCTIONS)), desc="replay", unit="replay",
              disable=not (sys.stderr.isatty() if progress is None else progress),
              file=sys.stderr, leave=False, dynamic_ncols=True) as bar:
        for m in ms:
            x = torch.randn(m, hidden, generator=gen, device=device).to(dtype)
            a = (torch.randn(adapters, slices, rank, hidden, generator=gen, device=device)
                 / hidden**0.5).to(dtype)
            ids = torch.arange(m, device=device, dtype=torch.int32) % (adapters + 1)
            ids = torch.where(ids == adapters, -1, ids)  # every (adapters+1)-th row has none
            scale = torch.rand(adapters, generator=gen, device=device) + 0.5
            groups = group_tokens(ids, adapters)
            oracle = lora_shrink_ref(x, a, ids, scale, compute_dtype=torch.float64)
            ops = {"torch_ref": lambda x=x, a=a, ids=ids, s=scale: lora_shrink_ref(x, a, ids, s)}
            for red in REDUCTIONS:
                out = torch.empty(slices, m, rank, dtype=torch.float32, device=device)
                ops[red] = (lambda red=red, out=out, x=x, a=a, g=groups, s=scale:
                            lora_shrink(x, a, g, s, reduction=red, out=out))
            for name, op in ops.items():
                bar.set_postfix_str(f"M={m} {name}", refresh=False)
                t0 = time.perf_counter()
                stats = replay(op, executions)
                ms_per_run = (time.perf_counter() - t0) * 1000 / executions
                err = float((op().double() - oracle).norm() / oracle.norm())
                row = {"M": m, "reduction": name, **stats.as_dict(), "rel_err_vs_fp64": err}
                rows.append(row)
                # Through the bar: the row goes above it, the bar stays at the bottom.
                bar.write(f"{m:5d} {name:>10} {stats.differing:5d}/{stats.comparisons:<5d} "
                          f"{stats.differing_element_fraction:10.3g} {stats.mean_abs_diff:10.3g} "
                          f"{stats.max_abs_diff:10.3g} {err:9.2e} {ms_per_run:8.2f}",
                          file=sys.stdout)
                bar.update(1)
    if not on_gpu:
        print("note: on a CPU the interpreter runs CTAs in a fixed order, so even atomic repeats;"
              " run on a GPU to see atomic Split-K vary")
    return rows

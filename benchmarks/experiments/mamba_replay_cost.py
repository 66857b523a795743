"""What exact replay costs: a decode token computed by the chunk formula over its open chunk
(detlora's one arithmetic for prefill and decode) against the recurrent one-token update
(mamba_ssm's selective_state_update, which gives other bits than the prefill).

1. Arithmetic (multiply-adds per decode token and Mamba layer), counted from the kernels'
   tiling (``detlora.ops.mamba_ssd``: 16-row tiles, s-blocks of 16, C.B once per group,
   state blocks) at the
   Nemotron-3-Nano-4B shape, for a token at each offset in its chunk, averaged; beside the
   recurrent update's 2 H P N and a prefill token's share of its chunk.
2. Bytes per decode token and layer: replay reads the fp32 state and the open chunk's rows;
   the recurrent update reads and writes the fp32 state.
3. Time, CPU (the torch references, a small shape): a decode token by replay against a
   token of a prefill of the same length, and a recurrent torch update.
4. Time, GPU when there is one (the 4B layer): the scan of a decode step at batch 1 and 64
   (tokens spread over the chunk offsets) against a torch recurrent update of the same
   states, and a prefill's time per token.

    PYTHONPATH=src python -m benchmarks.experiments.mamba_replay_cost OUT.json
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.harness import results_meta, write_results
from detlora.ops.chunk_plan import ChunkPlan
from detlora.ops.mamba_ssd import mamba_chunk_scan, mamba_chunk_scan_ref, scan_blocks

SHAPE_4B = {"heads": 96, "head_dim": 80, "groups": 8, "d_state": 128, "chunk": 256}
SMALL = {"heads": 8, "head_dim": 16, "groups": 2, "d_state": 16, "chunk": 32}


def decode_macs(s: dict[str, int]) -> dict[str, float]:
    """Multiply-adds per decode token and layer (mean over the token's chunk offset)."""
    h, p, n, g, cs = s["heads"], s["head_dim"], s["d_state"], s["groups"], s["chunk"]
    bm, bn, bp = scan_blocks(cs, n, p)
    p_tiles = -(-p // bp)
    per_offset = []
    for off in range(cs):
        blocks = off // bm + 1  # s-blocks of the row's tile
        cb = g * blocks * bm * bm * bn  # C.B, once per group (the cb kernel)
        scan = h * p_tiles * (bm * bn * bp + blocks * bm * bm * bp)  # C.S, then M @ x
        per_offset.append(cb + scan)
    close = h * p * n * cs / cs  # a chunk's state sum, once per chunk: per token
    replay = statistics.mean(per_offset) + close
    prefill = statistics.mean(per_offset)  # a prefill row computes its tile with its rows
    prefill_token = prefill / bm + close  # ... shared by the tile's 16 rows
    return {"replay": replay, "recurrent": 2 * h * p * n, "prefill_token": prefill_token,
            "replay_over_recurrent": replay / (2 * h * p * n)}


def decode_bytes(s: dict[str, int], elem: int = 2) -> dict[str, float]:
    """Bytes per decode token and layer: replay reads the fp32 state, the open chunk's x and
    B rows (half a chunk on average) and writes one row; the recurrent update reads and
    writes the fp32 state."""
    h, p, n, g, cs = s["heads"], s["head_dim"], s["d_state"], s["groups"], s["chunk"]
    state = h * p * n * 4
    rows = cs / 2 * (h * p + g * n + h) * elem
    return {"replay": state + rows + (h * p + 2 * g * n + h) * elem + state / cs,
            "recurrent": 2 * state}


def _inputs(s: dict[str, int], length: int, device: str, dtype: torch.dtype):
    h, p, g, n = s["heads"], s["head_dim"], s["groups"], s["d_state"]
    gen = torch.Generator(device=device).manual_seed(0)
    conv = h * p + 2 * g * n
    xbc = torch.randn(length, conv, generator=gen, device=device).to(dtype)
    dt = (torch.randn(length, h, generator=gen, device=device) - 2).to(dtype)
    a = -torch.exp(torch.rand(h, generator=gen, device=device))
    return xbc, dt, a, torch.randn(h, generator=gen, device=device), torch.zeros(h, device=device)


def _state(s: dict[str, int], slots: int, device: str, dtype: torch.dtype):
    h, p, g, n, cs = s["heads"], s["head_dim"], s["groups"], s["d_state"], s["chunk"]
    return (torch.zeros(slots, h, p, n, device=device),
            torch.zeros(slots, cs, h * p + 2 * g * n + h, device=device, dtype=dtype))


def _recurrent(state: torch.Tensor, x: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
               dt: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """The one-token update, in torch (fp32 state): S = exp(dt A) S + dt x B^T; y = S C."""
    hpg = state.shape[1] // b.shape[1]
    da = torch.exp(dt * a)[:, :, None, None]
    bh = b.repeat_interleave(hpg, 1)[:, :, None, :]
    state.mul_(da).add_(dt[:, :, None, None] * x[:, :, :, None] * bh)
    return (state * c.repeat_interleave(hpg, 1)[:, :, None, :]).sum(-1)


def cpu_times(s: dict[str, int], length: int = 96) -> dict[str, float]:
    """Seconds per token of the torch references, one thread."""
    torch.set_num_threads(1)
    xbc, dt, a, d, bias = _inputs(s, length, "cpu", torch.float32)
    kw = {"head_dim": s["head_dim"], "n_groups": s["groups"]}

    def run(splits: list[int]) -> float:
        state, buf = _state(s, 1, "cpu", torch.float32)
        t0, pos = time.perf_counter(), 0
        for n in splits:
            plan = ChunkPlan.build([0, n], [pos + n], [0], s["chunk"])
            mamba_chunk_scan_ref(xbc[pos:pos + n], dt[pos:pos + n], a, d, bias, state, buf,
                                 plan, **kw)
            pos += n
        return (time.perf_counter() - t0) / length

    h, p, g, n = s["heads"], s["head_dim"], s["groups"], s["d_state"]
    state = torch.zeros(1, h, p, n)
    x = xbc[:, :h * p].view(length, 1, h, p)
    b = xbc[:, h * p:h * p + g * n].view(length, 1, g, n)
    c = xbc[:, h * p + g * n:].view(length, 1, g, n)
    t0 = time.perf_counter()
    for t in range(length):
        _recurrent(state, x[t], b[t], c[t], dt[t:t + 1].float(), a)
    recurrent = (time.perf_counter() - t0) / length
    return {"prefill_per_token_s": min(run([length]) for _ in range(3)),
            "replay_decode_per_token_s": min(run([1] * length) for _ in range(3)),
            "recurrent_per_token_s": recurrent}


def _cuda_ms(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def gpu_times(s: dict[str, int]) -> dict[str, float]:
    """Milliseconds of the 4B layer's scan on the GPU (bf16 inputs, fp32 state)."""
    dev, dtype, cs = "cuda", torch.bfloat16, s["chunk"]
    kw = {"head_dim": s["head_dim"], "n_groups": s["groups"]}
    out: dict[str, float] = {}
    for batch in (1, 64):
        xbc, dt, a, d, bias = _inputs(s, batch, dev, dtype)
        state, buf = _state(s, batch, dev, dtype)
        offsets = [(37 * k + 128) % cs for k in range(batch)]  # spread over the chunk
        plan = ChunkPlan.build(list(range(batch + 1)), [cs + o + 1 for o in offsets],
                               list(range(batch)), cs, dev)
        out[f"replay_decode_b{batch}_ms"] = _cuda_ms(
            lambda xbc=xbc, dt=dt, a=a, d=d, b=bias, st=state, bf=buf, pl=plan:
            mamba_chunk_scan(xbc, dt, a, d, b, st, bf, pl, **kw))
        h, p, g, n = s["heads"], s["head_dim"], s["groups"], s["d_state"]
        x = xbc[:, :h * p].float().view(batch, h, p)
        b = xbc[:, h * p:h * p + g * n].float().view(batch, g, n)
        c = xbc[:, h * p + g * n:].float().view(batch, g, n)
        dtf = dt.float()
        out[f"recurrent_torch_b{batch}_ms"] = _cuda_ms(
            lambda st=state, x=x, b=b, c=c, dtf=dtf, a=a: _recurrent(st, x, b, c, dtf, a))
    length = 2048
    xbc, dt, a, d, bias = _inputs(s, length, dev, dtype)
    state, buf = _state(s, 1, dev, dtype)
    plan = ChunkPlan.build([0, length], [length], [0], cs, dev)
    out["prefill_2048_ms"] = _cuda_ms(
        lambda: mamba_chunk_scan(xbc, dt, a, d, bias, state, buf, plan, **kw))
    out["prefill_per_token_us"] = 1e3 * out["prefill_2048_ms"] / length
    return out


def main(out_path: str) -> None:
    result = {
        "meta": results_meta(" ".join(["python -m benchmarks.experiments.mamba_replay_cost",
                                       out_path])),
        "shape_4b": SHAPE_4B, "macs_per_token_layer_4b": decode_macs(SHAPE_4B),
        "bytes_per_token_layer_4b": decode_bytes(SHAPE_4B),
        "small_shape": SMALL, "cpu_reference_small": cpu_times(SMALL),
    }
    if torch.cuda.is_available():
        result["gpu_4b_layer"] = gpu_times(SHAPE_4B)
    print(json.dumps({k: v for k, v in result.items() if k != "meta"}, indent=1))
    write_results(Path(out_path), result)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "out/mamba_replay_cost.json")

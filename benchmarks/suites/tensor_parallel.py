"""Tensor parallelism: the bits across TP sizes, speed per TP size and level, and what the
exact reductions cost in communication.

    python -m benchmarks.suites.tensor_parallel --out benchmarks/results/tensor_parallel.json
        [--models 3b,8b] [--tp 1,2] [--levels batch_invariant,run_to_run] [--layers-8b 8]
        [--keep-rows-from FILE]   (rows of models or devices this run does not measure stay)
        [--no-micro]              (no collectives / grouped-tree microbenchmarks)
    python -m benchmarks.suites.tensor_parallel --cpu --out ...   (tiny model, gloo)

Models: the Llama-3.2-3B shape (28 layers) and the Llama-3.1-8B shape (hidden 4096, 32 q / 8
kv heads, MLP 14336, vocabulary 128256; ``--layers-8b`` of its 32 layers, so the random
checkpoint is written and loaded within the step's time), both with tied embeddings as the
engine benchmark's writer makes them, random bf16 weights and two rank-16 adapters on all
seven projections. Workload: 64 prompts of 100 random tokens, 64
output tokens, EOS ignored, half greedy and half seeded sampling, logprobs of every chosen
token; adapters mixed (a0, a1, none).

Rows (``{"model", "level", "tp", "device", "comparisons", "differing", "tpot_b1_ms",
"tok_per_s_b64", ...}``): ``differing`` counts the 64 requests whose token ids or logprobs
differ from the same level at TP 1 (TP 1's row: a second run of its own); batch_invariant's
target is 0 at every size. TPOT at batch 1 = (t(64 tokens) - t(1 token)) / 63, batch-64
throughput = 64 * 64 / t(64 tokens), medians of ``--trials`` runs after a warm-up; each row
also names the engine's fingerprint (the same at every size at batch_invariant). The CPU run
(a tiny Llama, 16 requests of 16 tokens, ranks on gloo) has no speed fields (null).

``collectives``: per model hidden size H, M rows and ranks, microseconds per row-parallel
layer for NCCL's all-reduce of the bf16 output [M, H] (the run_to_run path, NCCL pinned as
the engine pins it) and for the exact path: all-gather of the fp32 group partials
[G / ranks, M, H] plus their ordered sum (batch_invariant), each timed by CUDA-graph replay.
``grouped_tree``: TP 1's cost of the grouped tree: the batch-invariant linear with its own K
split against ``linear_grouped`` (8 groups) for o and down at M = 1, 64, 2048.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness.meta import results_meta
from benchmarks.harness.results import write_results
from benchmarks.suites.engine import ModelShape, count_differing, write_adapter, write_model

SHAPES = {
    "llama-3.2-3b": ModelShape(),
    "llama-3.1-8b": ModelShape(hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128,
                               intermediate=14336, vocab=128256),
}
ALIASES = {"3b": "llama-3.2-3b", "8b": "llama-3.1-8b"}
TINY = ModelShape(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128,
                  vocab=256, rank=8, alpha=16)
PROMPTS, PROMPT_LEN, OUTPUT_LEN = 64, 100, 64
CPU_PROMPTS, CPU_OUTPUT_LEN = 16, 16  # the CPU run (tiny model): bits only


class Workload:
    """The 64 requests every engine runs (mixed adapters, half greedy, half seeded)."""

    def __init__(self, vocab: int, loras: list[Any], prompts: int = PROMPTS,
                 output_len: int = OUTPUT_LEN) -> None:
        from detlora import SamplingParams

        g = torch.Generator().manual_seed(1234)
        self.prompts = torch.randint(10, vocab - 10, (prompts, PROMPT_LEN), generator=g).tolist()
        self.loras = [[loras[0], loras[1], None][k % 3] for k in range(prompts)]
        self.output_len = output_len

        def params(k: int, n: int) -> SamplingParams:
            common = dict(max_tokens=n, ignore_eos=True, logprobs=0)
            if k % 2 == 0:
                return SamplingParams(**common, temperature=0.0)
            return SamplingParams(**common, temperature=0.8, top_p=0.95, seed=k)

        self.params = [params(k, output_len) for k in range(prompts)]
        self.params_1 = [params(k, 1) for k in range(prompts)]

    def run(self, llm: Any, batch: int, one_token: bool = False) -> list[Any]:
        params = self.params_1 if one_token else self.params
        return llm.generate(self.prompts[:batch], params[:batch], self.loras[:batch],
                            use_tqdm=False)


def _median_s(fn: Callable[[], Any], trials: int) -> float:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    times = []
    for _ in range(trials):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def engine_rows(model_dir: Path, name: str, shape: ModelShape, loras: list[Any],
                levels: list[str], sizes: list[int], device: str, trials: int,
                log: Callable[[str], None], save: Callable[[], None],
                rows: list[dict[str, Any]]) -> None:
    from detlora import LLM

    prompts = PROMPTS if device == "cuda" else CPU_PROMPTS
    output_len = OUTPUT_LEN if device == "cuda" else CPU_OUTPUT_LEN
    work = Workload(shape.vocab, loras, prompts, output_len)
    for level in levels:
        reference: list[Any] | None = None
        for tp in sizes:
            t0 = time.perf_counter()
            llm = LLM(str(model_dir), enable_lora=True, max_loras=2, max_lora_rank=shape.rank,
                      determinism=level, device=device, tensor_parallel_size=tp,
                      max_model_len=PROMPT_LEN + output_len + 16, max_num_seqs=prompts,
                      max_num_batched_tokens=2048, enable_prefix_caching=False)
            init_s = time.perf_counter() - t0
            outs = work.run(llm, prompts)
            if reference is None:  # TP 1 (the first size): a second run of its own
                reference = outs
                outs = work.run(llm, prompts)
            row: dict[str, Any] = {
                "model": name, "level": level, "tp": tp, "device": device,
                "comparisons": len(outs), "differing": count_differing(outs, reference),
                "tpot_b1_ms": None, "tok_per_s_b64": None, "init_s": round(init_s, 1),
                "cuda_graphs": llm.engine.runner.uses_cuda_graphs,
                "fingerprint": llm.engine.fingerprint_of(None)}
            if device == "cuda":
                t1 = _median_s(lambda llm=llm: work.run(llm, 1, one_token=True), trials)
                tn = _median_s(lambda llm=llm: work.run(llm, 1), trials)
                row["tpot_b1_ms"] = round(1e3 * (tn - t1) / (output_len - 1), 3)
                t64 = _median_s(lambda llm=llm: work.run(llm, prompts), trials)
                row["tok_per_s_b64"] = round(prompts * output_len / t64, 1)
            llm.engine.shutdown()
            del llm
            if device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            rows.append(row)
            log(f"  {name} {level:16s} tp {tp}: {row['differing']}/{row['comparisons']} differ "
                f"from tp 1, TPOT b1 {row['tpot_b1_ms']} ms, b64 {row['tok_per_s_b64']} tok/s "
                f"(engine up in {init_s:.0f} s)")
            save()


# ----------------------------------------------------------------------------- collectives


def _collectives_rank(rank: int, size: int, port: int, hiddens: list[int], ms: list[int],
                      queue: Any) -> None:
    """One rank of the communication microbenchmark (NCCL, pinned as at run_to_run)."""
    import datetime

    import torch.distributed as dist

    from benchmarks.harness.timing import time_graph_us
    from detlora.distributed.group import TensorParallelGroup
    from detlora.distributed.nccl_env import pin_nccl_for_run_to_run
    from detlora.ops.grouped_linear import MAX_K_GROUPS, sum_partials

    pin_nccl_for_run_to_run()
    store = dist.TCPStore("127.0.0.1", port, size, rank == 0,
                          timeout=datetime.timedelta(seconds=120))
    group = TensorParallelGroup.create(store, rank, size, f"cuda:{rank}")
    out = []
    for h in hiddens:
        for m in ms:
            y = torch.randn(m, h, device=group.device).to(torch.bfloat16)
            parts = torch.randn(MAX_K_GROUPS // size, m, h, device=group.device)

            def exact(parts: torch.Tensor = parts) -> None:
                every = group.all_gather(parts)
                sum_partials(every.flatten(0, 1), None, torch.bfloat16)

            reduce_us = time_graph_us([lambda y=y: group.all_reduce(y)], replays=20)
            exact_us = time_graph_us([exact], replays=20)
            gather_us = time_graph_us([lambda p=parts: group.all_gather(p)], replays=20)
            out.append({"hidden": h, "m": m, "ranks": size,
                        "all_reduce_bf16_us": round(reduce_us, 2),
                        "exact_gather_and_sum_us": round(exact_us, 2),
                        "exact_gather_only_us": round(gather_us, 2),
                        "exact_bytes_per_rank": parts.numel() * 4,
                        "all_reduce_bytes": y.numel() * 2})
    if rank == 0:
        queue.put(out)


def collectives(hiddens: list[int], ms: list[int], size: int) -> list[dict[str, Any]]:
    import socket

    import torch.multiprocessing as tmp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = tmp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_collectives_rank, args=(r, size, port, hiddens, ms, queue))
             for r in range(size)]
    for p in procs:
        p.start()
    result = queue.get(timeout=300)
    for p in procs:
        p.join(60)
    return result


def grouped_tree(shapes: dict[str, ModelShape], ms: list[int]) -> list[dict[str, Any]]:
    """TP 1: the level's own K split against 8 ordered groups, for o and down."""
    from benchmarks.harness.timing import input_sets_for, time_graph_us
    from detlora.ops import grouped_linear, matmul

    rows = []
    for name, s in shapes.items():
        for layer, (n, k) in {"o": (s.hidden, s.heads * s.head_dim),
                              "down": (s.hidden, s.intermediate)}.items():
            for m in ms:
                sets = input_sets_for(2 * (m * k + n * k))
                xs = [torch.randn(m, k, device="cuda").to(torch.bfloat16) for _ in range(sets)]
                ws = [(torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16)
                      for _ in range(sets)]
                plain = time_graph_us([lambda x=x, w=w: matmul.linear(x, w)
                                       for x, w in zip(xs, ws, strict=True)])
                groups = grouped_linear.k_groups(k)
                grouped = time_graph_us([lambda x=x, w=w, g=groups: grouped_linear.linear_grouped(
                    x, w, None, g) for x, w in zip(xs, ws, strict=True)])
                rows.append({"model": name, "layer": layer, "n": n, "k": k, "m": m,
                             "k_split": str(matmul.k_split(n, k)),
                             "linear_us": round(plain, 2), "grouped_us": round(grouped, 2),
                             "ratio": round(grouped / plain, 3)})
                del xs, ws
    return rows


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default="3b,8b")
    ap.add_argument("--tp", default="")
    ap.add_argument("--levels", default="batch_invariant,run_to_run")
    ap.add_argument("--layers-8b", type=int, default=8)
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--cpu", action="store_true", help="tiny model on the CPU (gloo)")
    ap.add_argument("--no-micro", action="store_true", help="skip the microbenchmarks")
    ap.add_argument("--keep-rows-from", default=None)
    args = ap.parse_args(argv)
    from detlora import LoRARequest

    device = "cpu" if args.cpu else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU: run with --cpu")
    gpus = torch.cuda.device_count() if device == "cuda" else 4
    sizes = [int(t) for t in args.tp.split(",")] if args.tp else \
        [t for t in (1, 2, 4, 8) if t <= gpus]
    levels = args.levels.split(",")
    if device == "cpu":
        shapes = {"tiny-llama": TINY}
    else:
        shapes = {ALIASES.get(m, m): SHAPES[ALIASES.get(m, m)] for m in args.models.split(",")}
        if "llama-3.1-8b" in shapes:
            shapes["llama-3.1-8b"] = replace(shapes["llama-3.1-8b"], layers=args.layers_8b)
    command = "python -m benchmarks.suites.tensor_parallel " + " ".join(
        argv if argv is not None else sys.argv[1:])
    result: dict[str, Any] = {
        "meta": {**results_meta(command), "sizes": sizes, "levels": levels,
                 "shapes": {k: vars(v) for k, v in shapes.items()},
                 "workload": {"prompts": PROMPTS, "prompt_len": PROMPT_LEN,
                              "output_len": OUTPUT_LEN} if device == "cuda" else
                 {"prompts": CPU_PROMPTS, "prompt_len": PROMPT_LEN,
                  "output_len": CPU_OUTPUT_LEN}},
        "rows": [], "collectives": [], "grouped_tree": []}
    if args.keep_rows_from and Path(args.keep_rows_from).is_file():
        # Rows this run does not measure again (another device, another model) stay, and so
        # do the microbenchmarks when this run skips them.
        old = json.loads(Path(args.keep_rows_from).read_text())
        result["rows"] = [r for r in old.get("rows", [])
                          if r.get("device") != device or r.get("model") not in shapes]
        if device == "cpu" or args.no_micro:
            result["collectives"] = old.get("collectives", [])
            result["grouped_tree"] = old.get("grouped_tree", [])
    kept = list(result["rows"])
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - started:6.0f} s] {msg}", flush=True)

    def save(final: bool = False) -> None:
        result["rows"] = kept + rows
        write_results(args.out, result, history=final)

    if device == "cuda" and not args.no_micro:
        hiddens = sorted({s.hidden for s in shapes.values()})
        if gpus >= 2:
            for size in [t for t in sizes if t > 1]:
                result["collectives"] += collectives(hiddens, [1, 64, 2048], size)
                log(f"collectives at {size} ranks: {result['collectives'][-1]}")
        result["grouped_tree"] = grouped_tree(shapes, [1, 64, 2048])
        log(f"grouped tree: {[(r['layer'], r['m'], r['ratio']) for r in result['grouped_tree']]}")
        torch.cuda.empty_cache()  # the engines size their KV caches from what is free
        save()
    with tempfile.TemporaryDirectory(prefix="detlora-bench-tp-") as tmp:
        for name, shape in shapes.items():
            root = Path(tmp) / name
            t0 = time.perf_counter()
            write_model(root / "model", shape)
            for k in range(2):
                write_adapter(root / f"adapter{k}", shape, seed=10 + k)
            loras = [LoRARequest(f"a{k}", k + 1, str(root / f"adapter{k}")) for k in range(2)]
            log(f"{name}: wrote model and adapters in {time.perf_counter() - t0:.0f} s")
            engine_rows(root / "model", name, shape, loras, levels, sizes, device, args.trials,
                        log, save, rows)
    save(final=True)


if __name__ == "__main__":
    main()

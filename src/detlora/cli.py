"""``detlora`` command line."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path


def _prepare_runtime() -> bool:
    """Use Triton's CPU interpreter when there is no GPU. Must run before kernels import."""
    import torch

    has_cuda = torch.cuda.is_available()
    if not has_cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return has_cuda


def commit_id() -> str:
    env = os.environ.get("DETLORA_COMMIT")
    if env:
        return env
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
            cwd=Path(__file__).resolve().parent,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def results_meta(command: str) -> dict[str, str]:
    from detlora.study.timing import environment

    return {
        **environment(),
        "commit": commit_id(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
    }


def _cmd_replay(args: argparse.Namespace) -> int:
    has_cuda = _prepare_runtime()
    from detlora.study.replay_table import run_replay_table

    run_replay_table(has_cuda, executions=args.executions, hidden=args.hidden, rank=args.rank)
    return 0


def _cmd_bench_kernels(args: argparse.Namespace) -> int:
    if not _prepare_runtime():
        print("detlora bench kernels needs a CUDA GPU", file=sys.stderr)
        return 2
    from detlora.study.lora_kernel_bench import BenchPlan, run

    plan = BenchPlan.quick() if args.quick else BenchPlan()
    if args.sweep or args.sweep_only:
        plan = BenchPlan(**{**plan.__dict__, "sweep_ms": (1, 16, 64, 256, 1024, 4096)})
    result = {"meta": results_meta(" ".join(["detlora", *sys.argv[1:]])),
              **run(plan, sweep_only=args.sweep_only)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="detlora", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "replay",
        help="kernel replay study on a built-in shape (paper section 5.2 table)",
    )
    p.add_argument("--executions", type=int, default=None,
                   help="executions per reduction (default: 200 on GPU, 4 on CPU)")
    p.add_argument("--hidden", type=int, default=None,
                   help="hidden size (default 3072 on GPU, 320 on CPU)")
    p.add_argument("--rank", type=int, default=16)
    p.set_defaults(func=_cmd_replay)

    bench = sub.add_parser("bench", help="GPU benchmarks that write benchmarks/results/*.json")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    k = bench_sub.add_parser("kernels", help="LoRA shrink/expand replay, invariance, latency")
    k.add_argument("--out", default="benchmarks/results/lora_kernels.json")
    k.add_argument("--quick", action="store_true", help="a small grid, for smoke tests")
    k.add_argument("--sweep", action="store_true", help="also time candidate tilings")
    k.add_argument("--sweep-only", action="store_true", help="time candidate tilings only")
    k.set_defaults(func=_cmd_bench_kernels)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

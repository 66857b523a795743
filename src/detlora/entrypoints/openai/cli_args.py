"""``detlora serve MODEL``: the engine's arguments (those of ``LLM``) and the server's.

Importing this module loads neither FastAPI nor torch; ``run_serve`` does.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="a model directory, a Hub id (org/name), a .gguf file or "
                   "'smollm2' (the embedded SmolLM2-135M-Instruct)")
    from detlora.engine_args import EngineArgs

    # The engine's options, as LLM() and every other command take them.
    EngineArgs.add_cli_args(p, exclude=("model",))
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: loopback only)")
    s.add_argument("--port", type=int, default=8000,
                   help="port to listen on (0: a free one, named in the log)")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 (or set DETLORA_API_KEY)")
    s.add_argument("--served-model-name", default=None, help="the base model's id "
                   "(default: MODEL as given)")
    s.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=DIR",
                   help="adapters served as models of their own")
    s.add_argument("--enable-lora-loading", action="store_true",
                   help="allow /v1/load_lora_adapter (from under --lora-root only)")
    s.add_argument("--lora-root", default=None,
                   help="the directory runtime-loaded adapters must resolve into")
    s.add_argument("--max-queued-requests", type=int, default=1024,
                   help="sequences that may wait beyond --max-num-seqs; then 503")
    s.add_argument("--max-request-bytes", type=int, default=1 << 20)
    s.add_argument("--max-prompt-tokens", type=int, default=None)
    s.add_argument("--max-tokens-limit", type=int, default=None,
                   help="the largest max_tokens a request may ask for")
    s.add_argument("--max-n", type=int, default=16)
    s.add_argument("--max-logprobs", type=int, default=20)
    s.add_argument("--max-questions", type=int, default=256)
    s.add_argument("--allowed-origins", nargs="*", default=[],
                   help="CORS origins (default: none, no CORS)")
    s.add_argument("--graceful-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish on SIGTERM")
    s.add_argument("--log-level", default="warning")
    s.add_argument("--api-server-count", type=int, default=1,
                   help="front-end processes (HTTP, templates, tokenizing) over the one engine "
                        "process, all on the same port (default: 1)")
    a = p.add_argument_group("audit log (detlora verify replays it)")
    a.add_argument("--audit-log", metavar="DIR", default=None,
                   help="append one JSON line per finished request or decision to files in "
                        "DIR (created with mode 0700, files 0600)")
    a.add_argument("--audit-log-hash-only", action="store_true",
                   help="keep hashes instead of prompt and output token ids and texts: "
                        "checkable against inputs you keep yourself (detlora verify "
                        "--inputs), not replayable alone")
    a.add_argument("--audit-log-max-mb", type=float, default=256.0,
                   help="start the next file when one reaches this size (MiB; files also "
                        "start anew each UTC day)")


def lora_modules(specs: list[str]) -> tuple[tuple[str, str], ...]:
    """NAME=DIR pairs (ValueError for a bad one, a name given twice, a missing directory)."""
    seen: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes NAME=DIR, got {spec!r}")
        if name in seen:
            raise ValueError(f"--lora-modules {name}= is given twice")
        if not Path(path).is_dir():
            raise ValueError(f"--lora-modules {name}: adapter directory {path} does not exist")
        seen[name] = path
    return tuple(seen.items())


def run_serve(args: argparse.Namespace) -> int:
    from detlora.engine_args import EngineArgs
    from detlora.entrypoints.openai.server_config import ServerConfig

    try:
        from detlora.engine.model_files import check_model_name

        check_model_name(args.model)  # a typo is an error now, not after the port is bound
        if args.audit_log is not None:  # a directory it cannot write: now, not after loading
            from detlora.audit.writer import prepare_directory

            prepare_directory(args.audit_log)
        if not args.audit_log_max_mb > 0:
            raise ValueError(f"--audit-log-max-mb must be > 0, got {args.audit_log_max_mb}")
        modules = lora_modules(args.lora_modules)
        lora = bool(modules) or args.enable_lora or args.enable_lora_loading
        engine = EngineArgs.from_cli_args(args, model=args.model, enable_lora=lora)
        server = ServerConfig(
            model=args.model, served_model_name=args.served_model_name or args.model,
            host=args.host, port=args.port,
            api_key=args.api_key or os.environ.get("DETLORA_API_KEY") or None,
            lora_modules=modules, enable_lora_loading=args.enable_lora_loading,
            lora_root=args.lora_root, max_queued_requests=args.max_queued_requests,
            max_request_bytes=args.max_request_bytes, max_prompt_tokens=args.max_prompt_tokens,
            max_tokens=args.max_tokens_limit, max_n=args.max_n, max_logprobs=args.max_logprobs,
            max_questions=args.max_questions, cors_origins=tuple(args.allowed_origins),
            graceful_timeout=args.graceful_timeout, log_level=args.log_level,
            audit_log=args.audit_log, audit_log_hash_only=args.audit_log_hash_only,
            audit_log_max_bytes=max(1, int(args.audit_log_max_mb * (1 << 20))),
            api_server_count=args.api_server_count)
        from detlora.entrypoints.openai.api_server import run_server

        return run_server(engine, server, tokenizer_dir=args.tokenizer)
    except (ValueError, FileNotFoundError) as e:
        print(f"detlora serve: error: {e}", file=sys.stderr)
        return 2


__all__ = ["add_serve_args", "lora_modules", "run_serve"]

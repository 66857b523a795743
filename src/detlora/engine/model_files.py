"""Where an engine's model and tokenizer files are: local directories for what a user named.

A Hub id or a ``.gguf`` file becomes a local model directory (downloaded or converted once),
and ``smollm2`` (when no such directory exists) the embedded SmolLM2-135M-Instruct;
the tokenizer is the model's own unless ``tokenizer`` names another directory or Hub id. The
offline ``LLM`` and the server's ``AsyncLLM`` both start from here, so they accept the same
model names.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from detlora.engine.llm_engine import conversion_dtype, resolve_device
from detlora.engine.tokenizer import has_tokenizer
from detlora.engine_args import EngineArgs
from detlora.models.sources import check_model_source, hub_model_dir, is_hub_id, resolve_model
from detlora.models.spec import ModelSpec


@dataclasses.dataclass(frozen=True)
class ModelFiles:
    """``args`` with ``model`` a local directory; ``tokenizer_dir`` the tokenizer to load
    (None: the model has none, or the user skipped it)."""

    args: EngineArgs
    tokenizer_dir: str | None


# The embedded real model's name (``detlora.models.embedded``).
EMBEDDED_MODEL = "smollm2"


def check_model_name(model: str) -> None:
    """Raise the error ``resolve_model_files`` would for a model name that names nothing,
    without downloading or converting (the server checks before it binds its port)."""
    if model == EMBEDDED_MODEL and not Path(model).exists():
        return
    check_model_source(model)


def resolve_model_files(args: EngineArgs) -> ModelFiles:
    dtype = conversion_dtype(args.dtype, resolve_device(args.device))
    if args.model == EMBEDDED_MODEL and not Path(args.model).exists():
        from detlora.models.embedded import smollm2_model_dir

        model_dir = smollm2_model_dir(dtype)
    else:
        model_dir = resolve_model(args.model, revision=args.revision,
                                  download_dir=args.download_dir, dtype=dtype)
    local = dataclasses.replace(args, model=str(model_dir), revision=None, download_dir=None)
    ModelSpec.from_dir(model_dir)  # config.json first: tokenizer errors would misname it
    tok_dir: str | Path = model_dir
    if args.tokenizer is not None:
        tok_dir = args.tokenizer
        if not Path(tok_dir).is_dir() and is_hub_id(tok_dir):
            tok_dir = hub_model_dir(tok_dir, revision=args.tokenizer_revision,
                                    download_dir=args.download_dir)
    elif args.tokenizer_revision is not None:
        raise ValueError("tokenizer_revision applies to a Hub tokenizer id given as "
                         "tokenizer=...")
    if args.skip_tokenizer_init or (args.tokenizer is None and not has_tokenizer(tok_dir)):
        return ModelFiles(local, None)
    return ModelFiles(local, str(tok_dir))

"""Where a model comes from: a local directory, a Hugging Face Hub id, or a ``.gguf`` file.

``resolve_model`` turns any of them into a local Hugging Face model directory (config.json,
safetensors, tokenizer), which is what the loader reads:

* a directory is used as it is;
* a Hub id (``org/name``) goes through ``huggingface_hub.snapshot_download`` (its cache, or
  ``download_dir``); without a network a model already in the cache is used, and one that is
  not is a clear error that says how to download it;
* a ``.gguf`` file (Llama, Mistral as Llama, Qwen3, Qwen2, Phi-3 or Gemma 3 text) is
  read by transformers' GGUF support (which needs the ``gguf`` package), dequantized to
  ``dtype``, and written once as a model directory under the cache (``cache_dir()``); later
  loads read that directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from detlora.models.spec import SUPPORTED_ARCHITECTURES

# GGUF's general.architecture for the architectures the engine runs. llama.cpp writes Mistral
# as "llama", and transformers 5.x reads such a file as LlamaForCausalLM (no window).
_GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
                       "qwen2": "Qwen2ForCausalLM", "phi3": "Phi3ForCausalLM",
                       "gemma3": "Gemma3ForCausalLM"}
# Not Gemma 4: transformers 5.24 reads few of its GGUF metadata keys (no layer types, KV
# sharing or per-layer-embedding size), so a converted file would not be the model.
assert set(_GGUF_ARCHITECTURES.values()) <= set(SUPPORTED_ARCHITECTURES)
# What a model directory needs from the Hub: no pickles, no other formats' copies.
_HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt",
                 "*.jinja"]
_COMPLETE = ".complete"  # written last into a converted directory


def cache_dir() -> Path:
    """detlora's cache: ``$DETLORA_CACHE``, else ``$XDG_CACHE_HOME/detlora``, else
    ``~/.cache/detlora``."""
    if os.environ.get("DETLORA_CACHE"):
        return Path(os.environ["DETLORA_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "detlora"


def is_hub_id(model: str) -> bool:
    """``org/name`` (one slash, no path-like start): what the Hub names repositories."""
    parts = model.split("/")
    return len(parts) == 2 and all(parts) and not model.startswith((".", "~")) \
        and not model.endswith(".gguf")


def resolve_model(model: str, *, revision: str | None = None,
                  download_dir: str | None = None,
                  dtype: torch.dtype = torch.float32) -> Path:
    """The local model directory for ``model`` (see the module doc)."""
    check_model_source(model)
    path = Path(model).expanduser()
    if path.is_dir():
        for what, value in (("revision", revision), ("download_dir", download_dir)):
            if value is not None:
                raise ValueError(f"{what}={value!r} applies to Hub model ids, but {model} is "
                                 "a local directory")
        return path
    if path.suffix == ".gguf":
        return gguf_model_dir(path, dtype)
    return hub_model_dir(model, revision=revision, download_dir=download_dir)


def check_model_source(model: str) -> None:
    """Raise what ``resolve_model`` would for a name that is no local directory, existing
    ``.gguf`` file or Hub id; download and convert nothing."""
    path = Path(model).expanduser()
    if path.is_dir():
        return
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {model} does not exist")
        return
    if path.exists():
        raise ValueError(f"model {model} is a file, not a model directory or a .gguf file")
    if not is_hub_id(model):
        raise FileNotFoundError(f"model directory {model} does not exist (nor is it a Hub id "
                                "org/name or a .gguf file)")


def hub_model_dir(repo_id: str, *, revision: str | None = None,
                  download_dir: str | None = None) -> Path:
    """A Hub model's snapshot directory: from the cache when it is there, else downloaded."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (
            GatedRepoError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )
    except ImportError as e:  # pragma: no cover - installed with transformers
        raise ValueError(f"Hub model ids need huggingface_hub: {e}") from None
    kwargs = dict(repo_id=repo_id, revision=revision, cache_dir=download_dir,
                  allow_patterns=_HUB_PATTERNS)
    try:  # the cache first: no network round trip for a model already here
        return Path(snapshot_download(**kwargs, local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    except (OSError, ValueError):  # an offline mode error: the download below says more
        pass
    how = (f"download it where there is a network (`hf download {repo_id}` or "
           f"`huggingface-cli download {repo_id}`), then pass its directory, or copy the "
           "Hugging Face cache here")
    try:
        return Path(snapshot_download(**kwargs))
    except GatedRepoError:
        raise ValueError(f"Hub model {repo_id} is gated: accept its terms on the Hub and log "
                         f"in (`hf auth login`), or {how}") from None
    except RepositoryNotFoundError:
        raise FileNotFoundError(f"no Hub model named {repo_id} (and no local directory of "
                                "that name)") from None
    except RevisionNotFoundError:
        raise ValueError(f"Hub model {repo_id} has no revision {revision!r}") from None
    except LocalEntryNotFoundError:
        raise FileNotFoundError(f"Hub model {repo_id} is not in the cache and cannot be "
                                f"downloaded (offline or no network): {how}") from None
    except OSError as e:
        raise FileNotFoundError(f"cannot download Hub model {repo_id} ({e.__class__.__name__}: "
                                f"{str(e).splitlines()[0] if str(e) else 'no detail'}): "
                                f"{how}") from None


def gguf_architecture(path: Path) -> str:
    """The HF architecture of a GGUF file, from its metadata; unsupported ones are refused."""
    try:
        from gguf import GGUFReader
    except ImportError:
        raise ValueError(f"reading {path} needs the gguf package (pip install gguf)") from None
    try:
        field = GGUFReader(str(path)).get_field("general.architecture")
        arch = field.contents() if field is not None else None
    except Exception as e:
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from None
    if arch not in _GGUF_ARCHITECTURES:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported (supported: "
                         f"{', '.join(_GGUF_ARCHITECTURES)})")
    return _GGUF_ARCHITECTURES[arch]


def gguf_model_dir(path: Path, dtype: torch.dtype = torch.float32) -> Path:
    """A GGUF file dequantized to ``dtype`` as a Hugging Face model directory (safetensors,
    config.json, tokenizer with its chat template), converted once into the cache and keyed
    by the file's path, size and modification time."""
    path = path.resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    name = str(dtype).replace("torch.", "")
    out = cache_dir() / "gguf" / f"{path.stem}-{key}-{name}"
    if (out / _COMPLETE).is_file():
        return out
    gguf_architecture(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        _convert_gguf(path, tmp, dtype)
        (tmp / _COMPLETE).write_text(json.dumps({"source": str(path)}))
        try:
            tmp.rename(out)
        except OSError:  # another process converted it first
            if not (out / _COMPLETE).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _convert_gguf(path: Path, out: Path, dtype: torch.dtype) -> None:
    """The GGUF file as a model directory in ``out``: weights as safetensors (the tied head
    left out), config.json without the GGUF quantization entry, generation config, tokenizer.

    transformers' GGUF reader parses the metadata into a config and dequantizes each tensor
    (the ``gguf`` package's numpy dequantization, llama's q/k permutation undone) under the
    names of a model built on the meta device; no model is materialised, so
    ``from_pretrained``'s loading stack (which wants ``accelerate`` for GGUF files) is not
    needed. The tensors are those ``from_pretrained(gguf_file=...)`` loads, bit for bit.
    """
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:
        fields = dict(load_gguf_checkpoint(str(path), return_tensors=False)["config"])
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
        with torch.device("meta"):  # parameter names only: no memory, no initialisation
            names = AutoModelForCausalLM.from_config(config)
        tensors = load_gguf_checkpoint(str(path), return_tensors=True,
                                       model_to_load=names)["tensors"]
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:
        raise ValueError(f"cannot convert {path}: {e}") from None
    expected = set(names.state_dict())
    weights = {k: v.to(dtype).contiguous() for k, v in tensors.items()}
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
        expected.discard("lm_head.weight")
    missing = sorted(expected - set(weights))
    if missing:
        raise ValueError(f"cannot convert {path}: {len(missing)} weight(s) missing from the "
                         f"GGUF file, e.g. {missing[:3]}")
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    config_dict = config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    config_dict["dtype"] = str(dtype).replace("torch.", "")
    (out / "config.json").write_text(json.dumps(config_dict, indent=1))
    GenerationConfig.from_model_config(config).save_pretrained(str(out))
    tok.save_pretrained(str(out))

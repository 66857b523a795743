"""Models from where users keep them: a directory, a Hub id (from the Hugging Face cache,
offline), a .gguf file; and the errors that say what to do when none fits."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from detlora.config import SamplingParams
from detlora.entrypoints.demo import build_demo_assets
from detlora.entrypoints.llm import LLM
from detlora.models.sources import cache_dir, resolve_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("DETLORA_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "detlora"
    monkeypatch.setenv("DETLORA_CACHE", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"


def test_hub_id_from_the_cache_without_a_network(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    # The Hugging Face cache's layout: a snapshot per commit, refs/main naming it.
    repo = tmp_path / "hub" / "models--someone--tiny"
    build_demo_assets(repo / "snapshots" / COMMIT)
    shutil.rmtree(repo / "snapshots" / COMMIT / "adapters")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    llm = LLM("someone/tiny", download_dir=str(tmp_path / "hub"), device="cpu")
    out = llm.generate("the user asks", SamplingParams(temperature=0.0, max_tokens=2),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 2 and llm.engine_args.model == "someone/tiny"
    with pytest.raises(FileNotFoundError, match="hf download someone/other"):
        LLM("someone/other", download_dir=str(tmp_path / "hub"), device="cpu")


@pytest.mark.parametrize(("name", "error", "message"), [
    ("no/such/dir/here", FileNotFoundError, "model directory no/such/dir/here does not exist"),
    ("missing.gguf", FileNotFoundError, "GGUF file missing.gguf does not exist"),
])
def test_models_that_are_nowhere(name, error, message):
    with pytest.raises(error, match=message):
        resolve_model(name)


def test_files_that_are_not_models(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        resolve_model(str(fake))
    text = tmp_path / "config.txt"
    text.write_text("{}")
    with pytest.raises(ValueError, match="is a file, not a model directory"):
        resolve_model(str(text))


def test_the_server_resolves_models_as_llm_does(tmp_path, monkeypatch):
    """AsyncLLM (the server) and LLM start from resolve_model_files: a Hub id becomes its
    cached snapshot directory, with the snapshot's tokenizer."""
    import huggingface_hub.constants

    from detlora.engine.model_files import resolve_model_files
    from detlora.engine_args import EngineArgs

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    repo = tmp_path / "hub" / "models--someone--tiny"
    build_demo_assets(repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    files = resolve_model_files(EngineArgs(model="someone/tiny", device="cpu",
                                           download_dir=str(tmp_path / "hub")))
    snapshot = str(repo / "snapshots" / COMMIT)
    assert files.args.model == snapshot and files.args.download_dir is None
    assert files.tokenizer_dir == snapshot
    skipped = resolve_model_files(EngineArgs(model=snapshot, device="cpu",
                                             skip_tokenizer_init=True))
    assert skipped.tokenizer_dir is None


@pytest.fixture
def tiny_gguf(tmp_path, monkeypatch):
    from tests.helpers.tiny_gguf import write_tiny_llama_gguf

    monkeypatch.setenv("DETLORA_CACHE", str(tmp_path / "cache"))
    return write_tiny_llama_gguf(tmp_path / "tiny.gguf")


def test_a_gguf_file_converts_to_transformers_weights_bit_for_bit(tiny_gguf):
    """The conversion reads the GGUF file without from_pretrained, yet gives the weights,
    config and tokenizer that transformers' own GGUF loading gives (which needs accelerate,
    present in the test extra)."""
    pytest.importorskip("accelerate")
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    converted = resolve_model(str(tiny_gguf))
    ours = load_file(str(converted / "model.safetensors"))
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name,
                                              dtype=torch.float32)
    theirs = hf.state_dict()
    assert set(ours) == set(theirs) and len(ours) == 21
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, theirs[name]), name
    tok = AutoTokenizer.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name)
    assert AutoTokenizer.from_pretrained(str(converted))("the tin").input_ids == \
        tok("the tin").input_ids
    llm = LLM(str(tiny_gguf), device="cpu")
    out = llm.generate("the tin", SamplingParams(temperature=0.0, max_tokens=3),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3


def test_gguf_conversion_needs_no_accelerate(tiny_gguf):
    """README's main job converts a GGUF file in a virtualenv without the test extra: with
    accelerate made unimportable, the conversion still succeeds."""
    import os
    import subprocess
    import sys

    code = ("import sys; sys.modules['accelerate'] = None\n"
            "from detlora.models.sources import resolve_model\n"
            f"print(resolve_model({str(tiny_gguf)!r}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ), timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (Path(done.stdout.strip()) / "model.safetensors").is_file()

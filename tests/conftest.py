"""Test setup: without CUDA, kernels run in Triton's CPU interpreter; tiny random Hugging Face
checkpoints and PEFT adapters, written once per test session, for the engine tests.

TRITON_INTERPRET must be set before any kernel module is imported, which is why it is set
here, at collection time, and why kernel tests import ``detlora.ops.*`` inside the test files.
"""

import os
import warnings
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` (tests/gpu) are skipped cleanly without CUDA."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marker gpu; run by benchmarks/gpu.sh)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture
def sm90_compile():
    """``run(script, arg) -> list``: run a compile-for-sm_90 script in a fresh interpreter
    without TRITON_INTERPRET, with ``src`` and ``tests/ops`` on the path (for
    ``from compile_sm90 import ...``, tests/ops/compile_sm90.py) and ``json.dumps(arg)`` as its
    argument, and return the JSON list it prints last. Skips the test when Triton's ptxas is
    missing."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("triton's bundled ptxas is missing")
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(root / "src"), str(root / "tests" / "ops")])

    def run(script: str, arg: object) -> list:
        proc = subprocess.run([sys.executable, "-c", script, json.dumps(arg)], cwd=root,
                              env=env, capture_output=True, text=True, timeout=300,
                              check=False)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    return run


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
VOCAB = 128
EOS = 1


def _save_model(kind: str, path: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0 if kind == "llama" else 1)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  initializer_range=0.2, bos_token_id=0, eos_token_id=EOS,
                  tie_word_embeddings=False)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=16))
    model.eval().save_pretrained(str(path))
    return path


def _save_adapter(model_dir: Path, kind: str, path: Path, seed: int, rank: int = 8) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir))
    cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=LORA_TARGETS,
                     init_lora_weights=False)  # random, non-zero B
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        get_peft_model(base, cfg).save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> Path:
    return _save_model("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory) -> Path:
    return _save_model("qwen3", tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="session")
def llama_adapters(llama_dir, tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("llama_adapters")
    return [_save_adapter(llama_dir, "llama", root / f"a{k}", seed=10 + k) for k in range(2)]


@pytest.fixture(scope="session")
def qwen3_adapter(qwen3_dir, tmp_path_factory) -> Path:
    return _save_adapter(qwen3_dir, "qwen3", tmp_path_factory.mktemp("qwen3_adapter") / "a",
                         seed=20)


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Tiny matrices: one thread per xdist worker beats OpenMP fan-out on a 2-core CI box."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

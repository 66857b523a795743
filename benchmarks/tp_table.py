"""The tensor-parallel sizes whose bits equal one device's, for real architectures.

Each row is computed from the model's public config.json fields below by the rule the engine
refuses sizes with (``detlora.distributed.tp_sizes``: ``TensorParallelDims.from_config`` and
``invariant_sizes``). ``python -m benchmarks.tp_table`` prints the markdown table;
``--write`` puts it into docs/tensor_parallel.md between its markers (tests/lab checks that
the page holds exactly this output).

The fields are those of each repository's config.json on the Hugging Face Hub (``CONFIGS``
names the repository); this machine cannot reach the Hub, so they were read from copies of
those files quoted in public code and model cards, and only the fields the rule reads are
kept.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from detlora.distributed.tp_sizes import TensorParallelDims, invariant_sizes

DOC = Path(__file__).resolve().parents[1] / "docs" / "tensor_parallel.md"
BEGIN, END = "<!-- tp_table:begin -->", "<!-- tp_table:end -->"


def _cfg(hidden: int, inter: int, heads: int, kv: int, head_dim: int, vocab: int,
         **extra: Any) -> dict[str, Any]:
    return dict(hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads,
                num_key_value_heads=kv, head_dim=head_dim, vocab_size=vocab, **extra)


_NEMOTRON_H_PATTERN = "M-M-M-MM-M-M*-M-M*-M-M-M*-M-M-MM*-MMM-M-M-"

# (name, Hugging Face repository, config.json fields)
CONFIGS: list[tuple[str, str, dict[str, Any]]] = [
    ("Llama 3.2 1B", "meta-llama/Llama-3.2-1B", _cfg(2048, 8192, 32, 8, 64, 128256)),
    ("Llama 3.2 3B", "meta-llama/Llama-3.2-3B", _cfg(3072, 8192, 24, 8, 128, 128256)),
    ("Llama 3.1 8B", "meta-llama/Llama-3.1-8B", _cfg(4096, 14336, 32, 8, 128, 128256)),
    ("Llama 3.1 / 3.3 70B", "meta-llama/Llama-3.3-70B-Instruct",
     _cfg(8192, 28672, 64, 8, 128, 128256)),
    ("Qwen3 0.6B", "Qwen/Qwen3-0.6B", _cfg(1024, 3072, 16, 8, 128, 151936)),
    ("Qwen3 1.7B", "Qwen/Qwen3-1.7B", _cfg(2048, 6144, 16, 8, 128, 151936)),
    ("Qwen3 4B", "Qwen/Qwen3-4B", _cfg(2560, 9728, 32, 8, 128, 151936)),
    ("Qwen3 8B", "Qwen/Qwen3-8B", _cfg(4096, 12288, 32, 8, 128, 151936)),
    ("Qwen3 14B", "Qwen/Qwen3-14B", _cfg(5120, 17408, 40, 8, 128, 151936)),
    ("Qwen3 32B", "Qwen/Qwen3-32B", _cfg(5120, 25600, 64, 8, 128, 151936)),
    ("SmolLM2 135M", "HuggingFaceTB/SmolLM2-135M-Instruct", _cfg(576, 1536, 9, 3, 64, 49152)),
    ("Qwen2.5 0.5B", "Qwen/Qwen2.5-0.5B-Instruct", _cfg(896, 4864, 14, 2, 64, 151936)),
    ("Qwen2.5 1.5B", "Qwen/Qwen2.5-1.5B-Instruct", _cfg(1536, 8960, 12, 2, 128, 151936)),
    ("Qwen2.5 3B", "Qwen/Qwen2.5-3B-Instruct", _cfg(2048, 11008, 16, 2, 128, 151936)),
    ("Qwen2.5 7B", "Qwen/Qwen2.5-7B-Instruct", _cfg(3584, 18944, 28, 4, 128, 152064)),
    ("Qwen2.5 14B", "Qwen/Qwen2.5-14B-Instruct", _cfg(5120, 13824, 40, 8, 128, 152064)),
    ("Qwen2.5 32B", "Qwen/Qwen2.5-32B-Instruct", _cfg(5120, 27648, 40, 8, 128, 152064)),
    ("Qwen2.5 72B", "Qwen/Qwen2.5-72B-Instruct", _cfg(8192, 29568, 64, 8, 128, 152064)),
    ("Mistral 7B v0.3", "mistralai/Mistral-7B-Instruct-v0.3",
     _cfg(4096, 14336, 32, 8, 128, 32768)),
    ("Phi-3-mini", "microsoft/Phi-3-mini-4k-instruct", _cfg(3072, 8192, 32, 32, 96, 32064)),
    ("Phi-3.5-mini", "microsoft/Phi-3.5-mini-instruct", _cfg(3072, 8192, 32, 32, 96, 32064)),
    ("Gemma 3 1B", "google/gemma-3-1b-it", _cfg(1152, 6912, 4, 1, 256, 262144)),
    ("Gemma 3 4B", "google/gemma-3-4b-it",
     {"text_config": _cfg(2560, 10240, 8, 4, 256, 262208)}),
    ("Gemma 3 12B", "google/gemma-3-12b-it",
     {"text_config": _cfg(3840, 15360, 16, 8, 256, 262208)}),
    ("Gemma 3 27B", "google/gemma-3-27b-it",
     {"text_config": _cfg(5376, 21504, 32, 16, 128, 262208)}),
    ("Gemma 4 E4B", "google/gemma-4-E4B-it",
     {"text_config": _cfg(2560, 10240, 8, 2, 256, 262144, global_head_dim=512,
                          num_global_key_value_heads=None, use_double_wide_mlp=False)}),
    ("Nemotron-H 4B", "nvidia/NVIDIA-Nemotron-3-Nano-4B-BF16",
     _cfg(3136, 12544, 40, 8, 128, 131072, hybrid_override_pattern=_NEMOTRON_H_PATTERN,
          mamba_num_heads=96, mamba_head_dim=80, n_groups=8)),
]


def rows() -> list[tuple[str, str, str, str, str]]:
    """(model, shapes, vocabulary, sizes with one device's bits, what stops the next size)."""
    out = []
    for name, repo, config in CONFIGS:
        text = config.get("text_config") or config
        dims = TensorParallelDims.from_config(config)
        keep = invariant_sizes(dims)
        nxt = next((t for t in (2, 4, 8) if t not in keep), None)
        stop = "" if nxt is None else f"{nxt}: {dims.problems(nxt)[0]}"
        shapes = (f"{text['hidden_size']} / {text['intermediate_size']} / "
                  f"{text['num_attention_heads']}:{text['num_key_value_heads']} x "
                  f"{text['head_dim']}")
        if text.get("global_head_dim"):
            shapes += f" (full layers x {text['global_head_dim']})"
        if text.get("mamba_num_heads"):
            shapes += (f"; Mamba-2 {text['mamba_num_heads']} heads x "
                       f"{text['mamba_head_dim']}, {text['n_groups']} groups")
        out.append((f"[{name}](https://huggingface.co/{repo}/blob/main/config.json)", shapes,
                    str(text["vocab_size"]), ", ".join(map(str, keep)), stop))
    return out


def table() -> str:
    lines = ["| model (config.json) | hidden / MLP / heads:KV x head_dim | vocabulary | "
             "TP sizes with one device's bits | the next size is refused for |",
             "| --- | --- | --- | --- | --- |"]
    lines += [f"| {' | '.join(r)} |" for r in rows()]
    return "\n".join(lines) + "\n"


def write(doc: Path = DOC) -> None:
    """Replace the table between the markers of ``doc``."""
    text = doc.read_text()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    doc.write_text(f"{head}{BEGIN}\n{table()}{END}{tail}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true",
                        help=f"put the table into {DOC.relative_to(DOC.parents[1])}")
    args = parser.parse_args(argv)
    if args.write:
        write()
    else:
        sys.stdout.write(table())


if __name__ == "__main__":
    main()

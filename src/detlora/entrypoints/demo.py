"""``detlora demo``: the same requests at several batch sizes, bit for bit, per determinism level.

By default the demo runs a real model, SmolLM2-135M-Instruct (``detlora.models.embedded``:
from the package registry, converted once into the cache), with two random LoRA adapters
written for it; ``--tiny`` runs a random tiny Llama built locally instead (a word-level
tokenizer trained on a built-in text, with a small chat template; nothing downloaded). It
first shows what the model answers, then, per determinism level, runs every prompt alone (the
reference) and again in batches of several sizes, in reverse arrival order, with mixed
adapters, with a KV cache so small that sequences are preempted and recomputed, and on cached
prefix pages; the table says whether token ids and logprobs stayed identical to the bit, and
what each verdict means at its level.
"""

from __future__ import annotations

import gc
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

TEXT = """
the engine reads the prompt and writes the answer one token at a time . every token is chosen
from the logits of the model , and the logits are sums of many products . a sum in floating
point depends on the order of its terms , so a kernel that splits its work differently for a
large batch than for a small one gives a different answer to the same question . detlora fixes
the order of every sum for each row , whatever else shares the batch , so the same request
gives the same bits alone , in a batch , after a preemption or with other adapters beside it .
a guardrail model that says yes today must say yes tomorrow , and a trainer that replays a
rollout must see the tokens the sampler chose . the user asks a question and the assistant
answers it with care . small models are quick to build and quick to run on a laptop .
yes no true false safe unsafe allow deny
"""

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL = ["<pad>", "<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>"]
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# A hybrid model's projections (NemotronH: Mamba-2 in_proj, attention, the MLP's up/down).
HYBRID_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj",
                       "in_proj")


@dataclass(frozen=True)
class TinyModelShape:
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 128
    max_positions: int = 512
    rank: int = 8


def build_tokenizer(out_dir: Path) -> int:
    """Train a word-level tokenizer on TEXT and save it into ``out_dir``; returns vocab size."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.WordLevelTrainer(special_tokens=SPECIAL)
    tok.train_from_iterator([TEXT], trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        pad_token="<pad>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return tok.get_vocab_size()


def write_model(out_dir: Path, vocab: int, shape: TinyModelShape, seed: int = 0) -> None:
    """A random Llama checkpoint (fp32 safetensors + config.json), no transformers needed."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    h, i, d = shape.hidden, shape.intermediate, shape.hidden // shape.heads
    kv = shape.kv_heads * d

    def rnd(*size: int, std: float = 0.1) -> torch.Tensor:
        return torch.randn(*size, generator=g) * std

    w: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": rnd(vocab, h, std=1.0),
        "model.norm.weight": 1 + rnd(h),
        "lm_head.weight": rnd(vocab, h, std=0.2),
    }
    for layer in range(shape.layers):
        p = f"model.layers.{layer}."
        w |= {
            p + "input_layernorm.weight": 1 + rnd(h),
            p + "post_attention_layernorm.weight": 1 + rnd(h),
            p + "self_attn.q_proj.weight": rnd(h, h, std=0.2),
            p + "self_attn.k_proj.weight": rnd(kv, h, std=0.2),
            p + "self_attn.v_proj.weight": rnd(kv, h, std=0.2),
            p + "self_attn.o_proj.weight": rnd(h, h, std=0.2),
            p + "mlp.gate_proj.weight": rnd(i, h, std=0.2),
            p + "mlp.up_proj.weight": rnd(i, h, std=0.2),
            p + "mlp.down_proj.weight": rnd(h, i, std=0.2),
        }
    save_file({k: v.contiguous() for k, v in w.items()}, str(out_dir / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": vocab, "hidden_size": h, "intermediate_size": i,
        "num_hidden_layers": shape.layers, "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads, "head_dim": d, "hidden_act": "silu",
        "max_position_embeddings": shape.max_positions, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "float32",
        "bos_token_id": SPECIAL.index("<s>"), "eos_token_id": SPECIAL.index("</s>"),
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=1))


def write_adapter(out_dir: Path, shape: TinyModelShape, seed: int) -> None:
    """A PEFT LoRA adapter on all seven projections with non-zero A and B."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    h, i, d = shape.hidden, shape.intermediate, shape.hidden // shape.heads
    kv = shape.kv_heads * d
    dims = {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    w: dict[str, torch.Tensor] = {}
    for layer in range(shape.layers):
        for name, (fin, fout) in dims.items():
            part = "self_attn" if name in LORA_TARGETS[:4] else "mlp"
            p = f"base_model.model.model.layers.{layer}.{part}.{name}."
            w[p + "lora_A.weight"] = torch.randn(shape.rank, fin, generator=g) * 0.2
            w[p + "lora_B.weight"] = torch.randn(fout, shape.rank, generator=g) * 0.2
    save_file(w, str(out_dir / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": shape.rank, "lora_alpha": 2 * shape.rank,
              "target_modules": list(LORA_TARGETS), "lora_dropout": 0.0, "bias": "none",
              "task_type": "CAUSAL_LM", "base_model_name_or_path": None}
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=1))


def build_demo_assets(root: Path, shape: TinyModelShape | None = None) -> tuple[Path, list[Path]]:
    """Write the tiny tokenizer + model into ``root`` and two adapters into
    ``root/adapters/a`` and ``root/adapters/b``; return their paths (``LLM(root)`` loads
    the model)."""
    shape = shape or TinyModelShape()
    root.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(root)
    write_model(root, vocab, shape)
    adapters = [root / "adapters" / name for name in ("a", "b")]
    for k, path in enumerate(adapters):
        write_adapter(path, shape, seed=100 + k)
    return root, adapters


TINY_PROMPTS = [
    "the engine reads the prompt and",
    "a sum in floating point depends on",
    "the user asks a question and",
    "every token is chosen from the logits of",
    "a guardrail model that says yes today",
    "small models are quick to build and",
    "detlora fixes the order of every sum",
    "a trainer that replays a rollout must see",
]


CHAT_PROMPTS = [
    "What is the capital of France?",
    "Name three colors.",
    "Is the sky green? Answer yes or no.",
    "What is 2 + 2?",
    "Write a haiku about the sea.",
    "Give me one word that means happy.",
    "Which language is spoken in Spain?",
    "Explain gravity in one sentence.",
]

# What a verdict means at each level (printed under the table).
MEANING = {
    "batch_invariant": "promises the same bits for the same request whatever the batch: "
                       "every check must say identical",
    "run_to_run": "promises the same bits for the same batch run again: 'repeat' must say "
                  "identical; DIFFERS elsewhere is expected (a request's bits depend on its "
                  "batch)",
    "fast": "promises nothing: DIFFERS anywhere is expected (atomic Split-K, vendor GEMMs)",
}


@dataclass(frozen=True)
class CheckResult:
    check: str
    level: str
    comparisons: int
    differing: int  # outputs whose token ids or logprobs differ from the reference
    differing_tokens: int  # outputs whose token ids differ
    note: str = ""  # what this level's run did (preemptions, cached tokens): levels differ


def _same(a, b) -> bool:
    x, y = a.outputs[0], b.outputs[0]
    return x.token_ids == y.token_ids and x.logprobs == y.logprobs


def write_random_adapter(out_dir: Path, model_dir: Path, *, rank: int, seed: int,
                         b_std: float) -> None:
    """A PEFT LoRA adapter on all seven projections of the model in ``model_dir`` (read
    from its config.json), A ~ N(0, 1/fan_in) and B ~ N(0, b_std^2)."""
    from safetensors.torch import save_file

    from detlora.models.loader import lora_target_shapes_of
    from detlora.models.spec import ModelSpec

    spec = ModelSpec.from_dir(model_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    # Every target the model offers among the seven (its names and shapes: a layer that
    # reads another's K/V has no k/v projection; each layer its own head size); a hybrid's
    # own projections (Mamba in_proj, attention, up/down).
    targets = HYBRID_LORA_TARGETS if spec.hybrid is not None else LORA_TARGETS
    w: dict[str, torch.Tensor] = {}
    for module, (fin, fout) in lora_target_shapes_of(spec).items():
        if module.rpartition(".")[2] not in targets:
            continue
        p = f"base_model.model.{module}."
        w[p + "lora_A.weight"] = torch.randn(rank, fin, generator=g) / fin ** 0.5
        w[p + "lora_B.weight"] = torch.randn(fout, rank, generator=g) * b_std
    save_file(w, str(out_dir / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
              "target_modules": list(targets), "lora_dropout": 0.0, "bias": "none",
              "task_type": "CAUSAL_LM", "base_model_name_or_path": None}
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=1))


@dataclass(frozen=True)
class DemoModel:
    """What the demo runs: a model directory, its adapters, prompts and a description."""

    model_dir: Path
    adapters: list[Path]
    prompts: list[Any]  # text, or chat messages
    description: str
    max_lora_rank: int


REAL_RANK = 8
# Tokens of the demo's largest step (its prompts are a few dozen tokens): bounds the step
# graphs a GPU engine captures at start.
_DEMO_STEP_TOKENS = 512


def prepare_model(model: str, root: Path, *, dtype: torch.dtype) -> DemoModel:
    """``tiny``: the built-in random model; ``smollm2``: the embedded real model; else a
    model directory, Hub id or .gguf file. Real models get two random adapters (rank 8)."""
    if model == "tiny":
        model_dir, adapters = build_demo_assets(root)
        return DemoModel(model_dir, adapters, list(TINY_PROMPTS),
                         "random tiny Llama (2 layers, hidden 64) + 2 LoRA adapters", 8)
    from detlora.models.spec import ModelSpec

    if model == "smollm2":
        from detlora.models.embedded import NAME, smollm2_model_dir

        source, name = smollm2_model_dir(dtype), NAME
    else:
        from detlora.models.sources import resolve_model

        source, name = resolve_model(model, dtype=dtype), model
    spec = ModelSpec.from_dir(source)
    adapters = [root / "adapters" / n for n in ("a", "b")]
    for k, path in enumerate(adapters):
        write_random_adapter(path, source, rank=REAL_RANK, seed=100 + k, b_std=0.02)
    prompts = [[{"role": "user", "content": text}] for text in CHAT_PROMPTS]
    return DemoModel(source, adapters, prompts,
                     f"{name} ({spec.num_layers} layers, hidden {spec.hidden_size}) + 2 "
                     "random LoRA adapters", REAL_RANK)


def run_demo(
    *, model: str = "smollm2", quick: bool = False, levels: Sequence[str] | None = None,
    device: str = "auto", engine: Mapping[str, Any] | None = None, save: Path | None = None,
    log: Callable[[str], None] = print,
) -> list[CheckResult]:
    """Run every check at every level; ``engine``: further ``LLM`` arguments (device, dtype,
    ...) for every engine the demo builds; ``save``: a directory to keep the model and the
    adapters in (``LLM(save)`` loads the model; the adapters are in ``save/adapters``)."""
    import logging
    import os

    from detlora.config import SamplingParams
    from detlora.engine.llm_engine import conversion_dtype, resolve_device
    from detlora.entrypoints.llm import LLM
    from detlora.log import get_logger
    from detlora.lora.request import LoRARequest

    if "DETLORA_LOGGING_LEVEL" not in os.environ:  # the demo's table is its report
        get_logger("detlora").setLevel(logging.WARNING)
    engine = {"device": device, **(engine or {})}
    device = engine["device"]
    on_gpu = resolve_device(device).type == "cuda"
    if levels is None:
        levels = ["batch_invariant", "run_to_run", "fast"] if on_gpu \
            else ["batch_invariant", "run_to_run"]
    started = time.perf_counter()
    results: list[CheckResult] = []
    # Seven checks a level; a bar on stderr when it is a terminal.
    bar = tqdm(total=7 * len(levels), desc="demo checks", unit="check",
               disable=not sys.stderr.isatty(), leave=False)
    with tempfile.TemporaryDirectory(prefix="detlora-demo-") as tmp:
        root = Path(tmp)
        dtype = conversion_dtype(engine.get("dtype", "auto"), resolve_device(device))
        demo = prepare_model(model, root / "assets", dtype=dtype)
        if model != "tiny" and not on_gpu:
            # A real model through the CPU's batch-invariant torch code: a few short requests
            # (each check runs them again several times).
            prompts, max_tokens = demo.prompts[:4], 8
        else:
            prompts = demo.prompts[:6] if quick else demo.prompts
            max_tokens = 12 if quick else 24
        n = len(prompts)
        model_dir = str(demo.model_dir)
        loras = [LoRARequest(name, k + 1, str(path))
                 for k, (name, path) in enumerate(zip("ab", demo.adapters, strict=True))]
        mixed = [loras[k % 2] if k % 3 else None for k in range(n)]
        # Greedy for half the prompts, seeded sampling for the rest; logprobs for all.
        params = [
            SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0)
            if k % 2 == 0 else
            SamplingParams(max_tokens=max_tokens, logprobs=0, temperature=0.8, top_p=0.9,
                           seed=1000 + k)
            for k in range(n)
        ]
        lora_args = dict(enable_lora=True, max_loras=2, max_lora_rank=demo.max_lora_rank)
        log(f"detlora demo: {demo.description}, {'cuda' if on_gpu else 'cpu'}; {n} prompts "
            f"x up to {max_tokens} tokens, greedy and seeded sampling; token ids and logprobs "
            "compared bit for bit")
        for li, level in enumerate(levels):
            # The checks below recompute every prompt; the last one turns the cache on.
            # CUDA graphs for the demo's few sequences only: each graph is a capture at start.
            llm = LLM(model_dir, determinism=level, enable_prefix_caching=False, **lora_args,
                      **{"max_num_seqs": n, "max_num_batched_tokens": _DEMO_STEP_TOKENS,
                         **engine})
            alone = [llm.generate(prompts[k], params[k], mixed[k], use_tqdm=False)[0]
                     for k in range(n)]
            if li == 0:
                _show_answers(prompts, alone, params, mixed, log)

            def batched(order: Sequence[int], size: int, llm=llm) -> list:
                outs: dict[int, object] = {}
                for lo in range(0, len(order), size):
                    idx = list(order[lo: lo + size])
                    got = llm.generate([prompts[k] for k in idx], [params[k] for k in idx],
                                       [mixed[k] for k in idx], use_tqdm=False)
                    outs.update(zip(idx, got, strict=True))
                return [outs[k] for k in range(n)]

            def record(check: str, outs: list, ref: list = alone, level=level,
                       note: str = "") -> None:
                pairs = list(zip(ref, outs, strict=True))
                diff = sum(not _same(a, b) for a, b in pairs)
                toks = sum(a.outputs[0].token_ids != b.outputs[0].token_ids for a, b in pairs)
                results.append(CheckResult(check, level, n, diff, toks, note))
                bar.update(1)

            full = batched(range(n), n)
            record("repeat: same batch twice", batched(range(n), n), full)
            for size in (2, n) if quick else (2, 4, n):
                record(f"batch of {size} vs alone", batched(range(n), size))
            record("reverse arrival order vs alone", batched(range(n - 1, -1, -1), n))
            record("mixed adapters in one batch vs alone", full)
            # Room for one sequence at a time, so that others are preempted.
            longest = max(len(o.prompt_token_ids) for o in alone) + max_tokens
            # Eager steps: the engines below check scheduling, not graphs (at batch_invariant
            # an eager step has a graph's bits), and skip a capture each.
            small = LLM(model_dir, determinism=level, num_kv_blocks=max(16, longest // 4 + 2),
                        block_size=4, max_num_batched_tokens=16, enable_prefix_caching=False,
                        **lora_args, **{**engine, "enforce_eager": True})
            pre = small.generate(prompts, params, mixed, use_tqdm=False)
            record("preempted, chunked vs alone", pre,
                   note=f"{small.engine.scheduler.num_preemptions} preemptions")
            # A second turn: each prompt followed by its answer, run again. With the cache its
            # K/V pages (written in the batched prefill and decode steps) are reused.
            turns = [o.prompt_token_ids + o.outputs[0].token_ids for o in full]
            turn_alone = [llm.generate(turns[k], params[k], mixed[k], use_tqdm=False)[0]
                          for k in range(n)]
            # A fixed KV cache: on a GPU ``llm`` still holds most of the memory.
            longest = max(len(t) for t in turns) + max_tokens
            cached = LLM(model_dir, determinism=level, max_num_seqs=n,
                         num_kv_blocks=max(256, 2 * n * (longest // 16 + 1)),
                         enable_prefix_caching=True, **lora_args,
                         **{**engine, "enforce_eager": True})
            cached.generate(prompts, params, mixed, use_tqdm=False)
            reused = cached.generate(turns, params, mixed, use_tqdm=False)
            hits = sum(o.num_cached_tokens for o in reused)
            record("second turn on cached pages vs alone", reused, turn_alone,
                   note=f"{hits} cached tokens")
            # Free this level's engines before the next sizes its KV cache from free memory
            # (``batched`` holds ``llm`` as a default argument).
            for e in (llm, small, cached):
                e.shutdown()
            del llm, small, cached, batched
            gc.collect()
        if save is not None:
            _save(demo, Path(save), log)
    bar.close()
    _print_table(results, levels, log)
    log(f"({time.perf_counter() - started:.1f} s)")
    return results


def _show_answers(prompts: list, outs: list, params: list, mixed: list,
                  log: Callable[[str], None]) -> None:
    """What the model answered, one line per prompt (the first level's reference run)."""
    log("")
    for prompt, out, sp, lora in zip(prompts, outs, params, mixed, strict=True):
        text = prompt[-1]["content"] if isinstance(prompt, list) else prompt
        how = "greedy" if sp.greedy else f"sampled, seed {sp.seed}"
        answer = " ".join(out.outputs[0].text.split())
        log(f"  [{lora.lora_name if lora else 'base'}, {how}] {text!r} -> {answer!r}")


def _save(demo: DemoModel, dest: Path, log: Callable[[str], None]) -> None:
    """Copy the model directory into ``dest`` and the adapters into ``dest/adapters``."""
    if dest.exists() and any(dest.iterdir()):
        raise FileExistsError(f"--save {dest}: the directory is not empty")
    shutil.copytree(demo.model_dir, dest, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns(".complete", "adapters"))
    for path in demo.adapters:
        shutil.copytree(path, dest / "adapters" / path.name)
    log(f"saved: the model in {dest} (LLM({str(dest)!r})), adapters in "
        f"{dest / 'adapters'} ({', '.join(p.name for p in demo.adapters)})")


def _print_table(results: list[CheckResult], levels: Sequence[str],
                 log: Callable[[str], None]) -> None:
    checks = list(dict.fromkeys(r.check for r in results))
    rows = []
    for check in checks:
        found = [next(x for x in results if x.check == check and x.level == lv) for lv in levels]
        # A note all levels share (preemptions, cached tokens) goes with the check's name.
        shared = len({r.note for r in found}) == 1
        cells = []
        for r in found:
            cell = "identical" if r.differing == 0 else \
                f"DIFFERS {r.differing}/{r.comparisons} ({r.differing_tokens} in tokens)"
            cells.append(f"{cell} ({r.note})" if r.note and not shared else cell)
        label = f"{check} ({found[0].note})" if shared and found[0].note else check
        rows.append([label, *cells])
    header = ["check", *levels]
    widths = [max(len(row[c]) for row in [header, *rows]) + 2 for c in range(len(header))]
    log("")
    for row in [header, *rows]:
        log("".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    log("(DIFFERS k/n: k of n outputs changed their logprobs or token ids)")
    for lv in levels:
        verdict = _verdict(results, lv)
        log(f"{lv}: {verdict} -- {MEANING.get(lv, '')}")


def _verdict(results: list[CheckResult], level: str) -> str:
    mine = [r for r in results if r.level == level]
    differing = [r for r in mine if r.differing]
    if level == "batch_invariant":
        return "PASS" if not differing else "FAIL (a promise is broken: please report it)"
    if level == "run_to_run":
        repeat = next(r for r in mine if r.check.startswith("repeat"))
        return "PASS" if not repeat.differing else "FAIL (a repeat differs: please report it)"
    return "as expected" if differing else "identical this time (no promise either way)"

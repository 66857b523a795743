"""lm-evaluation-harness against ``detlora serve`` with no network: YAML tasks over local
JSON-lines data, one per output type (multiple choice -> loglikelihood, loglikelihood_rolling,
generate_until), and a run of lm-eval that writes its per-sample logs as ``lm-eval run
--log_samples --output_path OUT`` writes them (the evals suite and the CPU test use it).

lm-eval 0.4.x sends, per loglikelihood request, ``{"model", "prompt": [token ids of context +
continuation], "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": true}``
and sums ``token_logprobs[ctxlen:-1]`` of the answer; per generation ``{"prompt": [token
ids], "max_tokens", "temperature", "stop", "seed", ...}`` (chat: ``"messages"``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

MC_DOCS = [
    {"question": "Is the customer angry?", "choices": ["yes", "no", "maybe", "calm"],
     "answer": 0},
    {"question": "The state of the world is", "choices": ["calm", "angry", "toxic", "café"],
     "answer": 0},
    {"question": "Pick a letter:", "choices": ["A", "B", "C", "D"], "answer": 2},
    {"question": "Is this comment toxic?", "choices": ["no", "yes", "3", "naïve façade"],
     "answer": 1},
]
ROLLING_DOCS = [
    {"text": "the state of the world is calm and the customer is angry ."},
    {"text": 'yes no yes no maybe {"answer": "yes", "score": 3, "ok": true}'},
    {"text": "Question: Options: Answer with one label. State: 東京 naïve"},
]
GEN_DOCS = [
    {"question": "Is the customer angry? Answer:", "answer": "yes"},
    {"question": "The state of the world is", "answer": "calm"},
    {"question": "Options: A B C D E. Answer with one label:", "answer": "C"},
]

MC_TASK = "detlora_mc"
ROLLING_TASK = "detlora_rolling"
GEN_TASK = "detlora_gen"


def _dataset(data: Path, cache: Path) -> str:
    """A task's data: a local JSON-lines file, its datasets cache beside it (no network)."""
    return (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n"
            f"    test: {json.dumps(str(data))}\n  cache_dir: {json.dumps(str(cache))}\n"
            "test_split: test\n")


def write_tasks(root: Path, *, mc_docs: list[dict] | None = None,
                rolling_docs: list[dict] | None = None,
                gen_docs: list[dict] | None = None) -> Path:
    """The three tasks' YAML and data under ``root`` (the directory for ``include_path``);
    the ``*_docs`` replace the small built-in sets."""
    root.mkdir(parents=True, exist_ok=True)
    cache = root / "hf_datasets_cache"
    for name, docs in ((MC_TASK, mc_docs or MC_DOCS),
                       (ROLLING_TASK, rolling_docs or ROLLING_DOCS),
                       (GEN_TASK, gen_docs or GEN_DOCS)):
        (root / f"{name}.jsonl").write_text(
            "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs), encoding="utf-8")
    (root / f"{MC_TASK}.yaml").write_text(
        f"task: {MC_TASK}\noutput_type: multiple_choice\n"
        + _dataset(root / f"{MC_TASK}.jsonl", cache)
        + 'doc_to_text: "Question: {{question}}\\nAnswer:"\n'
        "doc_to_choice: \"{{choices}}\"\ndoc_to_target: answer\n"
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\nmetadata:\n  version: 1.0\n",
        encoding="utf-8")
    (root / f"{ROLLING_TASK}.yaml").write_text(
        f"task: {ROLLING_TASK}\noutput_type: loglikelihood_rolling\n"
        + _dataset(root / f"{ROLLING_TASK}.jsonl", cache)
        + 'doc_to_text: ""\ndoc_to_target: "{{text}}"\n'
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n"
        "  - metric: bits_per_byte\nmetadata:\n  version: 1.0\n", encoding="utf-8")
    (root / f"{GEN_TASK}.yaml").write_text(
        f"task: {GEN_TASK}\noutput_type: generate_until\n"
        + _dataset(root / f"{GEN_TASK}.jsonl", cache)
        + 'doc_to_text: "{{question}}"\ndoc_to_target: "{{answer}}"\n'
        "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 8\n  temperature: 0\n"
        "metric_list:\n  - metric: exact_match\nmetadata:\n  version: 1.0\n", encoding="utf-8")
    return root


def run_lm_eval(task_dir: Path, tasks: list[str], out: Path, *, model: str, base_url: str,
                tokenizer: Path, num_concurrent: int, chat: bool = False,
                max_length: int = 256) -> dict[str, Path]:
    """lm-eval's ``local-completions`` (or ``local-chat-completions`` with the chat template)
    on ``tasks``, its per-sample logs written as ``--log_samples --output_path out`` writes
    them; returns {task: its samples file}."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import lm_eval
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.tasks import TaskManager

    if chat:
        args = (f"model={model},base_url={base_url}/v1/chat/completions,"
                f"num_concurrent={num_concurrent},max_retries=1,timeout=120")
    else:
        args = (f"model={model},base_url={base_url}/v1/completions,tokenizer={tokenizer},"
                f"tokenizer_backend=huggingface,num_concurrent={num_concurrent},"
                f"max_length={max_length},max_retries=1,timeout=120")
    tracker = EvaluationTracker(output_path=str(out))
    results = lm_eval.simple_evaluate(
        model="local-chat-completions" if chat else "local-completions", model_args=args,
        tasks=tasks, log_samples=True, evaluation_tracker=tracker, apply_chat_template=chat,
        task_manager=TaskManager(include_path=str(task_dir), include_defaults=False))
    assert results is not None
    samples = results.pop("samples")
    tracker.save_results_aggregated(results=results, samples=samples)
    for name in results["configs"]:
        tracker.save_results_samples(task_name=name, samples=samples[name])
    files = {}
    for name in tasks:
        found = sorted(out.rglob(f"samples_{name}_*.jsonl"))
        assert len(found) == 1, found
        files[name] = found[0]
    return files

"""Evaluations through the server: lm-evaluation-harness's requests against ``detlora serve``,
their repeatability across concurrency and their throughput against offline scoring.

Model: SmolLM2-135M-Instruct (``smollm2``, the embedded model; ``--model`` names another
directory), ``batch_invariant``. Tasks (``benchmarks.harness.lm_eval_runs``, local files):
a multiple-choice task of ``questions`` two-number sums generated from a seeded RNG (four
numeric choices each: ``questions`` x 4 loglikelihood requests), a loglikelihood_rolling task
and a generate_until task of 50 short documents each.

1. The loglikelihood requests of the multiple-choice task, tokenized as lm-eval's
   ``local-completions`` does (context + continuation, trailing spaces moved to the
   continuation), scored offline in a process of its own: ``LLM.generate`` of all of them
   (``prompt_logprobs=1``, ``max_tokens=1``), requests/s as the median of ``trials``, and each
   request's (loglikelihood, is_greedy) computed as lm-eval computes them from the answer.
2. The server; a client sends the same requests with lm-eval's bodies (``echo``,
   ``logprobs=1``, ``max_tokens=1``, token-id prompts) at concurrency 1 and 64:
   requests/s, ``vs_offline`` (at 64, the issue's target >= 0.8), and ``differing``:
   answers whose loglikelihood or is_greedy differ from offline. This part needs no lm-eval.
3. lm-eval 0.4.13 itself where it imports (on the GPU machine its wheels travel in ``.whl/``:
   benchmarks/README.md): ``local-completions`` for each task and ``local-chat-completions``
   for the generation task, at ``num_concurrent`` 1 and 64: requests/s over each run, and
   ``differing``: samples whose ``--log_samples`` line differs from concurrency 1's (at
   concurrency 1, for the multiple-choice task: samples whose loglikelihoods differ from
   offline; else null).

    python -m benchmarks.suites.evals --out out/evals.json [--smoke]

Schema: {"meta", "lm_eval": version or null, "offline_requests_per_s",
"rows": [{"model", "task_type", "client", "concurrency", "requests_per_s", "vs_offline",
"samples", "differing"}]}; ``task_type``: loglikelihood, loglikelihood_rolling,
generate_until, chat_generate_until; ``client``: "http" (part 2) or "lm-eval" (part 3);
``samples``: requests (http) or documents (lm-eval).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.harness.lm_eval_runs import (
    GEN_TASK,
    MC_TASK,
    ROLLING_TASK,
    run_lm_eval,
    write_tasks,
)


@dataclass(frozen=True)
class Plan:
    questions: int = 500
    documents: int = 50  # rolling and generation
    concurrency: tuple[int, ...] = (1, 64)
    trials: int = 3
    max_model_len: int = 2048
    max_gen_toks: int = 32
    smoke: bool = False

    @classmethod
    def smoke_plan(cls) -> Plan:
        return cls(questions=12, documents=4, concurrency=(1, 4), trials=1, max_model_len=256,
                   max_gen_toks=6, smoke=True)


# ---- the tasks ----

def mc_docs(n: int, seed: int = 0) -> list[dict]:
    """``n`` questions "What is a + b?" with the sum and three near misses, shuffled by a
    seeded RNG (the same list on every machine)."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        a, b = rng.randrange(10, 100), rng.randrange(10, 100)
        wrong = rng.sample([d for d in range(-9, 10) if d], 3)
        choices = [str(a + b), *(str(a + b + d) for d in wrong)]
        order = list(range(4))
        rng.shuffle(order)
        docs.append({"question": f"What is {a} + {b}?", "choices": [choices[i] for i in order],
                     "answer": order.index(0)})
    return docs


WORDS = ("the", "state", "of", "world", "is", "calm", "and", "customer", "angry", "while", "a",
         "comment", "may", "be", "toxic", "or", "kind", "every", "answer", "has", "one",
         "label")


def text_docs(n: int, seed: int = 1) -> tuple[list[dict], list[dict]]:
    """(rolling documents, generation prompts): ``n`` of each, seeded word sequences."""
    rng = random.Random(seed)
    rolling = [{"text": " ".join(rng.choice(WORDS) for _ in range(rng.randrange(20, 60)))}
               for _ in range(n)]
    gen = [{"question": "Continue: " + " ".join(rng.choice(WORDS) for _ in range(12)),
            "answer": rng.choice(WORDS)} for _ in range(n)]
    return rolling, gen


def loglikelihood_requests(tokenizer: Any, docs: list[dict]) -> list[tuple[list[int], int]]:
    """(token ids, context length) of every (question, choice) as lm-eval's local-completions
    sends it: ``_encode_pair`` of "Question: ...\\nAnswer:" and " choice"."""
    out = []
    for doc in docs:
        context = f"Question: {doc['question']}\nAnswer:"
        for choice in doc["choices"]:
            cont = f" {choice}"
            spaces = len(context) - len(context.rstrip())
            ctx = context[: len(context) - spaces] if spaces else context
            cont = context[len(ctx):] + cont
            whole = tokenizer(ctx + cont, add_special_tokens=False)["input_ids"]
            n_ctx = len(tokenizer(ctx, add_special_tokens=False)["input_ids"])
            out.append((list(whole), n_ctx))
    return out


def answer_of(token_logprobs: list, top_logprobs: list, ctxlen: int) -> tuple[float, bool]:
    """lm-eval's ``parse_logprobs`` of one echoed answer (prompt tokens + one generated)."""
    picked = token_logprobs[ctxlen:-1]
    greedy = all(t == max(top.values()) for t, top in zip(picked, top_logprobs[ctxlen:-1],
                                                           strict=True))
    return sum(picked), greedy


# ---- offline ----

def offline_part(model: str, requests_path: Path, out: Path, plan: Plan) -> None:
    """Score the requests offline (timed), and write each answer as lm-eval would read it
    from the server (the server's top-1 rule: the best other token, or the scored one)."""
    from detlora import LLM, SamplingParams

    reqs = json.loads(requests_path.read_text())
    device = "cpu" if plan.smoke else None
    llm = LLM(model, **({"device": device} if device else {}), max_model_len=plan.max_model_len)
    sp = SamplingParams(temperature=0.0, max_tokens=1, logprobs=1, prompt_logprobs=1,
                        seed=1234)
    prompts = [ids for ids, _ in reqs]
    llm.generate(prompts[: min(64, len(prompts))], sp, use_tqdm=False)  # warm-up
    times, outs = [], None
    for _ in range(plan.trials):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        times.append(time.perf_counter() - t0)
    answers = []
    for (ids, ctx), o in zip(reqs, outs, strict=True):
        lps = [None] + [d[t].logprob for d, t in zip(o.prompt_logprobs[1:], ids[1:],
                                                     strict=True)]
        tops = [None] + [_top1(d) for d in o.prompt_logprobs[1:]]
        answers.append(answer_of([*lps, 0.0], [*tops, None], ctx))
    out.write_text(json.dumps({"requests_per_s": len(prompts) / statistics.median(times),
                               "answers": answers}))
    llm.shutdown()


def _top1(entry: dict) -> dict[int, float]:
    """The server's top_logprobs entry for logprobs=1: the best token other than the scored
    one when the scored one is not the best, else the scored one."""
    items = [(t, v.logprob) for t, v in entry.items()]
    best = items[1:] if len(items) > 1 else items
    return dict(best)


# ---- the server and the http client ----

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, plan: Plan, log: Path) -> tuple[str, subprocess.Popen]:
    import httpx

    port = _free_port()
    cmd = [sys.executable, "-m", "detlora.entrypoints.cli", "serve", model, "--port",
           str(port), "--max-model-len", str(plan.max_model_len), "--max-queued-requests",
           "4096", "--log-level", "warning", *(["--device", "cpu"] if plan.smoke else [])]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("the server exited: " + log.read_text()[-3000:])
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return url, proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the server did not start")


async def _send_all(url: str, model: str, reqs: list, concurrency: int) -> list:
    import httpx

    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        async def one(ids: list[int], ctx: int) -> tuple[float, bool]:
            body = {"model": model, "prompt": [ids], "temperature": 0, "max_tokens": 1,
                    "logprobs": 1, "seed": 1234, "echo": True}
            async with sem:
                r = await client.post("/v1/completions", json=body)
            r.raise_for_status()
            lp = r.json()["choices"][0]["logprobs"]
            return answer_of(lp["token_logprobs"], lp["top_logprobs"], ctx)

        return await asyncio.gather(*(one(ids, ctx) for ids, ctx in reqs))


def http_rows(url: str, model: str, name: str, reqs: list, offline: dict,
              plan: Plan) -> list[dict]:
    rows = []
    want = [tuple(a) for a in offline["answers"]]
    for c in plan.concurrency:
        asyncio.run(_send_all(url, model, reqs[: min(len(reqs), 2 * c)], c))  # warm-up
        t0 = time.perf_counter()
        got = asyncio.run(_send_all(url, model, reqs, c))
        rate = len(reqs) / (time.perf_counter() - t0)
        rows.append({"model": name, "task_type": "loglikelihood", "client": "http",
                     "concurrency": c, "requests_per_s": round(rate, 1),
                     "vs_offline": round(rate / offline["requests_per_s"], 3),
                     "samples": len(reqs),
                     "differing": sum(tuple(g) != w for g, w in zip(got, want, strict=True))})
        print(json.dumps(rows[-1]), flush=True)
    return rows


# ---- lm-eval ----

RUNS = (("loglikelihood", MC_TASK, False), ("loglikelihood_rolling", ROLLING_TASK, False),
        ("generate_until", GEN_TASK, False), ("chat_generate_until", GEN_TASK, True))


def lm_eval_rows(url: str, model: str, name: str, tokenizer: str, tasks: Path, work: Path,
                 offline: dict, plan: Plan) -> list[dict]:
    rows, first = [], {}
    for kind, task, chat in RUNS:
        for c in plan.concurrency:
            t0 = time.perf_counter()
            files = run_lm_eval(tasks, [task], work / f"{kind}-{c}", model=model, base_url=url,
                                tokenizer=Path(tokenizer), num_concurrent=c, chat=chat,
                                max_length=plan.max_model_len)
            seconds = time.perf_counter() - t0
            lines = files[task].read_text(encoding="utf-8").splitlines()
            requests = sum(len(json.loads(x)["arguments"]) for x in lines)
            if c == plan.concurrency[0]:
                first[kind] = lines
                differing = None
                if kind == "loglikelihood":
                    got = [(float(r[0][0]), r[0][1] == "True") for x in lines
                           for r in json.loads(x)["resps"]]
                    want = [tuple(a) for a in offline["answers"]]
                    per = len(got) // max(1, len(lines))
                    differing = sum(got[i * per:(i + 1) * per] != want[i * per:(i + 1) * per]
                                    for i in range(len(lines)))
            else:
                differing = sum(a != b for a, b in zip(lines, first[kind], strict=True))
            rate = requests / seconds
            rows.append({"model": name, "task_type": kind, "client": "lm-eval",
                         "concurrency": c, "requests_per_s": round(rate, 1),
                         "vs_offline": round(rate / offline["requests_per_s"], 3)
                         if kind == "loglikelihood" else None,
                         "samples": len(lines), "differing": differing})
            print(json.dumps(rows[-1]), flush=True)
    return rows


# ---- the whole run ----

def _model(plan: Plan, root: Path) -> tuple[str, str, str]:
    """(model directory, its name in the results, tokenizer directory)."""
    if plan.smoke:
        from benchmarks.suites.serving import Plan as ServingPlan
        from benchmarks.suites.serving import write_assets

        write_assets(root, ServingPlan.smoke().shape())
        return str(root / "model"), "tiny", str(root / "model")
    from detlora.engine.model_files import resolve_model_files
    from detlora.engine_args import EngineArgs

    files = resolve_model_files(EngineArgs(model="smollm2"))
    assert files.tokenizer_dir is not None, "the model needs a tokenizer"
    return files.args.model, "SmolLM2-135M-Instruct", files.tokenizer_dir


def run(plan: Plan, model: str | None = None) -> dict:
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="evals-") as tmp:
        root = Path(tmp)
        if model is None:
            model_dir, name, tok_dir = _model(plan, root)
        else:
            model_dir, name, tok_dir = model, Path(model).name, model
        tok = AutoTokenizer.from_pretrained(tok_dir)
        docs = mc_docs(plan.questions)
        rolling, gen = text_docs(plan.documents)
        tasks = write_tasks(root / "tasks", mc_docs=docs, rolling_docs=rolling, gen_docs=gen)
        if plan.max_gen_toks != 8:
            y = tasks / f"{GEN_TASK}.yaml"
            y.write_text(y.read_text().replace("max_gen_toks: 8", f"max_gen_toks: "
                                               f"{plan.max_gen_toks}"))
        reqs = loglikelihood_requests(tok, docs)
        (root / "requests.json").write_text(json.dumps(reqs))
        cmd = [sys.executable, "-m", "benchmarks.suites.evals", "--offline-part", model_dir,
               str(root / "requests.json"), str(root / "offline.json"),
               *(["--smoke"] if plan.smoke else [])]
        subprocess.run(cmd, check=True)
        offline = json.loads((root / "offline.json").read_text())
        print(f"offline: {offline['requests_per_s']:.1f} requests/s", flush=True)
        url, proc = start_server(model_dir, plan, root / "server.log")
        try:
            rows = http_rows(url, model_dir, name, reqs, offline, plan)
            version = None
            if importlib.util.find_spec("lm_eval") is not None:
                from importlib.metadata import version as _version

                version = _version("lm_eval")
                rows += lm_eval_rows(url, model_dir, name, tok_dir, tasks, root / "lm_eval",
                                     offline, plan)
            else:
                print("lm_eval is not installed: its rows are left out", flush=True)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    return {"lm_eval": version, "offline_requests_per_s": round(offline["requests_per_s"], 1),
            "rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="out/evals.json")
    p.add_argument("--smoke", action="store_true", help="a tiny model on the CPU: the whole "
                   "script in a few minutes (its figures mean nothing)")
    p.add_argument("--model", help="a model directory instead of SmolLM2")
    p.add_argument("--offline-part", nargs=3, metavar=("MODEL", "REQUESTS", "OUT"),
                   help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    plan = Plan.smoke_plan() if args.smoke else Plan()
    if args.offline_part:
        model, reqs, out = args.offline_part
        offline_part(model, Path(reqs), Path(out), plan)
        return 0
    from benchmarks.harness import results_meta, write_results

    t0 = time.time()
    result = run(plan, args.model)
    command = "python -m benchmarks.suites.evals" + (" --smoke" if args.smoke else "")
    write_results(args.out, {"meta": {**results_meta(command),
                                      "seconds": round(time.time() - t0, 1)}, **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())

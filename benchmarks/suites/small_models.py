"""Small models and short requests (issue 51): a guardrail or classifier at GPU speed.

Models: SmolLM2-135M-Instruct (``smollm2``: the embedded real model and the demo's adapter
``a``), the Qwen3-0.6B shape (``qwen3_0.6b``: hidden 1024, 28 layers, 16 / 8 heads of 128,
intermediate 3072, vocab 151936, tied embeddings, random bf16 weights; a rank-16 adapter on
all seven projections; a word-level tokenizer over its vocabulary with a chat template), and
for one serving figure the engine suite's Llama-3.2-3B shape (``3b``). Every request runs on
the model's adapter, at ``batch_invariant`` unless a level says otherwise, default engine
settings otherwise.

Parts (``--parts``, all by default):

``levels``
    TPOT at ``batch_invariant`` and ``fast``, batch 1 and 64 (16-token prompts, 64 output
    tokens, EOS ignored; TPOT = (t(N) - t(1)) / (N - 1), median of trials).
``offline``
    ``one_token``: 2,000 one-token generations of ~15-token text prompts in one
    ``LLM.generate`` call (greedy, the token's logprob); ``decide``: ``LLM.decide`` over
    2,000 states (~15 tokens each, one noul question, shared instructions): per_s is
    questions answered a second. Each checked against the same requests alone (the first
    ``alone_checks``); the references of the server part come from here, with the offline
    batch-64 throughput of 256 requests x 150 tokens (100-token prompts; half greedy, half
    seeded top-p; logprobs).
``server``
    ``detlora serve`` on SmolLM2 (and the 3B shape's 150-token streams): ``/v1/decisions``
    at concurrency 64 and 256, one-token ``/v1/completions`` at 64 (not streamed), 256
    completions of 150 tokens at 64 streamed (``stream_150``) and not (``plain_150``) against
    offline batch 64 (``vs_offline``). ``differing``: answers whose probabilities, token ids
    or logprobs differ from the offline reference (each checked against the same request
    alone), bit for bit. Short requests go through ``benchmarks.harness.fast_client`` (a
    keep-alive HTTP client cheap enough for thousands of requests a second); streams through
    ``serving_load``. The server is measured with 1 and 4 front-end processes
    (``--api-server-count``); each row is the better one, its ``differing`` counted over
    both, and every measurement (with the clients' and the server processes' CPU shares) is
    in ``meta.server_diagnostics``.
``demo``
    ``detlora demo`` twice, the first time with an empty Triton cache directory
    (``TRITON_CACHE_DIR``), the second with the one the first filled: first-run and
    second-run seconds.

Schema: {"meta", "levels": [{"model", "level", "batch", "tpot_ms"}], "offline": [{"model",
"workload": "one_token" | "decide", "requests", "per_s"}], "server": [{"model", "workload":
"decisions" | "one_token" | "stream_150" | "plain_150", "concurrency", "per_s", "tok_s",
"vs_offline", "differing"}], "demo": [{"run", "seconds"}]}; ``meta`` also holds the offline
rows' alone checks (``offline_alone_differing``), the server's diagnostics and each part's
seconds.

    python -m benchmarks.suites.small_models --out out/small_models.json [--parts ...]
    python -m benchmarks.suites.small_models --smoke   # the whole script on a CPU, tiny models
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

KEY = "bench-key"
PARTS = ("levels", "offline", "server", "demo")
INSTRUCTIONS = "You moderate comments on a forum."
QUESTIONS = {"toxic": {"type": "noul", "criteria": "Is this comment toxic?"}}
WARMUP = 256  # requests kept apart for warm-ups


@dataclass(frozen=True)
class Plan:
    models: tuple[str, ...] = ("smollm2", "qwen3_0.6b")
    serve_model: str = "smollm2"
    reference_model: str | None = "3b"  # its stream_150 at the long concurrency
    requests: int = 2000  # one-token prompts and decide states
    prompt_tokens: int = 15
    alone_checks: int = 32
    batches: tuple[int, ...] = (1, 64)
    tpot_tokens: int = 64
    tpot_prompt: int = 16
    trials: int = 3
    decisions: tuple[tuple[int, int], ...] = ((64, 2000), (256, 2000))  # (concurrency, n)
    one_token: tuple[tuple[int, int], ...] = ((64, 2000),)
    long_requests: int = 256
    long_prompt: int = 100
    long_tokens: int = 150
    long_concurrency: int = 64
    client_processes: int = 8
    # Front-end processes (serve --api-server-count) the server is measured with; each row
    # is the best of them (the others in meta.server_diagnostics).
    api_server_counts: tuple[int, ...] = (1, 4)
    reference_counts: tuple[int, ...] = (1,)
    tiny: bool = False
    serve_args: tuple[str, ...] = ()

    @classmethod
    def smoke(cls) -> Plan:
        return cls(requests=48, prompt_tokens=8, alone_checks=4, batches=(1, 4),
                   tpot_tokens=6, tpot_prompt=6, trials=1, decisions=((8, 24), (16, 32)),
                   one_token=((8, 24),), long_requests=8, long_prompt=12, long_tokens=6,
                   long_concurrency=4, client_processes=2, api_server_counts=(1, 2),
                   tiny=True)


@dataclass
class Assets:
    name: str
    model_dir: Path
    adapter: Path
    rank: int
    vocab: int  # token ids prompts may use: [100, vocab)
    max_model_len: int | None = None
    engine: dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------------------ models


def _qwen3_shape(tiny: bool) -> dict[str, int]:
    if tiny:
        return dict(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128,
                    vocab=512)
    return dict(hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128,
                intermediate=3072, vocab=151936)


def write_qwen3(path: Path, s: dict[str, int], seed: int = 0) -> None:
    """A random bf16 checkpoint of the Qwen3 architecture (q/k norms, tied embeddings)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(seed)
    h, d = s["hidden"], s["head_dim"]
    q, kv, i = s["heads"] * d, s["kv_heads"] * d, s["intermediate"]

    def rnd(*size: int, std: float = 0.02) -> torch.Tensor:
        t = torch.randn(*size, generator=g, device=dev, dtype=torch.float32) * std
        return t.to(torch.bfloat16).cpu()

    w = {"model.embed_tokens.weight": rnd(s["vocab"], h),
         "model.norm.weight": 1 + rnd(h, std=0.05)}
    for layer in range(s["layers"]):
        p = f"model.layers.{layer}."
        w |= {p + "input_layernorm.weight": 1 + rnd(h, std=0.05),
              p + "post_attention_layernorm.weight": 1 + rnd(h, std=0.05),
              p + "self_attn.q_proj.weight": rnd(q, h), p + "self_attn.k_proj.weight": rnd(kv, h),
              p + "self_attn.v_proj.weight": rnd(kv, h), p + "self_attn.o_proj.weight": rnd(h, q),
              p + "self_attn.q_norm.weight": 1 + rnd(d, std=0.05),
              p + "self_attn.k_norm.weight": 1 + rnd(d, std=0.05),
              p + "mlp.gate_proj.weight": rnd(i, h), p + "mlp.up_proj.weight": rnd(i, h),
              p + "mlp.down_proj.weight": rnd(h, i)}
    save_file(w, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": s["vocab"],
        "hidden_size": h, "intermediate_size": i, "num_hidden_layers": s["layers"],
        "num_attention_heads": s["heads"], "num_key_value_heads": s["kv_heads"],
        "head_dim": d, "hidden_act": "silu", "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
        "attention_bias": False, "torch_dtype": "bfloat16", "bos_token_id": 1,
        "eos_token_id": 2}, indent=1))


def prepare(name: str, root: Path, plan: Plan) -> Assets:
    """The model directory, its adapter and what the workloads need of it."""
    from benchmarks.suites import engine, serving
    from detlora.entrypoints.demo import prepare_model, write_random_adapter

    root.mkdir(parents=True, exist_ok=True)
    if name == "smollm2":
        demo = prepare_model("tiny" if plan.tiny else "smollm2", root,
                             dtype=torch.float32 if plan.tiny else torch.bfloat16)
        from detlora.engine.tokenizer import Tokenizer

        vocab = len(Tokenizer(demo.model_dir).hf)
        return Assets(name, Path(demo.model_dir), Path(demo.adapters[0]), demo.max_lora_rank,
                      vocab)
    if name == "qwen3_0.6b":
        shape = _qwen3_shape(plan.tiny)
        write_qwen3(root / "model", shape)
        serving.write_tokenizer(root / "model", shape["vocab"])
        write_random_adapter(root / "adapter", root / "model", rank=16, seed=11, b_std=0.02)
        return Assets(name, root / "model", root / "adapter", 16, shape["vocab"])
    if name == "3b":
        shape = (engine.ModelShape(hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32,
                                   intermediate=256, vocab=2048) if plan.tiny
                 else engine.ModelShape())
        engine.write_model(root / "model", shape)
        serving.write_tokenizer(root / "model", shape.vocab)
        engine.write_adapter(root / "adapter", shape, seed=10)
        return Assets(name, root / "model", root / "adapter", shape.rank, shape.vocab,
                      max_model_len=plan.long_prompt + plan.long_tokens + 16)
    raise ValueError(f"unknown model {name!r}")


def _id_range(a: Assets) -> tuple[int, int]:
    """Token ids random prompts take: away from the special ids at both ends."""
    return min(100, a.vocab // 4), a.vocab - min(10, a.vocab // 8)


def engine_kwargs(a: Assets, plan: Plan, **kw: Any) -> dict[str, Any]:
    args: dict[str, Any] = dict(enable_lora=True, max_lora_rank=a.rank,
                                determinism="batch_invariant")
    if a.max_model_len is not None:
        args["max_model_len"] = a.max_model_len
    if plan.tiny:
        args["device"] = "cpu"
    return {**args, **kw}


# ------------------------------------------------------------------------------ workloads


@dataclass(frozen=True)
class Work:
    """The requests of one model: short texts (prompts and states) and the long bodies."""

    texts: list[str]
    states: list[str]
    long_prompts: list[list[int]]
    long_params: list[Any]


def make_work(a: Assets, plan: Plan, tokenizer: Any) -> Work:
    """Texts decoded from random token ids (~``prompt_tokens`` tokens each, distinct), and the
    long requests (token ids)."""
    from detlora import SamplingParams

    rng = random.Random(1234)
    hi = min(a.vocab, len(tokenizer.hf)) - 10
    lo = min(100, hi // 2)
    # Every timed request's text, then WARMUP more for warm-ups (never timed after).
    n = max(plan.requests, *(n for _, n in plan.decisions),
            *(n for _, n in plan.one_token)) + WARMUP

    def text(k: int) -> str:
        ids = [rng.randrange(lo, hi) for _ in range(plan.prompt_tokens)]
        return f"{k} " + tokenizer.decode(ids).strip()

    texts = [text(k) for k in range(n)]
    states = [text(k) for k in range(n)]
    long_prompts = [[rng.randrange(*_id_range(a)) for _ in range(plan.long_prompt)]
                    for _ in range(plan.long_requests)]
    common = dict(max_tokens=plan.long_tokens, ignore_eos=True, logprobs=0)
    long_params = [SamplingParams(**common, temperature=0.0) if k % 2 == 0 else
                   SamplingParams(**common, temperature=0.8, top_p=0.95, seed=k)
                   for k in range(plan.long_requests)]
    return Work(texts, states, long_prompts, long_params)


def _chosen(out: Any) -> tuple[list[int], list[float]]:
    c = out.outputs[0]
    return list(c.token_ids), [d[t].logprob for d, t in zip(c.logprobs, c.token_ids,
                                                           strict=True)]


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    _sync()
    t0 = time.perf_counter()
    out = fn()
    _sync()
    return time.perf_counter() - t0, out


def tpot_rows(llm: Any, a: Assets, plan: Plan, level: str, lora: Any) -> list[dict]:
    from detlora import SamplingParams

    rng = random.Random(5)
    rows = []
    for b in plan.batches:
        prompts = [[rng.randrange(*_id_range(a)) for _ in range(plan.tpot_prompt)]
                   for _ in range(b)]

        def run(n: int, prompts: list = prompts) -> Any:
            sp = SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)
            return llm.generate(prompts, sp, lora_request=lora, use_tqdm=False)

        run(plan.tpot_tokens)  # warm-up
        t1 = statistics.median(_timed(lambda: run(1))[0] for _ in range(plan.trials))
        tn = statistics.median(_timed(lambda: run(plan.tpot_tokens))[0]
                               for _ in range(plan.trials))
        rows.append({"model": a.name, "level": level, "batch": b,
                     "tpot_ms": round(1e3 * (tn - t1) / (plan.tpot_tokens - 1), 4)})
    return rows


@dataclass
class References:
    """What the server's answers must equal (each checked against the same request alone)."""

    one_token: list[tuple[list[int], list[float]]] = field(default_factory=list)
    decide: list[dict] = field(default_factory=list)
    long: list[tuple[list[int], list[float]]] = field(default_factory=list)
    fingerprint: str = ""
    long_tok_s: float = 0.0


def offline_part(llm: Any, a: Assets, plan: Plan, w: Work, lora: Any,
                 log: Callable[[str], None]) -> tuple[list[dict], dict, References]:
    from detlora import SamplingParams

    rows, alone_differing = [], {}
    refs = References()
    n = plan.requests
    sp = SamplingParams(max_tokens=1, temperature=0.0, logprobs=0)
    one = [max(n for _, n in plan.one_token), n]
    warm = w.texts[-WARMUP:]
    llm.generate(warm, sp, lora_request=lora, use_tqdm=False)
    seconds, outs = _timed(lambda: llm.generate(w.texts[:n], sp, lora_request=lora,
                                                use_tqdm=False))
    rows.append({"model": a.name, "workload": "one_token", "requests": n,
                 "per_s": round(n / seconds, 1)})
    alone = [llm.generate([t], sp, lora_request=lora, use_tqdm=False)[0]
             for t in w.texts[:plan.alone_checks]]
    alone_differing["one_token"] = sum(_chosen(x) != _chosen(y)
                                       for x, y in zip(alone, outs, strict=False))
    refs.one_token = [_chosen(o) for o in outs]
    if max(one) > n:  # the server's level takes more prompts than the timed call
        refs.one_token += [_chosen(o) for o in llm.generate(w.texts[n: max(one)], sp,
                                                             lora_request=lora, use_tqdm=False)]
    refs.fingerprint = outs[0].fingerprint
    log(f"{a.name} offline one_token: {rows[-1]['per_s']}/s, alone differing "
        f"{alone_differing['one_token']}/{len(alone)}")

    states = w.states
    count = max(n, *(k for _, k in plan.decisions))
    decide = lambda s: llm.decide(s, QUESTIONS, instructions=INSTRUCTIONS,
                                  lora_request=lora, use_tqdm=False)
    decide(states[-WARMUP:])  # warm-up (other states)
    seconds, ds = _timed(lambda: decide(states[:n]))
    rows.append({"model": a.name, "workload": "decide", "requests": n,
                 "per_s": round(n * len(QUESTIONS) / seconds, 1)})
    alone_d = [llm.decide(s, QUESTIONS, instructions=INSTRUCTIONS, lora_request=lora)
               for s in states[:plan.alone_checks]]
    alone_differing["decide"] = sum(x.answers != y.answers
                                    for x, y in zip(alone_d, ds, strict=False))
    refs.decide = [d.answers for d in ds]
    if count > n:
        refs.decide += [d.answers for d in decide(states[n:count])]
    log(f"{a.name} offline decide: {rows[-1]['per_s']} questions/s, alone differing "
        f"{alone_differing['decide']}/{len(alone_d)}")
    return rows, alone_differing, refs


def long_refs(llm: Any, a: Assets, plan: Plan, w: Work, lora: Any, refs: References,
              log: Callable[[str], None]) -> int:
    """Offline batch-64 tok/s of the long requests, their references; returns how many of
    the first few differ when run alone."""
    b = plan.long_concurrency

    def batch() -> Any:
        return llm.generate(w.long_prompts[:b], w.long_params[:b], lora_request=lora,
                            use_tqdm=False)

    batch()  # warm-up
    t = statistics.median(_timed(batch)[0] for _ in range(max(1, plan.trials - 1)))
    refs.long_tok_s = b * plan.long_tokens / t
    outs = llm.generate(w.long_prompts, w.long_params, lora_request=lora, use_tqdm=False)
    refs.long = [_chosen(o) for o in outs]
    refs.fingerprint = refs.fingerprint or outs[0].fingerprint
    k = min(4, len(outs))
    alone = [llm.generate([w.long_prompts[i]], w.long_params[i], lora_request=lora,
                          use_tqdm=False)[0] for i in range(k)]
    differing = sum(_chosen(x) != r for x, r in zip(alone, refs.long, strict=False))
    log(f"{a.name} offline batch {b} x {plan.long_tokens} tokens: {refs.long_tok_s:.0f} tok/s, "
        f"alone differing {differing}/{k}")
    return differing


# ------------------------------------------------------------------------------ server


def start_server(a: Assets, plan: Plan, log_file: Path,
                 count: int = 1) -> tuple[str, subprocess.Popen]:
    import httpx

    from benchmarks.suites.serving import _free_port

    port = _free_port()
    cmd = [sys.executable, "-m", "detlora.entrypoints.cli", "serve", str(a.model_dir),
           "--port", str(port), "--api-key", KEY, "--lora-modules", f"a={a.adapter}",
           "--max-lora-rank", str(a.rank), "--max-queued-requests", "8192",
           "--log-level", "warning", "--api-server-count", str(count), *plan.serve_args]
    if a.max_model_len is not None:
        cmd += ["--max-model-len", str(a.max_model_len)]
    if plan.tiny:
        cmd += ["--device", "cpu"]
    proc = subprocess.Popen(cmd, stdout=log_file.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("the server exited: " + log_file.read_text()[-3000:])
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return url, proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the server did not start")


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def server_cpu(proc: subprocess.Popen) -> dict[str, float | None]:
    """CPU seconds so far of the server's front ends (the first and those it started) and of
    its engine process (Linux /proc)."""
    from benchmarks.suites.serving import _children, _cpu_seconds

    front, engine = _cpu_seconds(proc.pid), 0.0
    for kid in _children(proc.pid):
        try:
            cmdline = Path(f"/proc/{kid}/cmdline").read_bytes()
        except OSError:
            continue
        seconds = _cpu_seconds(kid) or 0.0
        if b"core_proc" in cmdline:
            engine += seconds
        elif front is not None:
            front += seconds
    return {"frontend": front, "engine": engine}


def _busy(before: dict, after: dict, wall: float) -> dict[str, float | None]:
    """Cores kept busy over ``wall`` seconds (1.0: one core all the time)."""
    return {f"{k}_cpu": None if before[k] is None or after[k] is None else
            round((after[k] - before[k]) / wall, 3) for k in before}


def _wall(results: list[Any]) -> float:
    return max(r.end for r in results) - min(r.start for r in results)


def _completion_chosen(choice: dict) -> tuple[list[int], list[float]]:
    return list(choice.get("token_ids") or []), list(
        (choice.get("logprobs") or {}).get("token_logprobs") or [])


def server_part(url: str, proc: subprocess.Popen, a: Assets, plan: Plan, w: Work,
                refs: References, workloads: tuple[str, ...], log: Callable[[str], None],
                count: int = 1) -> tuple[list[dict], list[dict]]:
    """The server's rows and diagnostics (CPU shares of its processes and of the clients)."""
    from benchmarks.harness.fast_client import run_posts
    from benchmarks.harness.serving_load import LoadRequest, run_load_processes

    rows, notes = [], []

    def decision(k: int) -> tuple[str, dict]:
        return "/v1/decisions", {"model": "a", "state": w.states[k], "questions": QUESTIONS,
                                 "instructions": INSTRUCTIONS}

    def one_token(k: int) -> tuple[str, dict]:
        return "/v1/completions", {"model": "a", "prompt": w.texts[k], "max_tokens": 1,
                                   "temperature": 0.0, "logprobs": 0, "return_token_ids": True}

    def long_body(k: int, stream: bool) -> dict:
        p = w.long_params[k]
        body = {"model": "a", "prompt": w.long_prompts[k], "max_tokens": plan.long_tokens,
                "ignore_eos": True, "logprobs": 0, "return_token_ids": True,
                "temperature": p.temperature}
        if p.temperature:
            body |= {"top_p": p.top_p, "seed": p.seed}
        return body | ({} if stream else {"stream": False})

    def measure(workload: str, concurrency: int, run: Callable[[list[float]], list[Any]],
                check: Callable[[Any], bool], tokens: Callable[[Any], int] | None) -> None:
        clients: list[float] = []
        before = server_cpu(proc)
        results = run(clients)
        wall = _wall(results)
        busy = _busy(before, server_cpu(proc), wall)
        ok = [r for r in results if r.ok]
        differing = sum(not check(r) for r in ok) + (len(results) - len(ok))
        row = {"model": a.name, "workload": workload, "concurrency": concurrency,
               "per_s": round(len(ok) / wall, 1), "tok_s": None, "vs_offline": None,
               "differing": differing}
        if tokens is not None:
            row["tok_s"] = round(sum(tokens(r) for r in ok) / wall, 1)
            row["vs_offline"] = round(row["tok_s"] / refs.long_tok_s, 3)
        rows.append(row)
        notes.append({"model": a.name, "workload": workload, "concurrency": concurrency,
                      "api_server_count": count, "per_s": row["per_s"], "tok_s": row["tok_s"],
                      "differing": differing, "requests": len(results),
                      "failed": len(results) - len(ok),
                      "client_cpu": [round(c, 3) for c in clients], **busy,
                      "errors": [r.error for r in results if not r.ok][:3]})
        log(f"{a.name} server ({count} front ends) {workload} c={concurrency}: "
            f"{json.dumps(row)} {notes[-1]}")

    procs = plan.client_processes

    def posts(items: list[tuple[str, dict]], concurrency: int) -> Callable[[list[float]], Any]:
        return lambda clients: run_posts(url, items, concurrency=concurrency,
                                         processes=min(procs, concurrency), api_key=KEY,
                                         client_cpu=clients)

    # Warm-up: every route at the largest concurrency, on requests not timed after.
    if "decisions" in workloads or "one_token" in workloads:
        c = max(c for c, _ in plan.decisions)
        base = len(w.states) - c
        run_posts(url, [decision(base + k) for k in range(c)]
                  + [one_token(base + k) for k in range(c)], concurrency=c,
                  processes=min(procs, c), api_key=KEY)
    if "decisions" in workloads:
        for c, n in plan.decisions:
            measure("decisions", c, posts([decision(k) for k in range(n)], c),
                    lambda r: r.body["answers"] == refs.decide[r.index]
                    and r.body["system_fingerprint"] == refs.fingerprint, None)
    if "one_token" in workloads:
        for c, n in plan.one_token:
            measure("one_token", c, posts([one_token(k) for k in range(n)], c),
                    lambda r: _completion_chosen(r.body["choices"][0])
                    == refs.one_token[r.index], None)
    c, n = plan.long_concurrency, plan.long_requests
    if "stream_150" in workloads:
        warm = [LoadRequest("completion", {**long_body(k, True), "max_tokens": 8})
                for k in range(c)]
        run_load_processes(url, warm, concurrency=c, processes=min(procs, c), api_key=KEY)

        def streams(clients: list[float]) -> Any:
            return run_load_processes(
                url, [LoadRequest("completion", long_body(k, True)) for k in range(n)],
                concurrency=c, processes=min(procs, c), api_key=KEY, client_cpu=clients)

        measure("stream_150", c, streams,
                lambda r: (r.choices[0]["token_ids"], r.choices[0]["logprobs"])
                == refs.long[r.index] and r.fingerprint == refs.fingerprint,
                lambda r: r.output_tokens)
    if "plain_150" in workloads:
        measure("plain_150", c, posts([("/v1/completions", long_body(k, False))
                                       for k in range(n)], c),
                lambda r: _completion_chosen(r.body["choices"][0]) == refs.long[r.index],
                lambda r: len(r.body["choices"][0]["token_ids"]))
    return rows, notes


def best_of(measured: list[list[dict]]) -> list[dict]:
    """Per (workload, concurrency), the row of the front-end count that served most (tok/s
    for the long requests, requests/s otherwise), its ``differing`` the sum over every count
    measured (every point is checked)."""
    best: dict[tuple, dict] = {}
    differing: dict[tuple, int] = {}
    for rows in measured:
        for row in rows:
            key = (row["model"], row["workload"], row["concurrency"])
            differing[key] = differing.get(key, 0) + row["differing"]
            score = row["tok_s"] if row["tok_s"] is not None else row["per_s"]
            kept = best.get(key)
            if kept is None or score > (kept["tok_s"] if kept["tok_s"] is not None
                                        else kept["per_s"]):
                best[key] = row
    return [{**row, "differing": differing[key]} for key, row in best.items()]


# ------------------------------------------------------------------------------ demo


def demo_part(plan: Plan, root: Path, log: Callable[[str], None]) -> tuple[list[dict], dict]:
    cache = root / "triton-cache"
    if cache.exists():
        shutil.rmtree(cache)
    cache.mkdir(parents=True)
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache)}
    cmd = [sys.executable, "-m", "detlora.entrypoints.cli", "demo"]
    if plan.tiny:
        cmd += ["--tiny", "--quick"]
    rows, codes = [], []
    for run in (1, 2):
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - t0
        codes.append(proc.returncode)
        rows.append({"run": run, "seconds": round(seconds, 1)})
        log(f"demo run {run}: {seconds:.1f} s (exit {proc.returncode})"
            + ("" if proc.returncode == 0 else "\n" + proc.stderr[-2000:]))
    return rows, {"demo_exit_codes": codes, "demo_command": " ".join(cmd[1:])}


# ------------------------------------------------------------------------------ run


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def run(plan: Plan, parts: tuple[str, ...], log: Callable[[str], None] = print) -> dict:
    from detlora import LLM, LoRARequest

    out: dict[str, Any] = {"levels": [], "offline": [], "server": [], "demo": []}
    meta: dict[str, Any] = {"seconds_by_part": {}, "offline_alone_differing": {},
                            "server_diagnostics": [], "plan": {
                                "requests": plan.requests, "prompt_tokens": plan.prompt_tokens,
                                "alone_checks": plan.alone_checks,
                                "serve_args": list(plan.serve_args)}}

    def timed_part(name: str, seconds: float) -> None:
        meta["seconds_by_part"][name] = round(meta["seconds_by_part"].get(name, 0) + seconds, 1)

    with tempfile.TemporaryDirectory(prefix="detlora-small-") as tmp:
        root = Path(tmp)
        served = [plan.serve_model] + ([plan.reference_model] if plan.reference_model else [])
        names = [m for m in dict.fromkeys([*plan.models, *served])
                 if (("levels" in parts or "offline" in parts) and m in plan.models)
                 or ("server" in parts and m in served)]
        for name in names:
            t0 = time.perf_counter()
            a = prepare(name, root / name, plan)
            lora = LoRARequest("a", 1, str(a.adapter))
            reference_only = name not in plan.models
            llm = LLM(str(a.model_dir), **engine_kwargs(a, plan))
            w = make_work(a, plan, llm.tokenizer)
            refs = References()
            if "levels" in parts and not reference_only:
                out["levels"] += tpot_rows(llm, a, plan, "batch_invariant", lora)
            need_refs = "server" in parts and name in served
            if ("offline" in parts or need_refs) and not reference_only:
                rows, alone, refs = offline_part(llm, a, plan, w, lora, log)
                if "offline" in parts:
                    out["offline"] += rows
                    meta["offline_alone_differing"][name] = alone
            if need_refs:
                meta["offline_alone_differing"].setdefault(name, {})["long"] = long_refs(
                    llm, a, plan, w, lora, refs, log)
            llm.shutdown()
            del llm
            _free()
            timed_part("offline" if not reference_only else "server", time.perf_counter() - t0)
            if "levels" in parts and not reference_only:
                t0 = time.perf_counter()
                fast = LLM(str(a.model_dir), **engine_kwargs(a, plan, determinism="fast"))
                out["levels"] += tpot_rows(fast, a, plan, "fast", lora)
                fast.shutdown()
                del fast
                _free()
                timed_part("levels", time.perf_counter() - t0)
            if need_refs:
                t0 = time.perf_counter()
                workloads = (("decisions", "one_token", "stream_150", "plain_150")
                             if name == plan.serve_model else ("stream_150",))
                counts = plan.api_server_counts if name == plan.serve_model \
                    else plan.reference_counts
                measured = []
                for count in counts:
                    url, proc = start_server(a, plan, root / f"server-{name}-{count}.log",
                                             count)
                    try:
                        rows, notes = server_part(url, proc, a, plan, w, refs, workloads, log,
                                                  count)
                        measured.append(rows)
                        meta["server_diagnostics"] += notes
                    finally:
                        stop_server(proc)
                out["server"] += best_of(measured)
                timed_part("server", time.perf_counter() - t0)
        if "demo" in parts:
            t0 = time.perf_counter()
            out["demo"], demo_meta = demo_part(plan, root, log)
            meta.update(demo_meta)
            timed_part("demo", time.perf_counter() - t0)
    return {"meta": meta, **out}


# Each part's rows, and the meta keys it writes.
PART_ROWS = {"levels": ("levels", ()), "offline": ("offline", ("offline_alone_differing",)),
             "server": ("server", ("server_diagnostics",)),
             "demo": ("demo", ("demo_exit_codes", "demo_command"))}


def keep_parts(earlier: dict, result: dict, parts: tuple[str, ...]) -> dict:
    """``result`` with the rows (and meta) of the parts it did not run taken from
    ``earlier``; ``meta.kept_from`` names that run's commit and command."""
    out = dict(result)
    meta = dict(result["meta"])
    kept = []
    for part, (rows, keys) in PART_ROWS.items():
        if part in parts or not earlier.get(rows):
            continue
        out[rows] = earlier[rows]
        for key in keys:
            if key in earlier.get("meta", {}):
                meta[key] = earlier["meta"][key]
        kept.append(part)
    if kept:
        old = earlier.get("meta", {})
        meta["kept_from"] = {"parts": kept, "commit": old.get("commit"),
                             "command": old.get("command"), "date": old.get("date")}
    out["meta"] = meta
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="out/small_models.json")
    p.add_argument("--parts", default=",".join(PARTS),
                   help=f"comma-separated subset of {', '.join(PARTS)} (default: all)")
    p.add_argument("--models", default=None,
                   help="comma-separated subset of smollm2, qwen3_0.6b (default: both)")
    p.add_argument("--no-reference", action="store_true",
                   help="leave out the 3B shape's serving figure")
    p.add_argument("--serve-args", default="",
                   help="extra options for detlora serve (e.g. '--api-server-count 2')")
    p.add_argument("--smoke", action="store_true",
                   help="tiny models: the whole script on a CPU (its figures mean nothing)")
    p.add_argument("--keep-from", metavar="FILE", default=None,
                   help="take the rows of the parts not run from this earlier results file "
                        "(a run split over several device calls)")
    args = p.parse_args(argv)
    parts = tuple(x for x in args.parts.split(",") if x)
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        p.error(f"unknown parts {unknown} (known: {', '.join(PARTS)})")
    plan = Plan.smoke() if args.smoke else Plan()
    from dataclasses import replace

    if args.models:
        plan = replace(plan, models=tuple(args.models.split(",")))
    if args.no_reference:
        plan = replace(plan, reference_model=None)
    if args.serve_args:
        plan = replace(plan, serve_args=tuple(args.serve_args.split()))
    from benchmarks.harness import results_meta, write_results

    t0 = time.time()
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
        torch.set_num_threads(1)
    result = run(plan, parts)
    command = " ".join(["python -m benchmarks.suites.small_models", *sys.argv[1:]])
    result["meta"] = {**results_meta(command), **result["meta"],
                      "seconds": round(time.time() - t0, 1), "parts": list(parts)}
    if args.keep_from and Path(args.keep_from).is_file():
        result = keep_parts(json.loads(Path(args.keep_from).read_text()), result, parts)
    write_results(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

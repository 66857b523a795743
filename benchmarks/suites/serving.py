"""Serving benchmark: ``detlora serve`` under concurrent streaming clients, against offline.

Model: the engine suite's Llama-3.2-3B shape (random bf16 weights) with two rank-16 adapters
(requests alternate between them) and a word-level tokenizer over the whole vocabulary (so
detokenizing costs what a real one does) with a chat template. Requests: 100-token random
prompts, 150 output tokens (EOS ignored), half greedy and half seeded sampling (temperature
0.8, top-p 0.95), the chosen tokens' logprobs streamed. ``batch_invariant``.

1. Offline, in a process of its own: ``LLM.generate`` throughput at batch 64 (median of 3), and
   the reference output of every request (all 1,024 in one call, plus a few alone: they must
   agree).
2. The server (``detlora serve``), then at concurrency 1, 16, 64 and 256 (4, 64, 512 and 1,024
   requests; ``client_processes``): output tok/s over the level's wall time, time to first
   token and inter-token latency (p50, p99, at the client), failed requests, and outputs that
   differ from the offline reference (token ids and logprobs, bit for bit); over the clients'
   span (first request sent to last answer ended): the cores the server's two processes kept
   busy (``frontend_cpu``: HTTP, tokenizer and streams; ``engine_cpu``: the step loop; 1.0 =
   one core all the time, from /proc), each client process's busy share (``client_cpu``), and
   from the server's /metrics the engine's steps (``engine_busy``: their summed wall time over
   the span, below 1 when the engine waited for requests or on the front end;
   ``engine_idle``: the share it waited with no request to run; ``engine_send_blocked``: the
   share it spent handing outputs over, long when the front end reads them late), the mean
   delay from the engine sending a step's outputs to the front end's event loop handling them
   (``frontend_step_delay_mean_ms``) and ``steps_over_100ms``; the
   server's own mean time to first token and its admission part (front end to engine
   process), beside the clients' mean (the difference is HTTP and request handling); and the
   Triton kernels (names) the server compiled meanwhile, with each compilation's process,
   seconds and specialization key (``compile_events``, from Triton's JIT hooks in the
   server's processes: ``benchmarks.harness.compile_events``). Each level starts with an
   untimed run of ``concurrency`` short requests (8 tokens) at that concurrency, as a server
   that has seen such traffic before (``warmup_kernels_compiled``: what it compiled).
3. Decisions: 1,000 one-question noul requests with an adapter (distinct states), requests/s of
   the first pass; 10 passes in all, and how many probabilities changed from the first.

    python -m benchmarks.suites.serving --out out/serving.json [--quick]

Schema: {"meta", "rows": [{"concurrency", "output_tok_per_s", "ttft_p50_ms", "ttft_p99_ms",
"itl_p50_ms", "itl_p99_ms", "requests", "failed", "differing", "frontend_cpu", "engine_cpu",
"client_cpu", "engine_steps", "engine_busy", "engine_send_blocked", "engine_idle",
"frontend_step_delay_mean_ms",
"steps_over_100ms", "server_ttft_mean_ms",
"server_admission_mean_ms", "kernels_compiled"}],
"offline_batch64_tok_per_s",
"decisions": {"requests_per_s", "repetitions", "questions", "changed"}}.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks.harness import compile_events

# concurrency -> requests sent: eight waves at 64 and four at 256, so that the ramp and the
# tail of a closed loop do not weigh on the steady state (two waves at 64 did: 0.88x).
LEVELS = {1: 4, 16: 64, 64: 512, 256: 1024}
KEY = "bench-key"


@dataclass(frozen=True)
class Plan:
    layers: int = 28
    prompt_len: int = 100
    output_len: int = 150
    levels: tuple[tuple[int, int], ...] = tuple(LEVELS.items())
    decision_questions: int = 1000
    decision_repetitions: int = 10
    decision_state_words: int = 60
    offline_trials: int = 3
    tiny: bool = False  # a small model, for a run of the whole script on a CPU

    @classmethod
    def quick(cls) -> Plan:
        return cls(layers=4, output_len=32, levels=((1, 2), (16, 16), (64, 64)),
                   decision_questions=100, decision_repetitions=3, offline_trials=1)

    @classmethod
    def smoke(cls) -> Plan:
        return cls(layers=2, prompt_len=16, output_len=6, levels=((1, 2), (4, 8)),
                   decision_questions=8, decision_repetitions=2, decision_state_words=8,
                   offline_trials=1, tiny=True)

    def shape(self) -> Any:
        from benchmarks.suites.engine import ModelShape

        if self.tiny:
            return ModelShape(hidden=128, layers=self.layers, heads=4, kv_heads=2, head_dim=32,
                              intermediate=256, vocab=2048)
        return replace(ModelShape(), layers=self.layers)


WORDS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "yes",
         "no", "State:", "Question:", "Answer", "with", "or", "Is", "this", "comment", "toxic?"]
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> "
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def write_tokenizer(path: Path, vocab: int) -> None:
    """A word-level tokenizer with one word per model token (decoding joins with spaces)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {w: i for i, w in enumerate(WORDS)}
    words |= {f"w{i}": i for i in range(len(WORDS), vocab)}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))


def write_assets(root: Path, shape: Any) -> None:
    """The server's model (``root/model``, with the word-level tokenizer) and its two
    adapters (``root/adapter0``, ``root/adapter1``)."""
    from benchmarks.suites.engine import write_adapter, write_model

    write_model(root / "model", shape)
    write_tokenizer(root / "model", shape.vocab)
    for k in range(2):
        write_adapter(root / f"adapter{k}", shape, seed=10 + k)


def requests_pool(plan: Plan, vocab: int, n: int) -> list[dict[str, Any]]:
    """n request bodies (model = adapter a0 or a1), as the server and the offline run read
    them."""
    import random

    rng = random.Random(1234)
    out = []
    for k in range(n):
        body: dict[str, Any] = {
            "model": f"a{k % 2}", "prompt": [rng.randrange(10, vocab - 10)
                                             for _ in range(plan.prompt_len)],
            "max_tokens": plan.output_len, "ignore_eos": True, "logprobs": 0}
        if k % 2 == 0:
            body["temperature"] = 0.0
        else:
            body |= {"temperature": 0.8, "top_p": 0.95, "seed": k}
        out.append(body)
    return out


def _params(body: dict[str, Any]) -> Any:
    from detlora import SamplingParams

    return SamplingParams(max_tokens=body["max_tokens"], ignore_eos=True, logprobs=0,
                          temperature=body["temperature"], top_p=body.get("top_p", 1.0),
                          seed=body.get("seed"))


def engine_args(plan: Plan) -> dict[str, Any]:
    return dict(max_loras=2, max_lora_rank=16, max_model_len=plan.prompt_len + plan.output_len
                + 16, max_num_seqs=256, max_num_batched_tokens=8192,
                determinism="batch_invariant")


def offline_part(root: Path, plan: Plan, out: Path) -> None:
    """Run in its own process (its GPU memory is gone when it exits): throughput at batch 64
    and the reference outputs."""
    import torch

    from detlora import LLM, LoRARequest

    loras = [LoRARequest(f"a{k}", k + 1, str(root / f"adapter{k}")) for k in range(2)]
    llm = LLM(str(root / "model"), enable_lora=True, **engine_args(plan))
    vocab = llm.engine.spec.vocab_size
    n = max(c for _, c in plan.levels)
    pool = requests_pool(plan, vocab, n)

    def run(bodies: list[dict[str, Any]]) -> list[Any]:
        return llm.generate([b["prompt"] for b in bodies], [_params(b) for b in bodies],
                            [loras[int(b["model"][1])] for b in bodies], use_tqdm=False)

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    run(pool[:64])  # warm-up: graphs replayed once, kernels compiled
    times = []
    for _ in range(plan.offline_trials):
        sync()
        t0 = time.perf_counter()
        outs = run(pool[:64])
        sync()
        times.append(time.perf_counter() - t0)
    tok_s = sum(len(o.outputs[0].token_ids) for o in outs) / statistics.median(times)
    refs = run(pool)
    alone = [run([pool[k]])[0] for k in range(min(4, n))]
    alone_differ = sum(a.outputs[0].token_ids != r.outputs[0].token_ids
                       or a.outputs[0].logprobs != r.outputs[0].logprobs
                       for a, r in zip(alone, refs, strict=False))
    out.write_text(json.dumps({
        "offline_batch64_tok_per_s": tok_s, "alone_differing": alone_differ,
        "fingerprints": [r.fingerprint for r in refs],
        "refs": [[r.outputs[0].token_ids, _chosen_logprobs(r)] for r in refs]}))


def _chosen_logprobs(out: Any) -> list[float]:
    """Each chosen token's logprob (a float, or an object with ``.logprob``)."""
    comp = out.outputs[0]
    return [getattr(d[t], "logprob", d[t]) for d, t in zip(comp.logprobs, comp.token_ids,
                                                           strict=True)]


def client_processes(concurrency: int) -> int:
    """Client processes for a level: eight streams each, up to eight processes. A client parses
    each streamed token at about twice the server front end's CPU cost (on this project's
    CPU, ``frontend_token_cost``), so few processes would measure the clients; each one's
    busy share is in the row (``client_cpu``)."""
    return min(8, max(1, concurrency // 8))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(root: Path, plan: Plan, log: Path, compile_log: Path | None = None,
                 engine_trace: Path | None = None, stub_model: bool = False,
                 extra_args: tuple[str, ...] = ()) -> tuple[str, subprocess.Popen]:
    """``detlora serve`` on the plan's assets; with ``compile_log`` its processes append their
    Triton compilations there (``benchmarks.harness.compile_events``), with ``engine_trace``
    its engine process writes its loop's timeline there at exit
    (``benchmarks.harness.engine_trace``), with ``stub_model`` its engine's model computes
    nothing (``benchmarks.harness.stub_model``: the host's work alone); ``extra_args`` go to
    ``detlora serve``."""
    import httpx

    port = _free_port()
    a = engine_args(plan)
    device = [] if not plan.tiny else ["--device", "cpu"]
    cmd = [sys.executable, "-m", "detlora.entrypoints.cli", "serve", str(root / "model"), *device,
           "--port", str(port), "--api-key", KEY, "--lora-modules",
           f"a0={root / 'adapter0'}", f"a1={root / 'adapter1'}",
           "--max-loras", str(a["max_loras"]), "--max-lora-rank", str(a["max_lora_rank"]),
           "--max-model-len", str(a["max_model_len"]), "--max-num-seqs",
           str(a["max_num_seqs"]), "--max-queued-requests", "4096", "--log-level", "warning",
           *extra_args]
    env = dict(os.environ)
    if compile_log is not None or engine_trace is not None or stub_model:
        repo = Path(__file__).resolve().parents[2]
        hooks = repo / "benchmarks" / "harness" / "sitecustomize"
        if compile_log is not None:
            env[compile_events.ENV] = str(compile_log)
        if engine_trace is not None:
            env["DETLORA_ENGINE_TRACE"] = str(engine_trace)
        if stub_model:
            env["DETLORA_STUB_MODEL"] = "1"
        env["PYTHONPATH"] = os.pathsep.join(
            [str(hooks), str(repo), *filter(None, [env.get("PYTHONPATH")])])
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
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


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` so far (Linux /proc), None elsewhere."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return out


def server_cpu(proc: subprocess.Popen) -> dict[str, float | None]:
    """CPU seconds so far of the server's front end (HTTP, tokenizer, streams) and of its
    engine process (the step loop), to tell which one a level saturates."""
    kids = _children(proc.pid)
    core = [c for c in (_cpu_seconds(k) for k in kids) if c is not None]
    return {"frontend": _cpu_seconds(proc.pid), "engine": sum(core) if core else None}


def _busy(before: dict, after: dict, wall: float) -> dict[str, float | None]:
    """Cores kept busy over ``wall`` seconds, per process (1.0: one core all the time)."""
    return {f"{k}_cpu": None if before[k] is None or after[k] is None else
            round((after[k] - before[k]) / wall, 3) for k in before}


def _triton_cache() -> Path:
    return Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")


def triton_kernels_cached() -> set[str]:
    """Entries of Triton's kernel cache: a compile in the server adds one."""
    root = _triton_cache()
    return {p.name for p in root.iterdir()} if root.is_dir() else set()


def compiled_since(before: set[str]) -> list[str]:
    """The kernels (by name) of the cache entries added since ``before``."""
    root = _triton_cache()
    names = []
    for entry in sorted(triton_kernels_cached() - before):
        stems = {f.name.split(".")[0] for f in (root / entry).glob("*.json")
                 if not f.name.startswith("__grp__")}
        names += sorted(stems) or [entry]
    return names


_SCRAPED = {"detlora:engine_step_seconds_count": "steps",
            "detlora:engine_step_seconds_sum": "step_s",
            'detlora:engine_step_seconds_bucket{le="0.1"}': "steps_le_0.1",
            "detlora:time_to_first_token_seconds_count": "firsts",
            "detlora:time_to_first_token_seconds_sum": "ttft_s",
            "detlora:request_admission_seconds_sum": "admission_s",
            "detlora:engine_output_send_seconds_sum": "send_s",
            "detlora:frontend_step_delay_seconds_count": "dispatches",
            "detlora:frontend_step_delay_seconds_sum": "dispatch_delay_s",
            "detlora:engine_idle_seconds_total": "idle_s"}


def server_figures(url: str) -> dict[str, float]:
    """Counters of the server's /metrics: engine steps, their summed seconds, steps up to
    0.1 s; requests that got a first token, their summed time to it and their summed
    admission (front end to engine process)."""
    import httpx

    out = dict.fromkeys(_SCRAPED.values(), 0.0)
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        name, _, value = line.rpartition(" ")
        if name in _SCRAPED:
            out[_SCRAPED[name]] = float(value)
    return out


def _step_row(before: dict, after: dict, wall: float, kernels: list[str]) -> dict[str, Any]:
    """The server's side of a level: engine steps, the share of the wall the engine spent
    stepping (below 1: it waited for requests or on the front end), the share it spent
    handing outputs to a front end that read them late (``engine_send_blocked``), the share
    it waited with no request to run (``engine_idle``: the load was the limit), the mean
    delay from the front end receiving a step's outputs to its event loop handling them,
    steps over 0.1 s, the server's mean time to
    first token and its admission part (from the front end's add_request to the engine
    process), and the Triton kernels compiled meanwhile."""
    d = {k: after[k] - before[k] for k in after}
    firsts = max(1.0, d["firsts"])
    return {"engine_steps": int(d["steps"]),
            "engine_busy": round(d["step_s"] / wall, 3),
            "engine_send_blocked": round(d["send_s"] / wall, 3),
            "engine_idle": round(d["idle_s"] / wall, 3),
            "frontend_step_delay_mean_ms": round(
                1e3 * d["dispatch_delay_s"] / max(1.0, d["dispatches"]), 3),
            "steps_over_100ms": int(d["steps"] - d["steps_le_0.1"]),
            "server_ttft_mean_ms": round(1e3 * d["ttft_s"] / firsts, 3),
            "server_admission_mean_ms": round(1e3 * d["admission_s"] / firsts, 3),
            "kernels_compiled": kernels}


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(1e3 * values[min(len(values) - 1, int(q * len(values)))], 3)


def level_row(concurrency: int, results: list[Any], refs: list[Any],
              fingerprints: list[str]) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    wall = max(r.end for r in results) - min(r.start for r in results)
    differing = 0
    for r in ok:
        ids, lps = refs[r.index]
        c = r.choices.get(0, {})
        if c.get("token_ids") != ids or c.get("logprobs") != lps \
                or r.fingerprint != fingerprints[r.index]:
            differing += 1
    return {"concurrency": concurrency,
            "output_tok_per_s": round(sum(r.output_tokens for r in ok) / wall, 1),
            "ttft_mean_ms": round(1e3 * statistics.mean(t), 3) if (t := [
                r.ttft for r in ok if r.ttft is not None]) else None,
            "ttft_p50_ms": _pct([r.ttft for r in ok if r.ttft is not None], 0.5),
            "ttft_p99_ms": _pct([r.ttft for r in ok if r.ttft is not None], 0.99),
            "itl_p50_ms": _pct([x for r in ok for x in r.itl], 0.5),
            "itl_p99_ms": _pct([x for r in ok for x in r.itl], 0.99),
            "requests": len(results), "failed": len(results) - len(ok),
            "differing": differing}


def run(plan: Plan, log: Any = print) -> dict[str, Any]:
    import torch

    from benchmarks.harness.serving_load import LoadRequest, run_load_processes
    shape = plan.shape()
    with tempfile.TemporaryDirectory(prefix="detlora-serving-") as tmp:
        root = Path(tmp)
        write_assets(root, shape)
        torch.cuda.empty_cache()
        log("offline: throughput at batch 64 and reference outputs")
        ref_file = root / "offline.json"
        env = dict(os.environ)
        flag = ["--smoke"] if plan.tiny else ["--quick"] if plan.layers < 28 else []
        subprocess.run([sys.executable, "-m", "benchmarks.suites.serving", "--offline-part",
                        str(root), str(ref_file), *flag], check=True, env=env)
        offline = json.loads(ref_file.read_text())
        log(f"offline batch 64: {offline['offline_batch64_tok_per_s']:.0f} tok/s; "
            f"alone vs batched differing {offline['alone_differing']}")
        refs, fingerprints = offline["refs"], offline["fingerprints"]
        pool = requests_pool(plan, shape.vocab, len(refs))
        compiles = root / "compiles.jsonl"
        url, proc = start_server(root, plan, root / "server.log", compile_log=compiles)
        _, compiled_to = compile_events.read_events(compiles)  # the start-up's
        try:
            warm = [LoadRequest("completion", {**b, "max_tokens": 4}) for b in pool[:32]]
            run_load_processes(url, warm, concurrency=32, processes=1, api_key=KEY)
            rows = []
            for concurrency, n in plan.levels:
                reqs = [LoadRequest("completion", b) for b in pool[:n]]
                procs = client_processes(concurrency)
                # A short untimed run at this concurrency first: the step shapes of its
                # first wave compile their kernels there, not in the timed run.
                kernels = triton_kernels_cached()
                warm = [LoadRequest("completion", {**b, "max_tokens": 8})
                        for b in pool[:concurrency]]
                run_load_processes(url, warm, concurrency=concurrency, processes=procs,
                                   api_key=KEY, deadline_s=300)
                warm_kernels = compiled_since(kernels)
                kernels = triton_kernels_cached()
                _, compiled_to = compile_events.read_events(compiles, compiled_to)
                cpu, steps = server_cpu(proc), server_figures(url)
                scraped = time.monotonic()
                clients: list[float] = []
                results = run_load_processes(url, reqs, concurrency=concurrency,
                                             processes=procs, api_key=KEY, deadline_s=300,
                                             client_cpu=clients)
                # The server's figures first: its counters go on (idle time) meanwhile.
                steps_after = server_figures(url)
                done = time.monotonic()  # the idle counter was read before this
                cpu_after = server_cpu(proc)
                # Shares over the clients' span (first request sent to last answer ended):
                # client processes start seconds after the scrape, and the engine's wait
                # for them then is not the level's.
                first = min(r.start for r in results)
                last = max(r.end for r in results)
                wall = last - first
                steps_after["idle_s"] -= max(0.0, first - scraped) + max(0.0, done - last)
                row = {**level_row(concurrency, results, refs, fingerprints),
                       "client_cpu": [round(c, 3) for c in clients],
                       **_busy(cpu, cpu_after, wall),
                       **_step_row(steps, steps_after, wall, compiled_since(kernels)),
                       "warmup_kernels_compiled": warm_kernels}
                events, compiled_to = compile_events.read_events(compiles, compiled_to)
                row["compile_events"] = events
                rows.append(row)
                log(json.dumps(row))
                errors = [r.error for r in results if not r.ok][:3]
                if errors:
                    log(f"  failures, e.g. {errors}")
            decisions = decision_part(url, plan, log)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
            log(f"server exit status {proc.returncode}")
    return {"rows": rows, "offline_batch64_tok_per_s": round(
        offline["offline_batch64_tok_per_s"], 1), "offline_alone_differing":
        offline["alone_differing"], "decisions": decisions}


def decision_part(url: str, plan: Plan, log: Any) -> dict[str, Any]:
    import random

    from benchmarks.harness.serving_load import LoadRequest, run_load_processes

    rng = random.Random(7)
    top = plan.shape().vocab - 1
    states = [" ".join(f"w{rng.randrange(20, top)}" for _ in range(plan.decision_state_words))
              for _ in range(plan.decision_questions)]
    reqs = [LoadRequest("decision", {"model": "a0", "state": s, "questions": {
        "toxic": {"type": "noul", "criteria": "Is this comment toxic?"}}}) for s in states]
    first: list[Any] = []
    rate = None
    changed = failed = 0
    for rep in range(plan.decision_repetitions):
        results = run_load_processes(url, reqs, concurrency=64, processes=4, api_key=KEY,
                                     deadline_s=300)
        failed += sum(not r.ok for r in results)
        errors = [r.error for r in results if not r.ok][:2]
        if errors:
            log(f"  decision failures, e.g. {errors}")
        if rep == 0:
            wall = max(r.end for r in results) - min(r.start for r in results)
            rate = round(len(results) / wall, 1)
            first = [r.answers for r in results]
        else:
            changed += sum(r.answers != f for r, f in zip(results, first, strict=True))
    out = {"requests_per_s": rate, "repetitions": plan.decision_repetitions,
           "questions": plan.decision_questions, "changed": changed, "failed": failed}
    log(json.dumps(out))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="out/serving.json")
    p.add_argument("--quick", action="store_true", help="4 layers, fewer tokens and requests")
    p.add_argument("--smoke", action="store_true", help="a tiny model: the whole script on a "
                   "CPU in a few minutes (its figures mean nothing)")
    p.add_argument("--offline-part", nargs=2, metavar=("ROOT", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    plan = Plan.smoke() if args.smoke else Plan.quick() if args.quick else Plan()
    if args.offline_part:
        offline_part(Path(args.offline_part[0]), plan, Path(args.offline_part[1]))
        return 0
    from benchmarks.harness import results_meta, write_results

    t0 = time.time()
    result = run(plan)
    command = "python -m benchmarks.suites.serving" + (
        " --smoke" if args.smoke else " --quick" if args.quick else "")
    # uvicorn parses HTTP with httptools where the server can import it, else with h11.
    http = "httptools" if importlib.util.find_spec("httptools") is not None else "h11"
    write_results(args.out, {"meta": {**results_meta(command), "http": http,
                                      "seconds": round(time.time() - t0, 1)}, **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())

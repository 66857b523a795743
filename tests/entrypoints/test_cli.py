"""``detlora demo`` and ``detlora generate`` on the CPU."""

import json
import os
import subprocess
import sys

import pytest
import torch

from detlora.config import SamplingParams
from detlora.entrypoints.cli import main
from detlora.entrypoints.demo import build_demo_assets
from detlora.entrypoints.llm import LLM
from detlora.lora.request import LoRARequest


@pytest.fixture(scope="module")
def demo_assets(tmp_path_factory):
    return build_demo_assets(tmp_path_factory.mktemp("demo"))


def test_demo_quick_runs_and_batch_invariant_is_identical(tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    save = tmp_path / "saved"
    proc = subprocess.run([sys.executable, "-m", "detlora.entrypoints.cli", "demo", "--tiny",
                           "--quick", "--save", str(save)],
                          capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert "batch_invariant: PASS" in proc.stdout and "-> '" in proc.stdout
    # --save keeps a model that LLM(DIR) loads, its adapters, a chat template and single-token
    # decision labels.
    llm = LLM(str(save), device="cpu", enable_lora=True, max_lora_rank=8)
    tok = llm.get_tokenizer()
    assert all(len(tok.encode(w, add_special_tokens=False)) == 1 for w in ("yes", "no"))
    msgs = [{"role": "user", "content": "the user asks"}]
    lora = LoRARequest("a", 1, str(save / "adapters" / "a"))
    sp = SamplingParams(temperature=0.0, max_tokens=2)
    assert llm.chat(msgs, sp, lora, use_tqdm=False)[0].outputs[0].token_ids
    header = next(line for line in lines if line.startswith("check"))
    assert "batch_invariant" in header and "run_to_run" in header
    rows = [line for line in lines if line.startswith(("repeat", "batch of", "reverse",
                                                       "mixed", "preempted", "second turn"))]
    assert len(rows) == 7
    # The batch_invariant column says identical for every check.
    lo, hi = header.index("batch_invariant"), header.index("run_to_run")
    assert all(row[lo:hi].strip().startswith("identical") for row in rows), proc.stdout
    assert "DIFFERS" not in "".join(row[lo:hi] for row in rows)


def test_generate_text_jsonl_with_adapters(demo_assets, tmp_path, capsys):
    model_dir, adapters = demo_assets
    prompts = tmp_path / "p.jsonl"
    rows = [{"prompt": "the engine reads the prompt and"},
            {"prompt": "a sum in floating point", "lora": "a"},
            {"prompt": [5, 6, 7], "lora": "b"}]
    prompts.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    argv = ["generate", "--model", str(model_dir), "--lora", f"a={adapters[0]}",
            "--lora", f"b={adapters[1]}", "--prompts", str(prompts), "--max-tokens", "5",
            "--max-lora-rank", "8", "--device", "cpu", "--json"]
    assert main(argv) == 0
    got = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [g["lora"] for g in got] == [None, "a", "b"]
    # The API gives the same tokens, logprobs and fingerprints.
    llm = LLM(str(model_dir), enable_lora=True, max_loras=2, max_lora_rank=8, device="cpu")
    loras = [None, LoRARequest("a", 1, str(adapters[0])), LoRARequest("b", 2, str(adapters[1]))]
    outs = llm.generate([r["prompt"] for r in rows], SamplingParams(temperature=0.0,
                                                                    max_tokens=5, logprobs=0),
                        loras, use_tqdm=False)
    for g, o in zip(got, outs, strict=True):
        c = o.outputs[0]
        assert g["token_ids"] == c.token_ids and g["text"] == c.text
        assert g["logprobs"] == [next(iter(d.values())).logprob for d in c.logprobs]
        assert g["fingerprint"] == o.fingerprint
    assert got[0]["text"] and all(len(g["token_ids"]) >= 1 for g in got)


def test_generate_plain_prompt_and_errors(demo_assets, capsys):
    model_dir, _ = demo_assets
    assert main(["generate", "--model", str(model_dir), "--prompt", "the user asks",
                 "--max-tokens", "3", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("--- the user asks [base]") and "fingerprint" in out
    assert main(["generate", "--model", str(model_dir), "--prompt", "x", "--prompt-lora",
                 "nope", "--device", "cpu"]) == 2
    assert "no --lora nope=DIR" in capsys.readouterr().err
    assert main(["generate", "--model", str(model_dir / "missing"), "--prompt", "x"]) == 2


def test_generate_prefix_caching_flag(demo_assets, capsys):
    model_dir, _ = demo_assets
    base = ["generate", "--model", str(model_dir), "--prompt", "the user asks", "--max-tokens",
            "3", "--device", "cpu", "--json"]

    def run(*extra: str) -> dict:
        assert main([*base, *extra]) == 0
        return json.loads(capsys.readouterr().out)

    # batch_invariant: the cache is on by default and does not change bits or fingerprint.
    on, off = run(), run("--no-enable-prefix-caching")
    assert on["num_cached_tokens"] == 0 and on == off
    # run_to_run: off by default; asked for, it is part of the fingerprint.
    r2r, r2r_on = run("--determinism", "run_to_run"), run("--determinism", "run_to_run",
                                                          "--enable-prefix-caching")
    assert r2r["fingerprint"] != r2r_on["fingerprint"]


@pytest.mark.parametrize(("args", "lines", "message"), [
    (["--lora", "a=/no/such/adapter"], None, "adapter directory /no/such/adapter does not"),
    (["--lora", "a=ADAPTER0", "--lora", "a=ADAPTER1"], None, "--lora a= is given twice"),
    (["--prompt-lora", "a"], ['{"prompt": "x"}'], "--prompt-lora goes with --prompt"),
    ([], ['{"prompt": "x", "lora": 3}'], 'p.jsonl:1: "lora" must be an adapter name'),
    (["--repetition-penalty", "0"], None, "repetition_penalty must be > 0"),
    (["--frequency-penalty", "3"], None, "frequency_penalty must be in [-2, 2]"),
    (["--min-p", "-0.1"], None, "min_p must be in [0, 1]"),
])
def test_generate_refuses_bad_adapter_arguments(demo_assets, tmp_path, capsys, args, lines,
                                                message):
    """Refused before the model loads, even when no prompt uses the adapter."""
    model_dir, adapters = demo_assets
    args = [a.replace("ADAPTER0", str(adapters[0])).replace("ADAPTER1", str(adapters[1]))
            for a in args]
    if lines is None:
        source = ["--prompt", "x"]
    else:
        (tmp_path / "p.jsonl").write_text("\n".join(lines) + "\n")
        source = ["--prompts", str(tmp_path / "p.jsonl")]
    assert main(["generate", "--model", str(model_dir), *source, *args, "--device", "cpu"]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.out == ""


def test_generate_with_stop_strings(demo_assets, capsys):
    model_dir, _ = demo_assets
    base = ["generate", "--model", str(model_dir), "--prompt", "the user asks",
            "--max-tokens", "20", "--device", "cpu", "--json"]
    assert main(base) == 0
    full = json.loads(capsys.readouterr().out)
    stop = full["text"][12:17]
    assert main([*base, "--stop", "not in it", "--stop", stop]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["text"] == full["text"][: full["text"].index(stop)]
    assert got["finish_reason"] == "stop" and got["stop_reason"] == stop
    assert got["token_ids"] == full["token_ids"][: len(got["token_ids"])]


def test_generate_n_completions_and_prompt_logprobs(demo_assets, capsys):
    model_dir, _ = demo_assets
    base = ["generate", "--model", str(model_dir), "--prompt", "the user asks",
            "--max-tokens", "6", "--device", "cpu", "--temperature", "1.0", "--n", "3"]
    assert main([*base, "--json", "--prompt-logprobs"]) == 0
    got = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [g["index"] for g in got] == [0, 1, 2]
    llm = LLM(str(model_dir), device="cpu")
    out = llm.generate("the user asks", SamplingParams(max_tokens=6, temperature=1.0, n=3,
                                                       prompt_logprobs=0), use_tqdm=False)[0]
    assert [g["token_ids"] for g in got] == [c.token_ids for c in out.outputs]
    scored = [None] + [next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]]
    assert all(g["prompt_logprobs"] == scored for g in got) and len(scored) >= 2
    assert main(base) == 0
    assert [line.split(" (")[0][-2:] for line in capsys.readouterr().out.splitlines()
            if line.startswith("---")] == ["#0", "#1", "#2"]
    assert main([*base, "--prompt-logprobs"]) == 2
    assert "--prompt-logprobs prints with --json only" in capsys.readouterr().err


def test_chat_through_the_template(demo_assets):
    model_dir, _ = demo_assets
    llm = LLM(str(model_dir), device="cpu")
    msgs = [{"role": "user", "content": "the user asks a question"}]
    chat = llm.chat(msgs, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    ids = tok.encode("<|user|> the user asks a question <|assistant|>")
    assert chat.prompt_token_ids == ids
    same = llm.generate([msgs], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)[0]
    assert same.outputs[0].token_ids == chat.outputs[0].token_ids


def test_generate_progress_is_tqdm_and_silent_off_a_terminal(demo_assets, capsys):
    import detlora.entrypoints.llm as llm_module

    assert not hasattr(llm_module, "ProgressBar")
    llm = LLM(str(demo_assets[0]), device="cpu")
    llm.generate([[5, 6], [7, 8]], SamplingParams(temperature=0.0, max_tokens=2))
    assert capsys.readouterr().err == ""  # stderr is not a terminal here


def test_generate_progress_on_a_terminal_counts_requests_and_tokens(demo_assets, monkeypatch):
    import io

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    llm = LLM(str(demo_assets[0]), device="cpu")
    llm.generate([[5, 6], [7, 8], [9, 10]], SamplingParams(temperature=0.0, max_tokens=3,
                                                           ignore_eos=True))
    text = term.getvalue()
    assert "Processed prompts" in text and "3/3" in text, text
    assert "output: " in text and "tok/s" in text


def test_version(capsys):
    import detlora

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"detlora {detlora.__version__}"


def test_generate_takes_every_engine_argument_with_its_default(capsys):
    from detlora.engine_args import EngineArgs

    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = capsys.readouterr().out
    for name in EngineArgs.names():
        assert "--" + name.replace("_", "-") in text
    assert "``" not in text and "(default: 16)" in text and "--num-gpu-blocks-override" in text


@pytest.mark.parametrize(("argv", "message"), [
    (["generate", "--model", "m", "--prompt", "x", "--max-model-len", "ten"],
     "argument --max-model-len: invalid int value: 'ten'"),
    (["generate", "--model", "m", "--prompt", "x", "--determinism", "exact"],
     "argument --determinism: invalid choice: 'exact'"),
    (["generate", "--prompt", "x"], "the following arguments are required: --model"),
    (["generate", "--model", "m", "--prompt", "x", "--max-lora-rnk", "8"],
     "unrecognized arguments: --max-lora-rnk 8 (--max-lora-rnk: did you mean "
     "--max-lora-rank?)"),
])
def test_usage_errors_are_one_line(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1
    assert message in err and "(see detlora generate --help)" in err


@pytest.mark.parametrize(("argv", "message"), [
    (["generate", "--model", "/no/such/model", "--prompt", "x"],
     "model directory /no/such/model does not exist"),
    (["generate", "--model", "m", "--prompt", "x", "--quantization", "awq"],
     "quantization='awq' is not supported"),
    (["generate", "--model", "m", "--prompt", "x", "--tensor-parallel-size", "3"],
     "tensor_parallel_size must be one of"),
    (["demo", "--quick", "--device", "cuda"] if not torch.cuda.is_available() else
     ["demo", "--quick", "--gpu-memory-utilization", "2"], "")
])
def test_user_errors_are_one_line_without_a_traceback(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(f"detlora {argv[0]}: error: ") and message in err


def test_serve_refuses_a_port_in_use_before_starting_the_engine(tmp_path, capsys):
    """The port is bound first: one in use (or out of range) is a one-line error at once, with
    no engine started (the model directory here holds no model)."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", str(tmp_path), "--device", "cpu", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"detlora serve: error: cannot listen on 127.0.0.1:{port}: " \
        "Address already in use", err
    assert main(["serve", str(tmp_path), "--device", "cpu", "--port", "65536"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("detlora serve: error: port must be an int in [0, 65535]"), err


@pytest.mark.parametrize("model", ["smollm2", "HuggingFaceTB/SmolLM2-135M-Instruct"])
def test_serve_takes_the_model_names_generate_takes(capsys, model):
    """README's ``detlora serve smollm2`` and Hub ids pass the name check (which runs before
    the port is bound: a taken port is the error they reach, with no download or engine)."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", model, "--device", "cpu", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"detlora serve: error: cannot listen on 127.0.0.1:{port}: " \
        "Address already in use", err


@pytest.mark.parametrize(("model", "message"), [
    ("/no/such/model", "model directory /no/such/model does not exist"),
    ("/no/such/model.gguf", "GGUF file /no/such/model.gguf does not exist"),
])
def test_serve_refuses_a_model_that_names_nothing(capsys, model, message):
    assert main(["serve", model, "--device", "cpu", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("detlora serve: error: ") and message in err, err
    assert len(err.strip().splitlines()) == 1

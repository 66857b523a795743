"""Run the commands README.md shows, as a new user would, in the current (extras-free)
virtualenv: the main job exactly as written, then the demo's saved assets, the Python example,
`detlora generate --json`, `detlora serve` with the demo's adapters (and an audit log that
`detlora verify` replays) and `detlora study --quick`.

Used by .ci/run before the test virtualenv is made, so a dependency the README's commands need
but only the test extra brings fails CI. Standard library only: the venv has no test tools.
Exits non-zero naming the first command that failed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def blocks(lang: str) -> list[str]:
    """README's fenced code blocks of one language, in order."""
    return re.findall(rf"^```{lang}\n(.*?)^```", README, re.M | re.S)


def readme_line(pattern: str) -> str:
    """The one README bash line matching ``pattern``."""
    found = [line.strip() for b in blocks("bash") for line in b.splitlines()
             if re.search(pattern, line)]
    if len(found) != 1:
        sys.exit(f"README: expected one bash line matching {pattern!r}, found {found}")
    return found[0]


def run(what: str, cmd: str | list[str], *, cwd: Path, timeout: float) -> str:
    print(f"\n== {what}: {cmd}", flush=True)
    start = time.monotonic()
    done = subprocess.run(cmd, shell=isinstance(cmd, str), cwd=cwd, timeout=timeout,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    print(done.stdout[-4000:], flush=True)
    if done.returncode:
        sys.exit(f"README command failed ({what}, exit {done.returncode}): {cmd}")
    print(f"== {what}: ok in {time.monotonic() - start:.0f} s", flush=True)
    return done.stdout


def check_serve(cmd: str, cwd: Path, audit: Path) -> None:
    """README's serve command on a free port, with an audit log: one completion from an
    adapter, then SIGTERM."""
    key = re.search(r"--api-key (\S+)", cmd)
    argv = [*cmd.split(), "--port", "0", "--audit-log", str(audit)]
    print(f"\n== serve: {' '.join(argv)}", flush=True)
    log = cwd / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline, url = time.monotonic() + 300, None
        while url is None:
            found = re.search(r"on (http://127\.0\.0\.1:\d+) ", log.read_text())
            if found:
                url = found.group(1)
            elif proc.poll() is not None or time.monotonic() > deadline:
                sys.exit("README serve command did not start:\n" + log.read_text()[-3000:])
            time.sleep(0.5)
        model = re.search(r"--lora-modules (\w+)=", cmd).group(1)
        body = json.dumps({"model": model, "prompt": "The sky is", "max_tokens": 4,
                           "temperature": 0}).encode()
        headers = {"Content-Type": "application/json"}
        if key:
            headers["Authorization"] = f"Bearer {key.group(1)}"
        while True:
            try:
                req = urllib.request.Request(url + "/v1/completions", body, headers)
                with urllib.request.urlopen(req, timeout=60) as resp:
                    answer = json.load(resp)
                break
            except OSError:  # the engine still starting: /health says 503 until then
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise
                time.sleep(1)
        assert answer["choices"][0]["text"] and answer["system_fingerprint"], answer
        print(f"== serve: {model} answered {answer['choices'][0]['text']!r}", flush=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
        print(log.read_text()[-1500:])
    if code:
        sys.exit(f"README serve command exited {code} after SIGTERM")


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="readme-"))
    main_job = readme_line(r"# main job")  # the comment line; the command follows it
    bash = blocks("bash")[0].splitlines()
    main_job = bash[[line.strip() for line in bash].index(main_job) + 1].strip()
    run("main job", main_job, cwd=ROOT, timeout=1800)
    # The assets the other commands use: the demo's quick variant keeps them in ./demo.
    save = readme_line(r"detlora demo --save")
    run("demo --save", save.replace("detlora demo", "detlora demo --quick"), cwd=work,
        timeout=900)
    example = work / "example.py"
    example.write_text(blocks("python")[0])
    printed = run("Python example", [sys.executable, str(example)], cwd=work, timeout=900)
    last = printed.strip().splitlines()[-1].split()
    if last[:2] != ["True", "True"]:
        sys.exit(f"README Python example: the same request alone and in a batch differ: {last}")
    prompts = work / "prompts.jsonl"
    prompts.write_text('{"prompt": "What is 2 + 2?"}\n{"prompt": "Name a color."}\n')
    gen = readme_line(r"detlora generate")
    out = run("generate --json", gen.replace("FILE.jsonl", str(prompts)), cwd=work,
              timeout=600)
    lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    if len(lines) != 2 or not all(x.get("token_ids") and x.get("fingerprint") for x in lines):
        sys.exit(f"README generate --json gave {len(lines)} JSON lines, expected 2 with "
                 "token_ids and fingerprint")
    check_serve(readme_line(r"^detlora serve smollm2"), work, work / "audit")
    verify = readme_line(r"^detlora verify")
    run("verify the audit log", [*verify.split()[:2], str(work / "audit")], cwd=work,
        timeout=900)
    study = readme_line(r"detlora study .*--quick")
    run("study --quick", study, cwd=work, timeout=1200)
    print(f"\nREADME commands: all passed ({work})")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    main()

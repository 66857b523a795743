"""Adapter-config patterns: PEFT's matching rules, at a bounded cost.

A ``rank_pattern`` key ``"(.|.)*z"`` hung adapter loading for minutes (Python's ``re``
backtracks exponentially) and, as ``target_modules``, took 17 s; patterns that defeat the
``regex`` package's optimisations too must end in a ValueError within the budget. The
hanging cases run in a subprocess, so that a regression fails by timeout instead of hanging
the suite.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests.helpers.adapter_files import module_shapes, write_adapter

from detlora.lora import patterns
from detlora.lora.peft_loader import load_peft_adapter

ROOT = Path(__file__).resolve().parents[2]
Q0 = "model.layers.0.self_attn.q_proj"
# Named back-references: exponential for `regex` too, and valid inside PEFT's key wrapper.
RUNAWAY = r"(?:(?P<x>.)|(?P<y>.))*(?P=x)(?P=y)"


def _load(path, max_rank=16):
    return load_peft_adapter(path, module_shapes(), max_rank)


def _load_in_subprocess(paths: list[Path], timeout: float) -> list[tuple[float, str]]:
    """(seconds, the error text or 'ok') of loading each path, in one fresh interpreter. The
    first path is loaded once untimed before: the interpreter's first load pays one-time
    costs (lazy imports, torch's thread pool), up to a second on a loaded 2-core machine,
    which are not the patterns' matching time."""
    code = (
        "import json, sys, time\n"
        "from tests.helpers.adapter_files import module_shapes\n"
        "from detlora.lora.peft_loader import load_peft_adapter\n"
        "try:\n"
        "    load_peft_adapter(sys.argv[1], module_shapes(), 16)\n"
        "except ValueError:\n"
        "    pass\n"
        "for path in sys.argv[1:]:\n"
        "    t = time.monotonic()\n"
        "    try:\n"
        "        load_peft_adapter(path, module_shapes(), 16); out = 'ok'\n"
        "    except ValueError as e:\n"
        "        out = str(e)\n"
        "    print(json.dumps([time.monotonic() - t, out]), flush=True)\n"
    )
    env = {"PYTHONPATH": f"{ROOT / 'src'}:{ROOT}", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", code, *map(str, paths)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout, check=True)
    return [tuple(json.loads(line)) for line in proc.stdout.strip().splitlines()]


CASES = [
    ("rank_pattern", {"(.|.)*z": 4}),
    ("target_modules", "(.|.)*z"),
    ("rank_pattern", {RUNAWAY: 4}),
    ("alpha_pattern", {RUNAWAY: 4}),
    ("target_modules", r"(?:(.)|(.))*\1\2"),
    ("layers_pattern", RUNAWAY),
]


def test_backtracking_patterns_finish_within_the_budget(tmp_path):
    paths = []
    for k, (field, value) in enumerate(CASES):
        extra = {"layers_to_transform": [0, 1]} if field == "layers_pattern" else {}
        paths.append(write_adapter(tmp_path / f"a{k}", **{field: value}, **extra))
    results = _load_in_subprocess(paths, timeout=120)
    assert len(results) == len(CASES)
    for (field, value), (seconds, out) in zip(CASES, results, strict=True):
        assert seconds < patterns.MATCH_BUDGET_S + 1.0, (field, value, seconds, out)
        if value == {"(.|.)*z": 4}:
            assert out == "ok"  # matches nothing: r=8 everywhere, as PEFT would decide
        elif value == "(.|.)*z":
            assert "does not target it" in out
        else:
            assert "took more than 1 s" in out and "simplify the pattern" in out, out
            assert field in out


@pytest.mark.parametrize(("config", "match"), [
    ({"rank_pattern": {"q" * 2000: 4}}, r"rank_pattern key pattern 'qqq.*has 2000 characters"),
    ({"target_modules": "x" * 1025}, r"target_modules pattern .* more than the 1024 allowed"),
    ({"alpha_pattern": {f"k{i}": 4 for i in range(5000)}}, r"alpha_pattern has 5000 keys"),
    ({"rank_pattern": {"(a{1000}){1000}": 4}}, r"bounds multiply to more than 10000"),
    ({"target_modules": "q_proj{e<=1}"}, r"uses \{e<=1\}, which is not a counted repetition"),
    ({"rank_pattern": {"[": 4}}, r"rank_pattern key '\[' is not a valid regular expression"),
    ({"target_modules": "(?P<"}, r"target_modules .* is not a valid regular expression"),
    ({"layers_pattern": "layers", "layers_to_transform": None}, r"needs layers_to_transform"),
    ({"target_modules": ".*q_proj", "layers_to_transform": [0]},
     r"cannot be used when target_modules is a string"),
    ({"layers_pattern": 5, "layers_to_transform": [0]}, r"layers_pattern must be a string"),
    ({"layers_pattern": ["layers", 5], "layers_to_transform": [0]},
     r"layers_pattern must be a string pattern, got 5"),
])
def test_pattern_refusals(tmp_path, config, match):
    path = write_adapter(tmp_path / "a", **config)
    t = time.monotonic()
    with pytest.raises(ValueError, match=match):
        _load(path)
    assert time.monotonic() - t < 5


def test_rank_and_alpha_keys_are_looked_up_separately_as_in_peft(tmp_path):
    """PEFT takes the first matching key of rank_pattern for the rank and, on its own, the
    first matching key of alpha_pattern for alpha."""
    path = write_adapter(tmp_path / "a", r=8, alpha=16, ranks={"q_proj": 4},
                         rank_pattern={"q_proj": 4},
                         alpha_pattern={"layers.0.self_attn.q_proj": 32})
    adapter = _load(path)
    assert adapter.modules[Q0].scale == 32 / 4
    assert adapter.modules["model.layers.1.self_attn.q_proj"].scale == 16 / 4


def test_regex_target_modules_and_layers_pattern(tmp_path):
    path = write_adapter(tmp_path / "a", targets=["q_proj", "v_proj"],
                         target_modules=r".*\.(q|v)_proj")
    assert len(_load(path).modules) == 4
    path = write_adapter(tmp_path / "b", targets=["q_proj"], layers=(1,),
                         layers_to_transform=[1], layers_pattern="layers")
    assert sorted(_load(path).modules) == ["model.layers.1.self_attn.q_proj"]
    path = write_adapter(tmp_path / "c", targets=["q_proj"], layers=(1,),
                         layers_to_transform=1, layers_pattern=["h", "layers"])
    assert sorted(_load(path).modules) == ["model.layers.1.self_attn.q_proj"]
    # A layers_pattern that names no layer of this model: nothing is targeted (as in PEFT).
    path = write_adapter(tmp_path / "d", targets=["q_proj"], layers=(1,),
                         layers_to_transform=[1], layers_pattern="blocks")
    with pytest.raises(ValueError, match="does not target it"):
        _load(path)


def test_matching_checks_the_peft_oracle(tmp_path):
    """The module sets PEFT's own matcher selects, for the configs above."""
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists
    from peft.utils.other import get_pattern_key

    modules = sorted(module_shapes())
    cases = [
        dict(target_modules=r".*\.(q|v)_proj"),
        dict(target_modules=["q_proj", "down_proj"], layers_to_transform=[1],
             layers_pattern="layers"),
        dict(target_modules=["q_proj"], layers_to_transform=0),
        dict(target_modules=["o_proj", "up_proj"], rank_pattern={"o_proj": 2, "^model.*up": 3},
             alpha_pattern={r"layers\.1\..*": 7}),
    ]
    for kw in cases:
        cfg = LoraConfig(r=8, lora_alpha=16, **kw)
        saved = {k: sorted(v) if isinstance(v, set) else v for k, v in cfg.to_dict().items()}
        ours = patterns.match_modules(json.loads(json.dumps(saved)), modules, "cfg")
        for m in modules:
            assert ours[m].targeted == bool(check_target_module_exists(cfg, m)), (kw, m)
            for field, key in (("rank_pattern", ours[m].rank_key),
                               ("alpha_pattern", ours[m].alpha_key)):
                want = get_pattern_key(getattr(cfg, field).keys(), m)
                assert key == (want if want in getattr(cfg, field) else None), (kw, m, field)


def test_pattern_matching_never_holds_the_engine_step(llama_dir, tmp_path, llama_adapters):
    """A runaway pattern inside the engine: its request fails within the budget (plus the
    step's own work), the other request of the call runs, and so does the next call."""
    import shutil

    from detlora.config import SamplingParams
    from detlora.entrypoints.llm import LLM
    from detlora.lora.request import LoRARequest

    bad = tmp_path / "bad"
    shutil.copytree(llama_adapters[0], bad)
    cfg = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**cfg, "rank_pattern": {RUNAWAY: 8}}))
    llm = LLM(str(llama_dir), enable_lora=True, max_loras=2, max_lora_rank=8, device="cpu",
              max_model_len=64)
    sp = SamplingParams(temperature=0.0, max_tokens=2)
    t = time.monotonic()
    outs = llm.generate([[3, 4, 5], [6, 7, 8]], sp, [None, LoRARequest("bad", 1, str(bad))],
                        use_tqdm=False)
    assert time.monotonic() - t < patterns.MATCH_BUDGET_S + 3
    assert outs[0].outputs[0].finish_reason == "length"
    error = outs[1].outputs[0].error
    assert outs[1].outputs[0].finish_reason == "error" and error is not None
    assert "rank_pattern key" in error and "took more than 1 s" in error
    ok = llm.generate([[3, 4, 5]], sp, LoRARequest("a0", 2, str(llama_adapters[0])),
                      use_tqdm=False)
    assert ok[0].outputs[0].finish_reason in ("length", "stop")

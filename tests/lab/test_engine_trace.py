"""The lab's engine trace (benchmarks/harness/engine_trace.py): wrapped around an EngineCore,
it records every step and, per request, one receipt, one first token and one finish, and the
engine's outputs are those of an untraced core."""

from dataclasses import replace
from multiprocessing import Pipe

from benchmarks.harness import engine_trace
from benchmarks.suites import engine as be
from detlora.config import SamplingParams
from detlora.engine import core_proc


def _engine(root):
    shape = replace(be.ModelShape(), hidden=64, layers=1, heads=4, kv_heads=2, head_dim=16,
                    intermediate=128, vocab=256, rank=4, alpha=8)
    plan = replace(be.BenchPlan(), shape=shape, prompts=2, prompt_len=4, output_len=2,
                   throughput_batches=(2,))
    be.write_model(root / "model", shape)
    return be.make_engine(root / "model", "batch_invariant", plan, device="cpu").engine


def _serve(core, front) -> list:
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    for k in range(3):
        front.send(("add", core_proc.AddRequest(f"r{k}", [3 + k, 4, 5], params)))
    front.send(("shutdown", True))  # after the running requests finish
    core.run()
    msgs = []
    while front.poll():
        msgs.append(front.recv())
    return [d[:2] for m in msgs if m[0] == "step" for d in m[1]]


def test_one_event_of_each_kind_per_request(tmp_path, monkeypatch):
    trace_file = tmp_path / "trace.jsonl"
    untraced = _serve(*_core(_engine(tmp_path / "a")))
    # install() replaces EngineCore.__init__; monkeypatch puts the original back afterwards.
    monkeypatch.setattr(core_proc.EngineCore, "__init__", core_proc.EngineCore.__init__)
    engine_trace.install(str(trace_file))
    core, front = _core(_engine(tmp_path / "b"))
    assert _serve(core, front) == untraced
    core.conn_out._trace.flush()  # the wrapped pipe holds the trace (flushed at exit too)
    events = engine_trace.read_trace(trace_file)
    per_request = [(e["kind"], e["rid"]) for e in events if "rid" in e]
    assert sorted(per_request) == sorted((k, f"r{i}") for k in ("add", "first", "finish")
                                         for i in range(3))
    steps = [e for e in events if e["kind"] == "step"]
    assert steps and all(e["t1"] >= e["t0"] for e in steps)


def _core(engine):
    core_end, front_end = Pipe()
    return core_proc.EngineCore(engine, core_end, core_end), front_end



def test_first_token_is_a_request_s_first_appearance(tmp_path, monkeypatch):
    """On a GPU a step launched ahead leaves a placeholder token, so a request's token count
    reads 2 at its first token: the trace goes by first appearance, not by the count."""
    from types import SimpleNamespace as NS

    seqs = [NS(request_id="r0", num_output_tokens=2, is_finished=False),
            NS(request_id="r1", num_output_tokens=2, is_finished=False)]
    steps = iter([[seqs[0]], [seqs[0], seqs[1]], [NS(**{**vars(seqs[0]), "is_finished": True}),
                                                   seqs[1]]])
    engine = NS(step_sequences=lambda: next(steps), scheduler=NS(running=[], waiting=[]))
    monkeypatch.setattr(core_proc.EngineCore, "__init__", core_proc.EngineCore.__init__)
    trace_file = tmp_path / "trace.jsonl"
    engine_trace.install(str(trace_file))
    core, _ = _core(engine)
    for _ in range(3):
        core.engine.step_sequences()
    core.conn_out._trace.flush()
    got = [(e["kind"], e["rid"]) for e in engine_trace.read_trace(trace_file) if "rid" in e]
    assert got == [("first", "r0"), ("first", "r1"), ("finish", "r0")]

"""Which frees invalidate a CUDA-graph capture? Each case frees something during a capture (on
torch's side stream, default ``global`` capture mode) and reports whether the capture ended
cleanly. Motivated by a flaky engine capture failure whose first visible error was already
``operation failed due to a previous error during capture``: torch 2.11's ``torch.cuda.graph``
no longer runs ``gc.collect()`` before capturing, so Python's GC may free dead cycles mid-capture.

    PYTHONPATH=src python -m benchmarks.experiments.capture_gc_probe OUT.json
"""

import gc
import json
import subprocess
import sys

CASES = {
    "nothing": "pass",
    "pinned_after_async_copy": "del state['host']",
    "pinned_unused": "del state['plain_host']",
    "cuda_event_recorded": "del state['event']",
    "cycle_with_pinned_collected": "gc.collect()",
    "device_tensor_other_stream": "del state['dev']",
    "captured_graph_destroyed": "del state['old_graph']",
    "cycle_with_captured_graph_collected": "state.pop('graph_cycle_ref'); gc.collect()",
}


def _case(name: str) -> dict:
    import torch

    state = {}
    state["host"] = torch.ones(1 << 20, pin_memory=True)
    d = torch.empty(1 << 20, device="cuda")
    d.copy_(state["host"], non_blocking=True)  # the host allocator records an event
    state["plain_host"] = torch.ones(1 << 20, pin_memory=True)
    state["event"] = torch.cuda.Event()
    state["event"].record()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        state["dev"] = torch.ones(1 << 20, device="cuda") * 2
    cyc = [torch.ones(1 << 20, pin_memory=True)]
    d.copy_(cyc[0], non_blocking=True)
    cyc.append(cyc)
    del cyc  # a dead cycle: only the GC frees it
    # An earlier captured graph (as an earlier engine's decode graphs), and one in a cycle.
    for key in ("old_graph", "graph_cycle_ref"):
        old = torch.cuda.CUDAGraph()
        src = torch.ones(1024, device="cuda")
        with torch.cuda.graph(old):
            dst = src * 3
        holder = [old, dst]
        holder.append(holder)
        state[key] = old if key == "old_graph" else holder
        del old, holder, dst
    gc.collect()
    gc.disable()
    torch.cuda.synchronize()
    x = torch.zeros(1024, device="cuda")
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g):
            y = x + 1
            exec(CASES[name], {"state": state, "gc": gc})
            y = y * 2
        g.replay()
        torch.cuda.synchronize()
        return {"case": name, "captured": True, "ok": bool((y == 2).all())}
    except Exception as e:  # the point is to see which fail
        return {"case": name, "captured": False, "error": f"{type(e).__name__}: {e}"[:300]}


def main(out_path: str) -> None:
    import torch

    from benchmarks.harness import results_meta, write_results
    from benchmarks.harness.meta import REPO_ROOT

    rows = []
    for name in CASES:  # one process per case: a failed capture may leave the context odd
        r = subprocess.run([sys.executable, "-m", "benchmarks.experiments.capture_gc_probe",
                            "--case", name], capture_output=True, text=True, timeout=120,
                           cwd=REPO_ROOT)
        line = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
        rows.append(json.loads(line) if line.startswith("{") else
                    {"case": name, "captured": None, "error": r.stderr[-300:]})
        print(rows[-1], flush=True)
    meta = results_meta("python -m benchmarks.experiments.capture_gc_probe OUT.json")
    write_results(out_path, {"meta": meta, "torch": torch.__version__, "rows": rows})


if __name__ == "__main__":
    if sys.argv[1] == "--case":
        print(json.dumps(_case(sys.argv[2])))
    else:
        main(sys.argv[1])

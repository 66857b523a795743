"""One-off GPU experiment, kept as the record of benchmarks/results/rms_norm_store_hints.json:
rms_norm and fused_add_rms_norm with cache hints on their stores, each variant compiled from
a patched copy of src/detlora/ops/rms_norm.py. It ran at commit 988e34a; c95e321 adopted
``evict_first`` on the output store, so run it from 988e34a to repeat it (the line it patches
changed).

    PYTHONPATH=src OUT=out python benchmarks/experiments/rms_store_hints.py
"""

import importlib.util
import json
import os
import sys

import torch

from benchmarks.harness.timing import input_sets_for, time_graph_us
from detlora.study.bench_rowwise import HBM_BYTES_PER_S, _rms_bytes

with open("src/detlora/ops/rms_norm.py") as f:
    SRC = f.read()
Y = "tl.store(y_rows + o[None, :], y.to(y_rows.dtype.element_ty), mask=ok)"
R1 = "tl.store(ro_rows + offs[None, :], s.to(res_out_ptr.dtype.element_ty), mask=ok)"
assert Y in SRC and R1 in SRC


def variant(name, y_hint, r_hint):
    src = SRC.replace(Y, Y[:-1] + y_hint + ")").replace(R1, R1[:-1] + r_hint + ")")
    path = f"/tmp/{name}.py"
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


variants = {
    "default": variant("rms_default", "", ""),
    "y_cs": variant("rms_y_cs", ', cache_modifier=".cs"', ""),
    "both_cs": variant("rms_both_cs", ', cache_modifier=".cs"', ', cache_modifier=".cs"'),
    "y_evict_first": variant("rms_y_ef", ', eviction_policy="evict_first"', ""),
}
rows = []
g = torch.Generator(device="cuda").manual_seed(1)
for h in (1024, 3072):
    w = (torch.randn(h, device="cuda", generator=g) + 1).bfloat16()
    for m in (1024, 4096):
        moved = _rms_bytes(m, h)
        sets = [tuple(torch.randn(m, h, device="cuda", generator=g).bfloat16() for _ in range(4))
                for _ in range(input_sets_for(moved["rms_norm"]))]
        for name, mod in variants.items():
            for op in ("rms_norm", "fused_add_rms_norm"):
                if op == "rms_norm":
                    def f(s, mod=mod, w=w):
                        return mod.rms_norm(s[0], w, 1e-5, out=s[2])
                else:
                    def f(s, mod=mod, w=w):
                        return mod.fused_add_rms_norm(s[0], s[1], w, 1e-5, out=s[2],
                                                      residual_out=s[3])
                us = time_graph_us([(lambda s=s, f=f: f(s)) for s in sets])
                floor = moved[op] / HBM_BYTES_PER_S * 1e6
                row = {"op": op, "H": h, "M": m, "variant": name, "us": round(us, 3),
                       "floor_fraction": round(floor / us, 3)}
                print(row, flush=True)
                rows.append(row)
        del sets
        torch.cuda.empty_cache()
with open(os.path.join(os.environ.get("OUT", "."), "rms_norm_store_hints.json"), "w") as f:
    json.dump(rows, f, indent=1)

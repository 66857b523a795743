"""Compile a Triton kernel for sm_90 (H100/H200) on a CPU-only machine, without a GPU.

Catches compile errors and shows the PTX (cp.async vector loads, wgmma or mma.sync, atomics)
before any device time is spent. A test helper: the ``sm90_compile`` fixture (tests/conftest.py)
runs scripts with ``src`` and ``tests/ops`` on the path, which then do:

    from compile_sm90 import compile_kernel
    k, seconds = compile_kernel(my_kernel, {"BLOCK": 64}, {"out_ptr": "*fp32"},
                                div16=("stride_xm",))
    print(k.asm["ptx"])

Pointers default to ``*bf16`` and ints to ``i32``; every pointer and each name in ``div16``
gets the divisible-by-16 hint that Triton's launcher gives aligned arguments. Running this file
(``python tests/ops/compile_sm90.py``) compiles the LoRA kernels in every mode and prints
what their PTX uses.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def compile_kernel(fn, consts, ptr_types, num_warps=4, num_stages=3, default_ptr="*bf16",
                   div16=(), int_types=None):
    int_types = int_types or {}
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
            continue
        if name.endswith("_ptr"):
            sig[name] = ptr_types.get(name, default_ptr)
        else:
            sig[name] = int_types.get(name, "i32")
        if name.endswith("_ptr") or name in div16:
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, sig, consts, attrs)
    t0 = time.time()
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": num_warps, "num_stages": num_stages})
    return kernel, time.time() - t0


PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


def ptxas_spills(ptx: str) -> int:
    """Bytes of register spill stores when Triton's bundled ptxas assembles ``ptx`` for
    sm_90a (0 is what the kernels are held to)."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    info = subprocess.run([str(PTXAS), "-arch=sm_90a", "-v", f.name, "-o", "/dev/null"],
                          capture_output=True, text=True, check=True).stderr
    return sum(int(s) for s in re.findall(r"(\d+) bytes spill stores", info))


def ptx_summary(ptx: str) -> dict[str, int]:
    pattern = r"(wgmma\.mma_async|mma\.sync|cp\.async\.cg|cp\.async\.bulk|ld\.global\.v4|" \
              r"ld\.global\.cg|atom\.global[\.\w]*|(?<![\w.])red\.global[\.\w]*|bar\.sync|" \
              r"griddepcontrol\.\w+)"
    return dict(Counter(re.findall(pattern, ptx)))


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
    from detlora.ops import lora_expand, lora_shrink

    ints = ("H", "N", "stride_xm", "stride_al", "stride_as", "stride_ar", "stride_ps")
    ptrs = {n: "*fp32" for n in ("out_ptr", "scratch_ptr", "scale_ptr")}
    ptrs |= {n: "*i32" for n in ("rows_ptr", "group_start_ptr", "group_size_ptr",
                                 "group_adapter_ptr", "counter_ptr")}
    for mode in range(4):
        for bm in (16, 64):
            for cap in (0, 8):  # GROUP_CAP: one program per adapter group, or 8 that loop
                consts = {"MODE": mode, "SPLIT": 1 if mode == 0 else 12, "TAIL_GROUP": 3,
                          "TREE_IN_CTA": mode in (0, 2), "BLOCK_M": bm, "BLOCK_N": 16,
                          "BLOCK_K": 128, "EVEN_K": True, "GROUP_CAP": cap}
                k, dt = compile_kernel(lora_shrink._shrink_kernel, consts, ptrs, div16=ints)
                print(f"shrink mode={mode} BLOCK_M={bm} GROUP_CAP={cap}: "
                      f"{ptx_summary(k.asm['ptx'])} ({dt:.1f}s)")
    k, _ = compile_kernel(
        lora_shrink._tree_reduce_kernel,
        {"SPLIT_P2": 8, "LOG2_SPLIT": 3, "BLOCK_M": 16, "BLOCK_N": 64},
        {"scratch_ptr": "*fp32", "out_ptr": "*fp32", "scale_ptr": "*fp32",
         "token_adapter_ptr": "*i32"})
    print(f"tree reduce: {ptx_summary(k.asm['ptx'])}")
    for cap in (0, 8):
        k, _ = compile_kernel(
            lora_expand._expand_kernel,
            {"NUM_PARTS": 1, "TAIL_GROUP": 1, "PARTIALS": False, "BLOCK_M": 16, "BLOCK_N": 128,
             "BLOCK_R": 16, "EVEN_R": False, "RANKS": True, "ROW_LOOP": bool(cap),
             "PDL": True},
            {"h_ptr": "*fp32", "scale_ptr": "*fp32", "ranks_ptr": "*i32", "rows_ptr": "*i32",
             "group_start_ptr": "*i32", "group_size_ptr": "*i32", "group_adapter_ptr": "*i32",
             "row_tiles_ptr": "*i32"})
        print(f"expand ROW_LOOP={bool(cap)}: {ptx_summary(k.asm['ptx'])}")

if __name__ == "__main__":
    main()

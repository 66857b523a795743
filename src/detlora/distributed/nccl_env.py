"""NCCL settings that make its all-reduce repeat its bits (the run_to_run level).

NCCL picks an algorithm, a protocol and a number of channels per call from the message size
and the topology, and each choice adds the ranks' values in another order. At run_to_run
the row-parallel layers all-reduce through NCCL, so the engine pins the choices before the
first communicator exists (vLLM's batch-invariant mode pins the same ones): the tree
algorithm for all-reduce, the Simple protocol, one channel. Values already in the
environment win. batch_invariant never lets NCCL add (the ranks gather fp32 partials and add
them in a fixed order), and fast leaves NCCL free. NCCL_NVLS_ENABLE is left as it is.
"""

from __future__ import annotations

import os

RUN_TO_RUN_NCCL = {
    "NCCL_ALGO": "allreduce:tree",
    "NCCL_PROTO": "Simple",
    "NCCL_MIN_NCHANNELS": "1",
    "NCCL_MAX_NCHANNELS": "1",
}


def pin_nccl_for_run_to_run() -> dict[str, str]:
    """Set the run_to_run NCCL variables this process (and the workers it spawns) lack;
    returns the values in effect."""
    for name, value in RUN_TO_RUN_NCCL.items():
        os.environ.setdefault(name, value)
    return {name: os.environ[name] for name in RUN_TO_RUN_NCCL}

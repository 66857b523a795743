"""The paper's figures, set beside the study's own in every table of the report.

Source: "Reproducible LoRA Inference Through Deterministic Split-K Reduction" (Balusamy and
Mohan, arXiv 2611.10334, 2026), measured in vLLM on an NVIDIA RTX PRO 6000 Blackwell with
Llama-3.2-3B, Gemma and Nemotron models, LoRA ranks 16 and 32, GSM8K, MBPP and Civil Comments.
Its reductions map onto detlora's: Atomic Split-K=8 is ``atomic``, Split-K=1 ``unsplit``,
Deterministic Split-K=8 ``ordered``; its earlier design with a separate reduction launch is
``tree``. ``ordered_bi``, ``in_gemm`` and the ``batch_invariant`` level have no counterpart.
"""

from __future__ import annotations

TITLE = "Reproducible LoRA Inference Through Deterministic Split-K Reduction"
CITATION = f'"{TITLE}" (Balusamy and Mohan, arXiv 2611.10334, 2026)'

# detlora reduction -> the paper's name for it
NAMES = {"atomic": "Atomic SK8", "unsplit": "SK1", "ordered": "Det. SK8",
         "tree": "Det. SK8 (separate reduction launch)"}

# Section 6.1: identical-input shrink replay, 109,760 comparisons per implementation.
REPLAY = {"atomic": "107,136/109,760 (97.61%); prefill 99.996%, first decode 95.22%",
          "unsplit": "0/109,760", "ordered": "0/109,760"}

# Table 1: 2,700 comparisons per dataset and reduction (repetitions 1-9 against 0).
REPEAT = {
    ("arithmetic", "atomic"): "GSM8K: 467/2,700 (17.30%) changed, 84 correctness flips",
    ("arithmetic", "unsplit"): "GSM8K: 0, 0 flips",
    ("arithmetic", "ordered"): "GSM8K: 0, 0 flips",
    ("code", "atomic"): "MBPP: 404/2,700 (14.96%) changed, 53 test-outcome flips",
    ("code", "unsplit"): "MBPP: 0, 0 flips",
    ("code", "ordered"): "MBPP: 0, 0 flips",
}

# Table 3: Llama-3.2-3B, GSM8K, batch sizes 1, 16, 32, 64, ranks 16 and 32.
CROSS_BATCH_FIXED = {"atomic": "1,748/4,608 (37.93%)", "unsplit": "0/4,608",
                     "ordered": "0/4,608"}
CROSS_BATCH_CHANGED = {"atomic": "168/384 (43.75%)", "unsplit": "152/384 (39.58%)",
                       "ordered": "150/384 (39.06%)"}

# Table 2: Qwen3-0.6B + rank-16 adapter, 1,000 Civil Comments x 10 runs = 9,000 comparisons.
DECISIONS = {
    "atomic": {"changed": "81.47%", "mean_abs_drift": "0.00143", "max_abs_drift": "0.05672",
               "flips": "7 (2 comments)", "accuracy": "94.25%"},
    "unsplit": {"changed": "0", "mean_abs_drift": "0", "max_abs_drift": "0", "flips": "0",
                "accuracy": "94.20%"},
    "ordered": {"changed": "0", "mean_abs_drift": "0", "max_abs_drift": "0", "flips": "0",
                "accuracy": "94.30%"},
}

# Section 6.2: the traced divergence.
TRACE = (
    "Llama-3.2-3B, rank-16 GSM8K adapter: two Atomic SK8 runs share 35 tokens and choose "
    "'There' / 'Each' at token 36 (final answers 7, correct, and 8). The first propagating "
    "difference is in the layer-2 MLP up-projection shrink at prompt position 47 "
    "(0.010345458984375 against 0.010345457121729851, 1.86e-9 apart, on two sides of a BF16 "
    "rounding midpoint); the layer-3 KV cache then holds 108 differing K and 176 differing V "
    "elements at that position. Continuing with SK1 from each run's KV cache: cache A gives "
    "'There' (logits 21.75 and 21.75), cache B 'Each' ('There' 21.625, 'Each' 21.75), "
    "repeatably across two trials."
)

# Section 6.6 and Table 4: 50 sequential requests of 150 tokens, CUDA graphs.
PERFORMANCE = (
    "Det. SK8 is 1.69% slower than Atomic SK8 end to end on average (1.02-2.62% over 12 "
    "model/dataset/rank configurations) and 19.2% faster than SK1 (16.8-21.1%); at batch 64 "
    "Det. SK8 gives 6,079 and 6,060 output tok/s (ranks 16, 32) against 5,274 and 5,257 for "
    "SK1, 1.5-1.7% below Atomic SK8."
)
PERFORMANCE_OVERHEAD_VS_ATOMIC = 0.0169

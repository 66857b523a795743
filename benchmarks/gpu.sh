#!/usr/bin/env bash
# Every GPU test and benchmark, in one call on the GPU machine. No installs there: run from the
# repository root with PYTHONPATH=src; lab modules run as `python3 -m benchmarks.<...>`.
# Results land in $OUT (or ./out), each with a row in $OUT/history.jsonl; take them into the
# repository with `python -m benchmarks.record out/NAME.json` and refresh docs/results.md with
# `python -m benchmarks.report`.
#
#   benchmarks/gpu.sh [STEP ...]        (no step: tests kernels ops engine)
#
# Steps:
#   GPU tests         tests (all of tests/gpu) | tests-kernels, tests-engine, tests-rest (its
#                     three parts)
#                     gpu-ops-tests attention-tests matmul-tests engine-tests sampling-tests
#                     penalty-engine-tests structured-tests (installs .whl/*.whl first)
#                     study-tests multi-lora-tests robust-tests short-requests-tests
#                     nemotron-tests (hybrid Mamba-2 kernels at the 4B shape, a tiny
#                     Nemotron-H's bits)
#                     tensor-parallel-tests (ops and simulated ranks on 1 GPU; the engine
#                     tests need 2+) | tensor-parallel-uneven-tests (issue 50, 1 GPU)
#                     gemma-tests (sliding-window / head_dim 512 kernels, Gemma engines)
#                     | gemma-engine-tests (the Gemma engines only: a verdict per condition)
#                     head-dim-tests (head_dim 96 / 80 beside 128: attention, rotary and
#                     KV-write kernels bit for bit; then the Qwen2 / Mistral / Phi-3 engines
#                     with windows, Mistral at head_dim 80 and Phi-3 at 96)
#   suites            kernels kernels-quick sweep (LoRA kernels) | ops ops-matmul
#                     ops-attention (batch-invariant ops) | engine | prefix-cache | profile
#                     profile-levels profile-small (SmolLM2, Qwen3-0.6B shapes) profile-bi-large profile-overlap profile-adapters
#                     profile-slot-cost (one adapter in use, 1 and 64 slots: kernel tables)
#                     | attention-tiles
#                     split-kv-sweep | matmul-small-m | rms-warps | expand-configs
#                     shrink-chunks | multi-lora (or in parts: multi-lora-traffic
#                     multi-lora-invariance slot-cost) | serving (installs .whl/*.whl
#                     first: the server's wheels)
#                     evals (lm-eval's requests through `detlora serve` on SmolLM2: the server's
#                     and lm-eval's wheels from .whl/, SmolLM2 as for study)
#                     audit (the audit log: serving with and without it at concurrency 64,
#                     detlora verify against offline; the server's wheels from .whl/)
#                     study (detlora study: SmolLM2-135M-Instruct and the Llama-3.2-3B shape;
#                     $STUDY_MODELS picks "smollm2", "3b", "e4b" (the Gemma 4 E4B shape,
#                     random weights) or "nemotron" (the Nemotron-3-Nano-4B shape, random
#                     weights) (each to $OUT/study-<model>, for
#                     `detlora study --merge`); $STUDY_ARGS adds options, e.g. --sections
#                     replay,repeat or --reductions ordered; installs .whl/*.whl
#                     first, where matplotlib's wheels give the figures; without them
#                     `detlora study --render out/study` draws them from study.json)
#                     | tensor-parallel (2+ GPUs: TP 1 against 2)
#                     | architectures (the base-architecture registry: qwen2.5-7b, mistral-7b,
#                     phi3.5-mini, ...; $ARCH_MODELS="a,b" runs some) | architectures-tests
#                     (the Gemma shapes: ARCH_MODELS=gemma4-e4b,gemma3-1b,gemma3-4b)
#                     | architectures-gemma (Gemma 4 E4B, Gemma 3 1B / 4B: checks across the
#                     window and the 32k-context TPOT; one shape per step:
#                     architectures-gemma-e4b, -1b, -4b, each to its own JSON)
#                     | small-models (SmolLM2 and the Qwen3-0.6B shape: TPOT per level, short
#                     requests offline and through the server, demo first/second run; the
#                     server's wheels from .whl/; $SMALL_MODELS_ARGS adds options, e.g.
#                     --parts levels,offline or --serve-args "..."); or in two calls,
#                     small-models-demo then small-models-rest (one small_models.json)
#                     | architectures-nemotron (the Nemotron-3-Nano-4B shape's rows, into the
#                     same architectures.json)
#   experiments       attention-decode-ctas attention-fold capture-gc-probe copy-reference
#                     cublas-kernels expand-group-cap first-cache-hit fused-lora-norm fused-qkv
#                     l2-read matmul-bounds matmul-regions matmul-split-counts
#                     matmul-two-part matmul-two-part-rule matmul-unsplit-tiles pdl-decode
#                     penalized-profile prefill-host rms-persistent run-ahead-cases
#                     serving-timeline (the server's wheels from .whl/) expand-spread-tiles
#                     shared-inflight-pages vendor-gemm multi-lora-waves mamba-replay-cost
#                     row-linear-loads (o/down at decode sizes, Qwen2.5-7B beside Mistral)
#
# A/B on one machine: DETLORA_SRC=DIR runs the steps against another checkout's src (say
# `git archive OLD src | tar -x -C ab/`, untracked so that it travels), with
# DETLORA_COMMIT=OLD and OUT=$OUT/old; the lab code stays this checkout's.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=${DETLORA_SRC:-$PWD/src}${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests kernels ops engine)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu \
  --format=csv | tee "$OUT/nvidia_smi.txt"

gpu_tests() {  # gpu_tests LOG TAIL PYTEST-ARGS...
  local log=$1 tail=$2
  shift 2
  python3 -m pytest -q "$@" -p no:cacheprovider 2>&1 | tee "$OUT/$log" | tail -n "$tail"
}

experiment() {  # experiment NAME OUT-FILE [ARGS...]: python -m benchmarks.experiments.NAME
  local name=$1 file=$2
  shift 2
  python3 -m "benchmarks.experiments.$name" "$OUT/$file" "$@"
}

# The GPU image lacks FastAPI, uvicorn, httptools, pydantic and xgrammar: their wheels travel in .whl/
# (benchmarks/README.md lists them) and go into /tmp/site, after src on the path.
server_wheels() {
  if compgen -G ".whl/*.whl" >/dev/null && { [ ! -d /tmp/site/xgrammar ] || {
      compgen -G ".whl/lm_eval-*.whl" >/dev/null && [ ! -d /tmp/site/lm_eval ]; }; }; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl
  fi
  [ -d /tmp/site ] && export PYTHONPATH=$PYTHONPATH:/tmp/site
  return 0
}

study() {  # the paper's study on the embedded model and the Llama-3.2-3B shape (random weights)
  # STUDY_MODELS: "smollm2", "3b" or both (default); each model's run goes to its own
  # $OUT/study-<model> (merge them with `detlora study --merge`), both in one to $OUT/study.
  local tmp models=${STUDY_MODELS:-"smollm2 3b"} rc=0 m args out
  tmp=$(mktemp -d)
  case " $models " in *" 3b "*)
    python3 -c "import sys; from pathlib import Path; \
from benchmarks.suites.engine import ModelShape, write_model; \
write_model(Path(sys.argv[1]), ModelShape())" "$tmp/Llama-3.2-3B-shape" || return 1 ;;
  esac
  case " $models " in *" e4b "*)
    python3 -c "import sys; from pathlib import Path; \
from benchmarks.suites.architectures_gemma import GEMMA4_E4B, write_checkpoint; \
write_checkpoint(Path(sys.argv[1]), GEMMA4_E4B)" "$tmp/Gemma-4-E4B-shape" || return 1 ;;
  esac
  case " $models " in *" nemotron "*)
    python3 -c "import sys; from pathlib import Path; \
from benchmarks.suites.architectures_nemotron import SHAPES, write_model; \
write_model(Path(sys.argv[1]), SHAPES['nemotron-3-nano-4b'].config, 'cuda')" \
      "$tmp/Nemotron-3-Nano-4B-shape" || return 1 ;;
  esac
  if [ "$models" = "smollm2 3b" ]; then
    # shellcheck disable=SC2086 # STUDY_ARGS is a list of options
    python3 -m detlora.entrypoints.cli study smollm2 "$tmp/Llama-3.2-3B-shape" \
      --tokenizer smollm2 --out "$OUT/study" --no-progress ${STUDY_ARGS:-} || rc=1
  else
    for m in $models; do
      case $m in
        smollm2) args=(smollm2) ;;
        3b) args=("$tmp/Llama-3.2-3B-shape" --tokenizer smollm2) ;;
        e4b) args=("$tmp/Gemma-4-E4B-shape" --tokenizer smollm2) ;;
        nemotron) args=("$tmp/Nemotron-3-Nano-4B-shape" --tokenizer smollm2) ;;
        *) echo "STUDY_MODELS: unknown model $m (smollm2, 3b, e4b, nemotron)"; rc=1
           continue ;;
      esac
      out="$OUT/study-$m"
      # shellcheck disable=SC2086 # STUDY_ARGS is a list of options
      python3 -m detlora.entrypoints.cli study "${args[@]}" --out "$out" --no-progress \
        ${STUDY_ARGS:-} || rc=1
    done
  fi
  rm -rf "$tmp"
  return $rc
}

status=0
for step in "${steps[@]}"; do
  echo "=== $step ($(date -u +%T))"
  case $step in
    # The whole GPU suite took 540 s at b6b0cce, near one device call's 600 s limit: the three
    # parts below (together all of tests/gpu) fit a call each.
    tests) gpu_tests gpu_tests.log 45 tests/gpu --durations=15 || status=1 ;;
    tests-kernels) gpu_tests gpu_tests_kernels.log 45 tests/gpu/test_lora_kernels_gpu.py \
                     tests/gpu/test_matmul_gpu.py tests/gpu/test_paged_attention_gpu.py \
                     tests/gpu/test_rowwise_ops_gpu.py tests/gpu/test_pdl_gpu.py \
                     tests/gpu/test_head_dim_gpu.py --durations=15 || status=1 ;;
    tests-engine) gpu_tests gpu_tests_engine.log 45 tests/gpu/test_engine_gpu.py \
                    tests/gpu/test_models_gpu.py tests/gpu/test_sampling_gpu.py \
                    tests/gpu/test_demo_gpu.py tests/gpu/test_multi_lora_gpu.py \
                    tests/gpu/test_short_requests_gpu.py \
                    --durations=15 || status=1 ;;
    tests-rest) server_wheels  # the files neither half above runs (the server's wheels first)
                gpu_tests gpu_tests_rest.log 45 tests/gpu/test_robust_gpu.py \
                  tests/gpu/test_structured_gpu.py tests/gpu/test_study_gpu.py \
                  tests/gpu/test_tensor_parallel_ops_gpu.py tests/gpu/test_tensor_parallel_gpu.py \
                  tests/gpu/test_audit_gpu.py tests/gpu/test_bases_gpu.py \
                  tests/gpu/test_nemotron_h_gpu.py --durations=15 || status=1 ;;
    gpu-ops-tests) gpu_tests gpu_ops_tests.log 25 tests/gpu/test_paged_attention_gpu.py \
                     tests/gpu/test_matmul_gpu.py tests/gpu/test_rowwise_ops_gpu.py || status=1 ;;
    attention-tests) gpu_tests attention_tests.log 15 tests/gpu/test_paged_attention_gpu.py \
                       || status=1 ;;
    matmul-tests) gpu_tests matmul_gpu_tests.log 15 tests/gpu/test_matmul_gpu.py || status=1 ;;
    engine-tests) gpu_tests engine_gpu_tests.log 25 tests/gpu/test_engine_gpu.py || status=1 ;;
    short-requests-tests) gpu_tests gpu_tests_short_requests.log 25 \
                            tests/gpu/test_short_requests_gpu.py || status=1 ;;
    sampling-tests) gpu_tests gpu_tests_sampling.log 25 tests/gpu/test_sampling_gpu.py \
                      || status=1 ;;
    penalty-engine-tests) gpu_tests gpu_tests_penalties.log 25 tests/gpu/test_engine_gpu.py \
                            -k "penal or sync" || status=1 ;;
    study-tests) gpu_tests gpu_tests_study.log 25 tests/gpu/test_study_gpu.py || status=1 ;;
    gemma-tests) gpu_tests gpu_tests_gemma.log 25 tests/gpu/test_gemma_gpu.py --durations=10 \
                   || status=1 ;;
    # The engine half alone; each condition's verdict is also in the log as it comes.
    gemma-engine-tests) gpu_tests gpu_tests_gemma_engine.log 60 tests/gpu/test_gemma_gpu.py \
                          -k engine_invariance --durations=10 || status=1 ;;
    nemotron-tests) gpu_tests gpu_tests_nemotron.log 25 tests/gpu/test_nemotron_h_gpu.py \
                      --durations=10 || status=1 ;;
    head-dim-tests) gpu_tests gpu_tests_head_dim.log 25 tests/gpu/test_head_dim_gpu.py \
                      tests/gpu/test_bases_gpu.py --durations=10 || status=1 ;;
    multi-lora-tests) gpu_tests gpu_tests_multi_lora.log 25 tests/gpu/test_multi_lora_gpu.py \
                        --durations=10 || status=1 ;;
    tensor-parallel-tests) gpu_tests gpu_tests_tensor_parallel.log 25 \
                             tests/gpu/test_tensor_parallel_ops_gpu.py \
                             tests/gpu/test_tensor_parallel_gpu.py --durations=10 || status=1 ;;
    # Issue 50 on ONE GPU: uneven real widths, 2-8 ranks simulated (ops and two models).
    tensor-parallel-uneven-tests) gpu_tests gpu_tests_tp_uneven.log 25 \
                                    tests/gpu/test_tensor_parallel_ops_gpu.py \
                                    tests/gpu/test_tensor_parallel_gpu.py -k "uneven or \
                                    shard or silu or attention or simulated" \
                                    --durations=10 || status=1 ;;
    # Non-finite logits at every level (eager and graphs), engines built and dropped ten
    # times at the default memory utilization, the greedy head's finite flag.
    robust-tests) gpu_tests gpu_tests_robust.log 30 tests/gpu/test_robust_gpu.py \
                    tests/gpu/test_sampling_gpu.py \
                    "tests/gpu/test_engine_gpu.py::test_capture_survives_a_dead_engine_collected_mid_capture" \
                    --durations=10 -rA || status=1 ;;

    kernels) python3 -m benchmarks.suites.lora_kernels --out "$OUT/lora_kernels.json" \
               || status=1 ;;
    # Traffic over 1,000 adapters, the slot-cost sweep and the invariance checks; each part
    # alone with --parts traffic|slot_cost|invariance.
    multi-lora) python3 -m benchmarks.suites.multi_lora --out "$OUT/multi_lora.json" \
                  || status=1 ;;
    # The multi-LoRA suite in parts that each fit one device call (~3-4 min): traffic with its
    # invariance rows; the slot-only invariance checks; the slot-cost sweep of both shapes.
    multi-lora-traffic) python3 -m benchmarks.suites.multi_lora --parts traffic \
                          --out "$OUT/multi_lora_traffic.json" || status=1 ;;
    multi-lora-invariance) python3 -m benchmarks.suites.multi_lora --parts invariance \
                             --out "$OUT/multi_lora_invariance.json" || status=1 ;;
    slot-cost) python3 -m benchmarks.suites.multi_lora --parts slot_cost \
                 --out "$OUT/multi_lora_slots.json" || status=1 ;;
    kernels-quick) python3 -m benchmarks.suites.lora_kernels --quick \
                     --out "$OUT/lora_kernels_quick.json" || status=1 ;;
    sweep) python3 -m benchmarks.suites.lora_kernels --sweep-only --out "$OUT/lora_sweep.json" \
             || status=1 ;;
    ops) python3 -m benchmarks.suites.batch_invariant_ops --out "$OUT/batch_invariant_ops.json" \
           || status=1 ;;
    ops-matmul) python3 -m benchmarks.suites.batch_invariant_ops --parts matmul \
                  --out "$OUT/batch_invariant_ops_matmul.json" || status=1 ;;
    ops-attention) python3 -m benchmarks.suites.batch_invariant_ops --parts attention \
                     --out "$OUT/batch_invariant_ops_attention.json" || status=1 ;;
    engine) python3 -m benchmarks.suites.engine --out "$OUT/engine.json" || status=1 ;;
    # Base architectures (random bf16 weights, rank-16 adapters): $ARCH_MODELS picks among the
    # registry of benchmarks/suites/architectures.py (default: all); rows of the models not
    # run are kept from the recorded file.
    architectures) python3 -m benchmarks.suites.architectures \
                     ${ARCH_MODELS:+--models "$ARCH_MODELS"} \
                     --keep-rows-from benchmarks/results/architectures.json \
                     --out "$OUT/architectures.json" || status=1 ;;
    architectures-tests) gpu_tests gpu_tests_architectures.log 25 \
                           tests/gpu/test_bases_gpu.py --durations=10 || status=1 ;;
    architectures-gemma) python3 -m benchmarks.suites.architectures_gemma \
                           --out "$OUT/architectures_gemma.json" || status=1 ;;
    architectures-gemma-e4b|architectures-gemma-1b|architectures-gemma-4b)
      m=${step#architectures-gemma-}
      case $m in e4b) m=gemma4-e4b ;; 1b) m=gemma3-1b ;; 4b) m=gemma3-4b ;; esac
      python3 -m benchmarks.suites.architectures_gemma --models "$m" \
        --out "$OUT/architectures_gemma_$m.json" || status=1 ;;
    # The Nemotron-3-Nano-4B shape (a hybrid: its own roofline and checks) into the same file:
    # the rows of this call's architectures step, else the recorded ones, stay.
    architectures-nemotron)
      keep=benchmarks/results/architectures.json
      [ -f "$OUT/architectures.json" ] && keep=$OUT/architectures.json
      python3 -m benchmarks.suites.architectures_nemotron --keep-rows-from "$keep" \
        --out "$OUT/architectures.json" || status=1 ;;
    study) server_wheels; study || status=1 ;;
    prefix-cache) python3 -m benchmarks.suites.prefix_cache --out "$OUT/prefix_caching.json" \
                    || status=1 ;;
    profile) python3 -m benchmarks.suites.profile_engine --modes fast,run_to_run,batch_invariant \
               --out "$OUT/profile_engine.json" || status=1 ;;
    profile-levels) python3 -m benchmarks.suites.profile_engine --modes run_to_run,batch_invariant \
                      --batches 1,64 --tokens 16 --out "$OUT/profile_levels.json" || status=1 ;;
    # A batch-64 step with its rows on 1 adapter, then spread over 8 and 32 (one slot each).
    profile-adapters)
      for n in 1 8 32; do
        python3 -m benchmarks.suites.profile_engine --modes batch_invariant --batches 64 \
          --tokens 16 --adapters "$n" --out "$OUT/profile_adapters_$n.json" || status=1
      done ;;
    profile-slot-cost)
      for n in 1 64; do
        python3 -m benchmarks.suites.profile_engine --modes batch_invariant --batches 1,64 \
          --tokens 16 --max-loras "$n" --out "$OUT/profile_slot_cost_$n.json" || status=1
      done ;;
    # Small models (issue: small models, short requests): fast vs batch_invariant per kernel.
    profile-small)
      for shape in smollm2 qwen3-0.6b; do
        python3 -m benchmarks.suites.profile_engine --shape "$shape" --modes fast,batch_invariant \
          --batches 1,64 --tokens 16 --out "$OUT/profile_small_$shape.json" || status=1
      done ;;
    profile-bi-large) python3 -m benchmarks.suites.profile_engine --modes batch_invariant \
                        --batches 64,256 --tokens 16 --out "$OUT/profile_bi_large.json" \
                        || status=1 ;;
    profile-overlap) python3 -m benchmarks.suites.profile_engine --modes run_to_run --batches 64 \
                       --tokens 150 --overlap --out "$OUT/profile_overlap.json" || status=1 ;;
    attention-tiles) python3 -m benchmarks.suites.attention --sweep tiles \
                       --out "$OUT/attention_tile_sweep.json" || status=1 ;;
    split-kv-sweep) python3 -m benchmarks.suites.attention --sweep split-kv \
                      --out "$OUT/split_kv_sweep.json" || status=1 ;;
    matmul-small-m) python3 -m benchmarks.suites.matmul --sweep --paths persistent --ms 1,64 \
                      --layers llama_o,llama_qkv,llama_down,qwen_down,qwen_o \
                      --out "$OUT/matmul_sweep_small_m_persistent.json" || status=1 ;;
    rms-warps) python3 -m benchmarks.suites.rowwise --rms-sweep --hiddens 1024,3072 \
                 --ms 1024,4096 --rows 1,2 --warps 4,8,16,32 --out "$OUT/rms_norm_warps.json" \
                 || status=1 ;;
    expand-configs) python3 -m benchmarks.suites.expand_configs \
                      --out "$OUT/expand_configs.json" || status=1 ;;
    shrink-chunks) python3 -m benchmarks.suites.shrink_chunks \
                     --out "$OUT/r2r_shrink_chunks.json" || status=1 ;;
    evals) server_wheels; python3 -m benchmarks.suites.evals --out "$OUT/evals.json" \
             || status=1 ;;
    serving) server_wheels
             python3 -m benchmarks.suites.serving --out "$OUT/serving.json" || status=1 ;;
    audit) server_wheels
           python3 -m benchmarks.suites.audit --out "$OUT/audit.json" || status=1 ;;
    # shellcheck disable=SC2086 # SMALL_MODELS_ARGS is a list of options
    small-models) server_wheels
                  python3 -m benchmarks.suites.small_models --out "$OUT/small_models.json" \
                    ${SMALL_MODELS_ARGS:-} || status=1 ;;
    # The same file in two device calls: the demo's two runs (a cold Triton cache first),
    # then the rest, each keeping the other's rows.
    small-models-demo) python3 -m benchmarks.suites.small_models --parts demo \
                         --keep-from "$OUT/small_models.json" \
                         --out "$OUT/small_models.json" || status=1 ;;
    small-models-rest) server_wheels
                       python3 -m benchmarks.suites.small_models \
                         --parts levels,offline,server --keep-from "$OUT/small_models.json" \
                         --out "$OUT/small_models.json" || status=1 ;;
    structured-tests) server_wheels
                      gpu_tests gpu_tests_structured.log 15 tests/gpu/test_structured_gpu.py \
                        || status=1 ;;
    tensor-parallel) python3 -m benchmarks.suites.tensor_parallel --tp 1,2 \
                       --keep-rows-from benchmarks/results/tensor_parallel.json \
                       --out "$OUT/tensor_parallel.json" || status=1 ;;

    attention-decode-ctas) experiment attention_decode_ctas attention_decode_ctas.json \
                             || status=1 ;;
    attention-fold) experiment attention_fold_segments attention_fold_segments.json \
                      || status=1 ;;
    capture-gc-probe) experiment capture_gc_probe capture_gc_probe.json || status=1 ;;
    copy-reference) experiment copy_reference copy_reference.json || status=1 ;;
    cublas-kernels) experiment cublas_kernel_choice cublas_kernel_choice.json || status=1 ;;
    expand-group-cap) experiment expand_group_cap expand_group_cap.json || status=1 ;;
    expand-spread-tiles) experiment expand_spread_tiles expand_spread_tiles.json --rows 64,96,128 \
                           || status=1 ;;
    first-cache-hit) experiment first_cache_hit first_cache_hit.json || status=1 ;;
    multi-lora-waves) experiment multi_lora_waves multi_lora_waves.json || status=1 ;;
    mamba-replay-cost) experiment mamba_replay_cost mamba_replay_cost.json || status=1 ;;
    serving-timeline) server_wheels
                      experiment serving_timeline serving_timeline.json || status=1 ;;
    fused-lora-norm) experiment fused_lora_norm fused_lora_ops.json || status=1 ;;
    fused-qkv) experiment fused_qkv_rotary fused_qkv_rotary.json || status=1 ;;
    l2-read) experiment l2_read_bandwidth l2_read_bandwidth.json || status=1 ;;
    matmul-bounds) experiment matmul_tile_bounds matmul_tile_bounds.json || status=1 ;;
    matmul-regions) experiment matmul_regions matmul_regions.json || status=1 ;;
    matmul-split-counts) experiment matmul_split_counts matmul_split_counts.json || status=1 ;;
    matmul-two-part) experiment matmul_two_part_tiles matmul_two_part_tiles.json || status=1 ;;
    matmul-two-part-rule) experiment matmul_two_part_tiles matmul_two_part_rule.json --rule \
                            || status=1 ;;
    matmul-unsplit-tiles) experiment matmul_unsplit_tiles matmul_unsplit_tiles.json \
                            || status=1 ;;
    pdl-decode) experiment pdl_decode pdl_decode.json || status=1 ;;
    penalized-profile) experiment penalized_profile penalized_profile.json || status=1 ;;
    prefill-host) experiment prefill_host prefill_host.json || status=1 ;;
    rms-persistent) experiment rms_norm_persistent rms_norm_persistent.json || status=1 ;;
    run-ahead-cases) experiment run_ahead_cases run_ahead_cases.json || status=1 ;;
    row-linear-loads) experiment row_linear_loads row_linear_loads.json || status=1 ;;
    shared-inflight-pages) experiment shared_inflight_pages shared_inflight_pages_cpu.json \
                             || status=1 ;;
    vendor-gemm) experiment vendor_gemm_layouts vendor_gemm_layouts.json || status=1 ;;
    *) echo "unknown step $step"; status=2 ;;
  esac
done
echo "=== done ($(date -u +%T)) status=$status"
exit $status

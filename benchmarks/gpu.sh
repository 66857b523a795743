#!/usr/bin/env bash
# Every GPU test and benchmark, in one call on the GPU machine (no installs there:
# PYTHONPATH=src). Results land in $OUT (or ./out); copy them into benchmarks/results/.
#   benchmarks/gpu.sh [tests] [tests-kernels] [tests-engine] [kernels] [kernels-quick] [sweep] [ops] [engine] [profile]
#                     [gpu-ops-tests] [attention-tiles] [matmul-small-m] [split-kv-sweep]
#                     [profile-levels] [fused-qkv] [vendor-gemm] [profile-overlap]
#                     [matmul-split-counts] [matmul-unsplit-tiles] [matmul-decode-tiles] [attention-fold] [pdl-decode]
#                     [attention-flat] [rms-warps] [attention-split] [attention-tests] [attention-pairs]
#                     [attention-prologue] [ops-attention] [attention-stages]
#                     [matmul-regions] [l2-prefetch] [prefill-host]
#                     [staggered-arrivals] [attention-decode-ctas] [rms-persistent] [matmul-ws] [matmul-bounds]
#                     [copy-reference] [matmul-mid-m-loads] [prefix-cache] [engine-tests]
#                     [matmul-two-part] [matmul-two-part-rule] [matmul-tests] [ops-matmul] [l2-read] [first-cache-hit] [profile-bi-large] [run-ahead-cases]
#                     [penalized-profile] [capture-gc-probe] [penalty-sync-probe] [staggered-many]
#                     [cublas-kernels] [sampling-tests] [penalty-engine-tests] [penalized-long] ...
# With no argument: tests, kernels, ops, engine.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests kernels ops engine)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu \
  --format=csv | tee "$OUT/nvidia_smi.txt"
status=0
for step in "${steps[@]}"; do
  echo "=== $step ($(date -u +%T))"
  case $step in
    # The whole GPU suite took 540 s at b6b0cce, near one device call's 600 s limit: the two
    # halves below fit one call each.
    tests) python3 -m pytest -q tests/gpu -p no:cacheprovider --durations=15 2>&1 \
             | tee "$OUT/gpu_tests.log" | tail -n 45 || status=1 ;;
    tests-kernels) python3 -m pytest -q tests/gpu/test_lora_kernels_gpu.py \
                     tests/gpu/test_matmul_gpu.py tests/gpu/test_paged_attention_gpu.py \
                     tests/gpu/test_rowwise_ops_gpu.py tests/gpu/test_pdl_gpu.py \
                     -p no:cacheprovider --durations=15 2>&1 \
                     | tee "$OUT/gpu_tests_kernels.log" | tail -n 45 || status=1 ;;
    tests-engine) python3 -m pytest -q tests/gpu/test_engine_gpu.py tests/gpu/test_models_gpu.py \
                    tests/gpu/test_sampling_gpu.py tests/gpu/test_demo_gpu.py \
                    -p no:cacheprovider --durations=15 2>&1 \
                    | tee "$OUT/gpu_tests_engine.log" | tail -n 45 || status=1 ;;
    kernels) python3 -m detlora.study.lora_kernel_bench --out "$OUT/lora_kernels.json" || status=1 ;;
    kernels-quick) python3 -m detlora.study.lora_kernel_bench --quick \
                     --out "$OUT/lora_kernels_quick.json" || status=1 ;;
    sweep) python3 -m detlora.study.lora_kernel_bench --sweep-only \
             --out "$OUT/lora_sweep.json" || status=1 ;;
    ops) python3 -m detlora.study.bi_ops_bench --out "$OUT/batch_invariant_ops.json" \
           || status=1 ;;
    engine) python3 -m detlora.study.bench_engine --out "$OUT/engine.json" || status=1 ;;
    prefix-cache) python3 -m detlora.study.bench_prefix_cache --out "$OUT/prefix_caching.json" \
                    || status=1 ;;
    engine-tests) python3 -m pytest -q tests/gpu/test_engine_gpu.py -p no:cacheprovider 2>&1 \
                    | tee "$OUT/engine_gpu_tests.log" | tail -n 25 || status=1 ;;
    gpu-ops-tests) python3 -m pytest -q tests/gpu/test_paged_attention_gpu.py \
                     tests/gpu/test_matmul_gpu.py tests/gpu/test_rowwise_ops_gpu.py \
                     -p no:cacheprovider 2>&1 | tee "$OUT/gpu_ops_tests.log" | tail -n 25 \
                     || status=1 ;;
    attention-tiles) python3 -c "from detlora.study.bench_attention import tile_sweep; \
import json, sys; json.dump(tile_sweep(), open(sys.argv[1], 'w'), indent=1)" \
                       "$OUT/attention_tile_sweep.json" || status=1 ;;
    matmul-small-m) python3 -m detlora.study.bench_matmul --sweep --paths persistent --ms 1,64 \
                      --layers llama_o,llama_qkv,llama_down,qwen_down,qwen_o \
                      --out "$OUT/matmul_sweep_small_m_persistent.json" || status=1 ;;
    split-kv-sweep) python3 -c "from detlora.study.bench_attention import split_kv_sweep; \
from benchmarks.harness import results_meta; import json, sys; json.dump({'meta': results_meta( \
'benchmarks/gpu.sh split-kv-sweep'), 'rows': split_kv_sweep()}, open(sys.argv[1], 'w'), \
indent=1)" "$OUT/split_kv_sweep.json" || status=1 ;;
    profile-levels) python3 -m detlora.study.profile_engine --modes run_to_run,batch_invariant \
                      --batches 1,64 --tokens 16 --out "$OUT/profile_levels.json" || status=1 ;;
    profile-bi-large) python3 -m detlora.study.profile_engine --modes batch_invariant \
                        --batches 64,256 --tokens 16 --out "$OUT/profile_bi_large.json" || status=1 ;;
    fused-qkv) python3 -m benchmarks.experiments.fused_qkv_rotary "$OUT/fused_qkv_rotary.json" \
                 || status=1 ;;
    vendor-gemm) python3 -m benchmarks.experiments.vendor_gemm_layouts \
                   "$OUT/vendor_gemm_layouts.json" || status=1 ;;
    matmul-split-counts) python3 -m benchmarks.experiments.matmul_split_counts \
                           "$OUT/matmul_split_counts.json" || status=1 ;;
    matmul-unsplit-tiles) python3 -m benchmarks.experiments.matmul_unsplit_tiles \
                            "$OUT/matmul_unsplit_tiles.json" || status=1 ;;
    matmul-decode-tiles) python3 -m benchmarks.experiments.matmul_decode_tiles \
                           "$OUT/matmul_decode_tiles.json" || status=1 ;;
    attention-fold) python3 -m benchmarks.experiments.attention_fold_segments \
                      "$OUT/attention_fold_segments.json" || status=1 ;;
    attention-flat) python3 -m benchmarks.experiments.attention_flat_segments \
                      "$OUT/attention_flat_segments.json" || status=1 ;;
    rms-warps) python3 -c "from detlora.study.bench_rowwise import rms_norm_sweep; \
from benchmarks.harness import results_meta; import json, sys; json.dump({'meta': results_meta( \
'benchmarks/gpu.sh rms-warps'), 'rows': rms_norm_sweep((1024, 3072), (1024, 4096), (1, 2), \
(4, 8, 16, 32))}, open(sys.argv[1], 'w'), indent=1)" "$OUT/rms_norm_warps.json" || status=1 ;;
    attention-split) python3 -m benchmarks.experiments.attention_split_threshold \
                       "$OUT/attention_split_threshold.json" || status=1 ;;
    attention-prologue) python3 -m benchmarks.experiments.attention_prologue \
                          "$OUT/attention_prologue.json" old_paged_attention_a9244d1.py \
                          || status=1 ;;
    attention-stages) python3 -m benchmarks.experiments.attention_stages \
                        "$OUT/attention_stages.json" || status=1 ;;
    staggered-arrivals) python3 -m benchmarks.experiments.staggered_arrivals \
                          "$OUT/staggered_arrivals.json" || status=1 ;;
    run-ahead-cases) python3 -m benchmarks.experiments.run_ahead_cases "$OUT/run_ahead_cases.json" \
                       || status=1 ;;
    penalized-profile) python3 -m benchmarks.experiments.penalized_profile \
                         "$OUT/penalized_profile.json" || status=1 ;;
    penalty-sync-probe) python3 -m benchmarks.experiments.penalty_sync_probe \
                          "$OUT/penalty_sync_probe.json" || status=1 ;;
    capture-gc-probe) python3 -m benchmarks.experiments.capture_gc_probe \
                        "$OUT/capture_gc_probe.json" || status=1 ;;
    cublas-kernels) python3 -m benchmarks.experiments.cublas_kernel_choice \
                      "$OUT/cublas_kernel_choice.json" || status=1 ;;
    sampling-tests) python3 -m pytest -q tests/gpu/test_sampling_gpu.py -p no:cacheprovider 2>&1 \
                      | tee "$OUT/gpu_tests_sampling.log" | tail -n 25 || status=1 ;;
    penalty-engine-tests) python3 -m pytest -q tests/gpu/test_engine_gpu.py -k "penal or sync" \
                            -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests_penalties.log" \
                            | tail -n 25 || status=1 ;;
    penalized-long) python3 -m benchmarks.experiments.penalized_long_prompts \
                      "$OUT/penalized_long_prompts.json" || status=1 ;;
    staggered-many) python3 -m benchmarks.experiments.staggered_arrivals \
                      "$OUT/staggered_arrivals_many.json" --many || status=1 ;;
    prefill-host) python3 -m benchmarks.experiments.prefill_host "$OUT/prefill_host.json" \
                    || status=1 ;;
    # l2-prefetch measures an op that exists at 4618b7a..71e86be only (see the script)
    l2-prefetch) python3 -m benchmarks.experiments.l2_prefetch "$OUT/l2_prefetch.json" \
                   || status=1 ;;
    attention-decode-ctas) python3 -m benchmarks.experiments.attention_decode_ctas \
                             "$OUT/attention_decode_ctas.json" || status=1 ;;
    rms-persistent) python3 -m benchmarks.experiments.rms_norm_persistent \
                      "$OUT/rms_norm_persistent.json" || status=1 ;;
    matmul-bounds) python3 -m benchmarks.experiments.matmul_tile_bounds \
                     "$OUT/matmul_tile_bounds.json" || status=1 ;;
    copy-reference) python3 -m benchmarks.experiments.copy_reference \
                      "$OUT/copy_reference.json" || status=1 ;;
    matmul-mid-m-loads) python3 -m benchmarks.experiments.matmul_mid_m_loads \
                          "$OUT/matmul_mid_m_loads.json" || status=1 ;;
    matmul-two-part) python3 -m benchmarks.experiments.matmul_two_part_tiles \
                       "$OUT/matmul_two_part_tiles.json" || status=1 ;;
    matmul-two-part-rule) python3 -m benchmarks.experiments.matmul_two_part_tiles \
                            "$OUT/matmul_two_part_rule.json" --rule || status=1 ;;
    first-cache-hit) python3 -m benchmarks.experiments.first_cache_hit \
                       "$OUT/first_cache_hit.json" || status=1 ;;
    l2-read) python3 -m benchmarks.experiments.l2_read_bandwidth "$OUT/l2_read_bandwidth.json" \
               || status=1 ;;
    matmul-tests) python3 -m pytest -q tests/gpu/test_matmul_gpu.py -p no:cacheprovider 2>&1 \
                    | tee "$OUT/matmul_gpu_tests.log" | tail -n 15 || status=1 ;;
    matmul-ws) python3 -m benchmarks.experiments.matmul_warp_specialize \
                 "$OUT/matmul_warp_specialize.json" || status=1 ;;
    matmul-regions) python3 -m benchmarks.experiments.matmul_regions \
                      "$OUT/matmul_regions.json" || status=1 ;;
    ops-matmul) python3 -m detlora.study.bi_ops_bench --parts matmul \
                  --out "$OUT/batch_invariant_ops_matmul.json" || status=1 ;;
    ops-attention) python3 -m detlora.study.bi_ops_bench --parts attention \
                     --out "$OUT/batch_invariant_ops_attention.json" || status=1 ;;
    # attention-pairs toggles a flag that exists at commit 85ef1d6 only (see the script)
    attention-pairs) python3 -m benchmarks.experiments.attention_block_pairs \
                       "$OUT/attention_block_pairs.json" || status=1 ;;
    attention-tests) python3 -m pytest -q tests/gpu/test_paged_attention_gpu.py -p no:cacheprovider \
                       2>&1 | tee "$OUT/attention_tests.log" | tail -n 15 || status=1 ;;
    pdl-decode) python3 -m benchmarks.experiments.pdl_decode "$OUT/pdl_decode.json" \
                  || status=1 ;;
    profile-overlap) python3 -m detlora.study.profile_engine --modes run_to_run --batches 64 \
                       --tokens 150 --overlap --out "$OUT/profile_overlap.json" || status=1 ;;
    profile) python3 -m detlora.study.profile_engine --modes fast,run_to_run,batch_invariant \
               --out "$OUT/profile_engine.json" || status=1 ;;
    *) echo "unknown step $step"; status=2 ;;
  esac
done
echo "=== done ($(date -u +%T)) status=$status"
exit $status

#!/usr/bin/env bash
# Runs lists of gpu.sh steps side by side, each list on its own GPUs, then packs every
# result and log into $OUT/results.tgz (one file: the GPU machine returns only a few).
#
#   benchmarks/gpu_lanes.sh "0:tests-kernels kernels-quick" "1:tests-engine serving"
#   benchmarks/gpu_lanes.sh "0,1:tensor-parallel-tests tensor-parallel"
#
# A lane is "GPUS:STEPS": GPUS is what CUDA_VISIBLE_DEVICES gets. Each lane writes into
# $OUT/lanes/<n>/ (its gpu.sh OUT) and its log to $OUT/lanes/<n>.log; a lane is stopped after
# $LANE_TIMEOUT seconds (default 540) so that the call returns with what it has.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
work=$(mktemp -d)
pids=()
n=0
for lane in "$@"; do
  gpus=${lane%%:*}
  steps=${lane#*:}
  mkdir -p "$work/lanes/$n"
  # shellcheck disable=SC2086 # STEPS is a list of step names
  CUDA_VISIBLE_DEVICES=$gpus OUT="$work/lanes/$n" timeout "${LANE_TIMEOUT:-540}" \
    benchmarks/gpu.sh $steps >"$work/lanes/$n.log" 2>&1 &
  pids+=($!)
  n=$((n + 1))
done
status=0
for i in "${!pids[@]}"; do
  wait "${pids[$i]}"
  rc=$?
  echo "=== lane $i (${*:$((i + 1)):1}) exit $rc"
  tail -n 40 "$work/lanes/$i.log"
  [ $rc -ne 0 ] && status=1
done
mkdir -p "$OUT"
tar czf "$OUT/results.tgz" -C "$work" lanes
ls -l "$OUT/results.tgz"
exit $status

#!/usr/bin/env bash
# The decode kernels' split merge in the split kernel (PlanOptions::decode_fused_combine, attnd
# --step_fused_combine) on a GPU machine, in one bounded call (about 8 minutes):
#  1. correctness: gpu_decode_test's split cases (GpuDecodeSplits.*, among them
#     MergedByTheLastSplit; the FP8 kernel's CachesStepsAndSplits; GpuPagedDecode.*) in 8 shards,
#     then cuda_session_test's random interleavings with the merge on;
#  2. the kernel: kernels/bench/bench_decode.py's table "Merging the splits" (combine kernel against
#     the merge, timed in alternation, contiguous and pages of 16) at the small-batch points, with
#     the decode targets beside (1 x 4k, 1 x 32k, 16 x 4k, 64 x 4k);
#  3. the step: bench/gpu_verify_h200.sh's steps part with attnd's merge on and off
#     (STEP_VARIANTS), alternated in two rounds: a lone Step (stub, wire, GPU regions) and
#     BatchStep 64 x 4, with their phases.
# Each part under `timeout`; everything goes to OUT, and OUT/merge.tgz holds it all.
#   . BUNDLE/env.sh && bench/decode_merge_h200.sh BUNDLE OUT
# BUNDLE: a gpu-bundle of attnd, attn-bench, gpu_decode_test and cuda_session_test, with
# lib/libattn_kernels_capi.so beside the other libraries.
set -u
bundle=$(cd "$1" && pwd)
mkdir -p "$2"
out=$(cd "$2" && pwd)
bin=$bundle/bin
py=${PYTHON:-python3}
t0=$(date +%s)
stamp() { echo "$(($(date +%s) - t0)) s: $*" | tee -a "$out/times.txt"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv >"$out/gpu.txt" 2>&1

filter='GpuDecodeSplits.*:GpuFp8Decode/*CachesStepsAndSplits*:GpuPagedDecode.*'
for i in 0 1 2 3 4 5 6 7; do
  GTEST_TOTAL_SHARDS=8 GTEST_SHARD_INDEX=$i timeout 90 "$bin/gpu_decode_test" --gtest_filter="$filter" \
    >"$out/kernel-tests$i.txt" 2>&1 &
done
wait
stamp "kernel tests: $(grep -h -E '^\[  (PASSED|FAILED)  \]' "$out"/kernel-tests*.txt | tr '\n' ' ')"
ATTND_BIN=$bin/attnd timeout 90 "$bin/cuda_session_test" --gtest_filter='*SplitsMergedInTheSplitKernel*' \
  >"$out/session-test.txt" 2>&1
stamp "session test rc=$?: $(grep -E '^\[  (PASSED|FAILED)  \]' "$out/session-test.txt" | tr '\n' ' ')"

timeout 150 "$py" kernels/bench/bench_decode.py --lib "$bundle/lib/libattn_kernels_capi.so" --out "$out/decode.md" \
  --decode 1x4096,1x32768,16x4096,64x4096 --pages 16 --prefill "" --split-sweep "" --fp8 "" \
  --reps 7 --min-ms 10 >"$out/decode.log" 2>&1
stamp "decode rc=$?"

LEVEL_S=2 STEPS_TIMEOUT=230 STEP_ROUNDS=2 STEP_VARIANTS="- --step_fused_combine=true" \
  bench/gpu_verify_h200.sh "$bundle" "$out/verify" steps >"$out/steps.log" 2>&1
stamp "steps rc=$?"
rm -rf "$out"/verify/steps/m[0-3]
tar czf "$out/merge.tgz" -C "$out" --exclude=merge.tgz .

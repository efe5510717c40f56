#!/usr/bin/env bash
# docs/PERF.md's pending GPU checks that fit one device call (about 8 minutes), the most decisive
# first, each part under its own timeout, OUT/pending.tgz rewritten after each part:
#  1. the decode split merge (gpu_decode_test GpuDecodeSplits.*, the FP8 kernel's forced splits)
#     and the FP8 tensor-core plan on both query tile sizes (Fp8TensorCorePlanOverCaches,
#     GpuFp8TileRows.*), in 8 shards; cuda_session_test's random interleavings (the merge on, as
#     attnd's default, and off);
#  2. where an FP8 tile's time goes: fp8_variants --variant stamped (d 128 and 256, s=8k);
#  3. kernels/bench/bench_decode.py's "Merging the splits" table and the decode targets
#     (1 x 4k, 1 x 32k, 16 x 4k, 64 x 4k);
#  4. kernels/bench/bench_fp8_forward.py: FP8 paged prefill (the plan's tiles against 192-row
#     ones) and the FP8 forward at d=128 s=4k and d=256 s=8k;
#  5. the step targets (bench/gpu_verify_h200.sh steps) with attnd's split merge on (the
#     default) and off, alternated in two rounds.
#   . BUNDLE/env.sh && bench/pending_gpu_checks.sh BUNDLE VARIANTS_BUNDLE OUT
# BUNDLE: a gpu-bundle of attnd, attn-bench, gpu_decode_test and cuda_session_test with
# lib/libattn_kernels_capi.so; VARIANTS_BUNDLE: one of fp8_variants (-DATTN_SM90_VARIANTS=ON).
set -u
bundle=$(cd "$1" && pwd)
variants=$(cd "$2" && pwd)
mkdir -p "$3/pending"
top=$(cd "$3" && pwd)
out=$top/pending
bin=$bundle/bin
py=${PYTHON:-python3}
lib=$bundle/lib/libattn_kernels_capi.so
t0=$(date +%s)
stamp() { echo "$(($(date +%s) - t0)) s: $*" | tee -a "$out/times.txt"; }
pack() { tar czf "$top/pending.tgz" -C "$top" pending; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu \
  --format=csv >"$out/gpu.txt" 2>&1

filter='GpuDecodeSplits.*:GpuFp8Decode/*CachesStepsAndSplits*:*Fp8TensorCorePlan*:GpuFp8TileRows.*'
for i in 0 1 2 3 4 5 6 7; do
  GTEST_TOTAL_SHARDS=8 GTEST_SHARD_INDEX=$i timeout 60 "$bin/gpu_decode_test" --gtest_filter="$filter" \
    >"$out/kernel-tests$i.txt" 2>&1 &
done
wait
stamp "kernel tests: $(grep -h -E '^\[  (PASSED|FAILED)  \]' "$out"/kernel-tests*.txt | sort | uniq -c | tr '\n' ' ')"
ATTND_BIN=$bin/attnd timeout 90 "$bin/cuda_session_test" --gtest_filter='*SplitsMerged*:*RandomInterleavings*' \
  >"$out/session-test.txt" 2>&1
stamp "session test rc=$?: $(grep -E '^\[  (PASSED|FAILED)  \]' "$out/session-test.txt" | tr '\n' ' ')"
pack

timeout 30 "$variants/bin/fp8_variants" --d 128 --d 256 --s 8192 --reps 6 --variant stamped >"$out/fp8-phases.md" 2>&1
stamp "fp8 phases rc=$?"
pack

timeout 90 "$py" kernels/bench/bench_decode.py --lib "$lib" --out "$out/decode.md" \
  --decode 1x4096,1x32768,16x4096,64x4096 --pages 16 --prefill "" --split-sweep "" --fp8 "" \
  --reps 5 --min-ms 10 >"$out/decode.log" 2>&1
stamp "decode rc=$?"
pack

timeout 100 "$py" kernels/bench/bench_fp8_forward.py --lib "$lib" --out "$out/fp8.md" \
  --attend 128x4096,256x8192 --reps 7 >"$out/fp8.log" 2>&1
stamp "fp8 forward rc=$?"
pack

LEVEL_S=2 STEPS_TIMEOUT=200 STEP_ROUNDS=2 STEP_VARIANTS="- --step_fused_combine=false" \
  bench/gpu_verify_h200.sh "$bundle" "$out/verify" steps >"$out/steps.log" 2>&1
stamp "steps rc=$?"
rm -rf "$out"/verify/steps/m[0-3]
pack

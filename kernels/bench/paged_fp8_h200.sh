#!/usr/bin/env bash
# One bounded GPU run (Hopper) of the checks and measurements of the paged generation-2 forward
# kernel, the decode kernel's split rule and combine, and the FP8 K/V decode kernel:
#  1. smoke: one GpuPagedGen2 case per head dim (64: the three-warpgroup tiling, 128 and 256: two
#     warpgroups), pages of 16, each in a process of its own under a short timeout, on the
#     debugging build whose mbarrier waits trap instead of hanging (gpu_decode_test_trap,
#     ATTN_SM90_HANG_TRAP). A timeout there (a hang the trap cannot catch: setmaxnreg, a spin
#     elsewhere) keeps everything that forces generation 2 on paged K/V out of the later steps.
#  2. tests: all of gpu_decode_test (decode, FP8 decode, paged prefill on generation 1 and 2 forced,
#     steps, splits) in 8 shards at once, each under a timeout.
#  3. sanitize: compute-sanitizer memcheck and racecheck on small decode, FP8 and paged cases.
#  4. bench: bench_decode.py: decode points with torch flash and cuDNN beside (batch 1 at 4k, 32k,
#     128k with a sweep of forced splits; 16 x 4k, 64 x 4k, 16 x 32k, 128 x 8k), FP8 K/V decode vs
#     bf16 K/V decode, paged chunked prefill (chunks of 512 and 2048 over 4k cached keys, pages of
#     16 and 64, d = 128 and 64: contiguous generation 2, the plan's paged choice, generation 1 and
#     2 forced) and multi-token steps.
# Every step runs under `timeout`, within BUDGET_S seconds in all (default 540); a step that does
# not fit in what is left is skipped and said so. The last thing printed is the table of steps.
#   kernels/bench/paged_fp8_h200.sh BIN OUT [BUDGET_S]
# BIN: gpu_decode_test, gpu_decode_test_trap (optional: gpu_decode_test serves),
#      libattn_kernels_capi.so, bench_decode.py. OUT: where every log and table goes.
set -u
bin=$(cd "$1" && pwd)
budget=${3:-540}
mkdir -p "$2"
out=$(cd "$2" && pwd)
t0=$(date +%s)
status="$out/status.tsv"
: >"$status"
test_bin="$bin/gpu_decode_test"
trap_bin="$bin/gpu_decode_test_trap"
[ -x "$trap_bin" ] || trap_bin=$test_bin

step_reserve=15
# shellcheck source=kernels/bench/bounded_steps.sh
. "$(dirname "$0")/bounded_steps.sh"

# The GPU and its clocks, for the record.
timeout 20 nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw,temperature.gpu \
  --format=csv >"$out/device.txt" 2>&1

# 1. smoke
gen2_paged=ok
for d in 64 128 256; do
  step "smoke gen2 paged d=$d" 45 "$out/smoke_d$d.txt" "$trap_bin" \
    --gtest_filter="*GpuPagedGen2.ChunksOverCachedKeys/bf16_d${d}_page16"
  rc=$?
  if [ $rc = 124 ] || [ $rc = 137 ]; then gen2_paged=hang; fi
  if [ $rc != 0 ] && [ $gen2_paged = ok ]; then gen2_paged=failed; fi
done
echo "generation-2 paged smoke: $gen2_paged" >"$out/smoke.txt"

# 2. tests, 8 shards at once (the float64 reference is the slow part)
filter='*'
[ $gen2_paged = hang ] && filter='-*GpuPagedGen2*'
shards() {
  local i
  for i in 0 1 2 3 4 5 6 7; do
    GTEST_TOTAL_SHARDS=8 GTEST_SHARD_INDEX=$i "$trap_bin" --gtest_filter="$filter" \
      >"$out/tests_shard$i.txt" 2>&1 &
  done
  wait
  cat "$out"/tests_shard[0-7].txt
}
step "tests gpu_decode_test ($filter)" 170 "$out/tests.txt" bash -c "$(declare -f shards); \
  trap_bin='$trap_bin' filter='$filter' out='$out' shards"
grep -hE '^\[  FAILED  \] [A-Za-z]' "$out/tests.txt" | sort -u >"$out/tests_failed.txt"

# 3. sanitize (the shipped build: no trap), before the bench: a run cut short keeps its verdicts
small='GpuDecodeSmoke.*:GpuFp8DecodeMisc.*:*GpuFp8Decode.CachesStepsAndSplits/bf16_d128_gqa4_page16'
[ $gen2_paged = hang ] || small+=':*GpuPagedGen2.StepsEmptyCachesSharedPages/bf16_d128_page16:*GpuPagedGen2.FullAndWindowed/bf16_d64_page48'
for tool in memcheck racecheck; do
  step "compute-sanitizer $tool" 70 "$out/sanitize_$tool.txt" compute-sanitizer --tool "$tool" \
    --error-exitcode 3 "$test_bin" --gtest_filter="$small"
done

# 4. bench
bench_args=(--decode 1x4096,1x32768,1x131072,16x4096,64x4096,16x32768,128x8192 --pages 16,64
            --split-sweep 8,16,24,32,48,64 --fp8 64x4096,16x32768,128x8192
            --prefill 512x4096,2048x4096 --prefill-dims 128,64 --prefill-pages 16,64
            --reps 7 --min-ms 10)
if [ $gen2_paged = hang ]; then
  bench_args+=(--prefill-gens 0,1 --steps "")
else
  bench_args+=(--prefill-gens 0,1,2 --steps 64x4x4096,16x16x4096)
fi
step "bench bench_decode.py" 210 "$out/bench.log" bash -c "cd '$bin' && exec python3 bench_decode.py \
  --lib ./libattn_kernels_capi.so --out '$out/bench.md' ${bench_args[*]@Q}"

# Summary: the steps, the failed tests, the bench's tables.
{
  echo "== paged_fp8_h200.sh: $(($(date +%s) - t0)) s of $budget; generation-2 paged smoke: $gen2_paged"
  [ -s "$out/tests_failed.txt" ] && { echo "-- failed tests:"; head -n 40 "$out/tests_failed.txt"; }
  [ -f "$out/bench.md" ] && { echo "-- bench_decode.py tables:"; sed -n '3,200p' "$out/bench.md"; }
  [ -f "$out/bench.md" ] || { echo "-- bench log (no table):"; tail -n 30 "$out/bench.log"; }
  echo "-- steps (rc 124/137: timed out; 99: skipped):"
  printf 'step\trc\ts\tresult\n'
  cat "$status"
} | tee "$out/summary.txt"

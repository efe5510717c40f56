#!/usr/bin/env bash
# One bounded GPU run (Hopper) that chooses the FP8 forward kernel's loop and softmax split and
# checks the tensor-core path, under 9 minutes:
#  0. smoke: the FP8 tensor-core kernel's first case alone, from gpu_decode_test_trap when BIN has
#     it (a barrier protocol error traps instead of hanging), under a 60 s timeout;
#  1. fp8_variants: the pingpong variant alone first (a turn protocol error hangs: 30 s), then the
#     table of every variant against the shipped kernel (d 128 and 256, s 4k and 8k, non-causal;
#     s 8k causal), without the pingpong variants if their smoke failed;
#  2. tests: gpu_decode_test's FP8 tensor-core suites in 8 shards at once, cuda_session_test's and
#     cuda_server_test's FP8 cases where the binaries are in BIN.
# Every log, the status table and the variants table go to OUT (and OUT/logs.tgz).
#   kernels/bench/fp8_variants_h200.sh BIN OUT [BUDGET_S]
set -u
bin=$(cd "$1" && pwd)
budget=${3:-540}
mkdir -p "$2"
out=$(cd "$2" && pwd)
t0=$(date +%s)
status="$out/status.tsv"
: >"$status"

# shellcheck source=kernels/bench/bounded_steps.sh
. "$(dirname "$0")/bounded_steps.sh"

timeout 20 nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw,temperature.gpu \
  --format=csv >"$out/device.txt" 2>&1

smoke_bin="$bin/gpu_decode_test"
[ -x "$bin/gpu_decode_test_trap" ] && smoke_bin="$bin/gpu_decode_test_trap"
step "smoke FP8 tensor-core kernel" 60 "$out/smoke.txt" "$smoke_bin" \
  --gtest_filter='*Fp8TensorCoreKernel/bf16_d128_gqa4_contig'

variants=(fma4 fma2 blocks pingpong pingpong_fma4 pingpong_fma3 pingpong_fma2)
if ! step "fp8_variants pingpong smoke" 30 "$out/variants_smoke.txt" "$bin/fp8_variants" --d 128 \
  --s 4096 --reps 1 --variant pingpong; then
  variants=(fma4 fma2 blocks)
fi
args=()
for v in "${variants[@]}"; do args+=(--variant "$v"); done
step "fp8_variants non-causal" 150 "$out/variants.md" "$bin/fp8_variants" --d 128 --d 256 --s 4096 \
  --s 8192 --reps 20 "${args[@]}"
step "fp8_variants causal" 80 "$out/variants_causal.md" "$bin/fp8_variants" --d 128 --d 256 --s 8192 \
  --causal --reps 20 "${args[@]}"

shards() {
  local i
  for i in 0 1 2 3 4 5 6 7; do
    GTEST_TOTAL_SHARDS=8 GTEST_SHARD_INDEX=$i "$bin/gpu_decode_test" --gtest_filter='*Fp8TensorCore*' \
      >"$out/tests_shard$i.txt" 2>&1 &
  done
  wait
  cat "$out"/tests_shard[0-7].txt
}
step "tests gpu_decode_test *Fp8TensorCore*" 120 "$out/tests_kernels.txt" bash -c "$(declare -f shards); \
  bin='$bin' out='$out' shards"
rm -f "$out"/tests_shard[0-7].txt
for t in cuda_session_test cuda_server_test; do
  [ -x "$bin/$t" ] && step "tests $t *Fp8*" 120 "$out/tests_$t.txt" "$bin/$t" --gtest_filter='*Fp8*'
done

{
  echo "== fp8_variants_h200.sh: $(($(date +%s) - t0)) s of $budget"
  echo "-- failed tests:"
  cat "$out"/tests_*.txt "$out/smoke.txt" 2>/dev/null | grep -hE '^\[  FAILED  \] [A-Za-z]' | sort -u | head -n 30
  echo "-- failures (first 40 lines):"
  cat "$out"/tests_*.txt "$out/smoke.txt" 2>/dev/null | grep -hE -A3 'Failure$' | head -n 40
  echo "-- FP8 tensor cores' LSE error (bits of the score magnitude):"
  cat "$out"/tests_kernels.txt "$out/smoke.txt" 2>/dev/null | grep -hoE 'LSE error up to 2\^[-0-9.]+' | sort -t^ -k2 -g | tail -n 3
  echo "-- variants:"
  cat "$out/variants.md" "$out/variants_causal.md" 2>/dev/null
  echo "-- steps (rc 124/137: timed out; 99: skipped):"
  printf 'step\trc\ts\tresult\n'
  cat "$status"
} | tee "$out/summary.txt"
tar czf "$out/logs.tgz" -C "$out" --exclude=logs.tgz . 2>/dev/null

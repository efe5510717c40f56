#!/usr/bin/env bash
# One bounded GPU run (Hopper) of the checks and measurements of the FP8 forward path (FP8 K/V and
# all-FP8 q/k/v with more than 16 queries per sequence: e4m3 converted to 16 bits in the workspace,
# then the 16-bit forward kernel; and all-FP8 on the FP8 tensor-core kernel), under 9 minutes:
#  0. smoke: the FP8 tensor-core kernel's first case alone, from gpu_decode_test_trap when BIN has
#     it (a build with ATTN_SM90_HANG_TRAP: a barrier protocol error traps instead of hanging),
#     under a 60 s timeout, before anything else uses the GPU.
#  1. tests: gpu_decode_test's FP8 suites (GpuFp8Forward: contiguous and shuffled pages of 16 and
#     64, causal and not, windows, GQA, head dims 64/128/256, fp16 and bf16, ragged batches, FP8 q;
#     GpuFp8Decode*: the decode kernel beside it) in 8 shards at once; cuda_session_test's FP8
#     sessions (a 600-token FP8 prefill step then decode; random interleavings with chunks past 16);
#     cuda_server_test's FP8 cases where the binary is in BIN.
#  2. sanitize: compute-sanitizer memcheck on small FP8 forward cases (paged with an empty cache,
#     contiguous with FP8 q).
#  3. bench: bench_fp8_forward.py: FP8-KV paged prefill vs bf16 paged prefill (batch 1, GQA 32/8,
#     d=128, 4k cached, chunks 512 and 2048, pages 16 and 64, causal) and FP8 Attend (q, k, v e4m3,
#     d=128 and 256, s=4k and 8k, non-causal) vs bf16 generation 2, TFLOP/s and ratios; and, where
#     BIN has fp8_variants (-DATTN_SM90_VARIANTS=ON), the tensor-core kernel's variants against the
#     shipped one (d 128 and 256, s 4k and 8k non-causal, 8k causal; d=128's two warpgroups at
#     s 512-2k, and causal at 1k-4k).
# Every step runs under `timeout`, within BUDGET_S seconds in all (default 540); a step that does
# not fit in what is left is skipped and said so. The last thing printed is the table of steps;
# OUT/logs.tgz holds every log (a device call brings back few files).
#   kernels/bench/fp8_forward_h200.sh BIN OUT [BUDGET_S]
# BIN: gpu_decode_test, (optional) gpu_decode_test_trap, cuda_session_test, (optional) cuda_server_test, libattn_kernels_capi.so,
#      bench_fp8_forward.py, bench_decode.py, (optional) fp8_variants. OUT: where every log and table goes.
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

# 0. smoke
smoke_bin="$bin/gpu_decode_test"
[ -x "$bin/gpu_decode_test_trap" ] && smoke_bin="$bin/gpu_decode_test_trap"
step "smoke FP8 tensor-core kernel" 60 "$out/tests_smoke.txt" "$smoke_bin" \
  --gtest_filter='*Fp8TensorCoreKernel/bf16_d128_gqa4_contig'

# 1. tests (the float64 reference is the slow part: 8 shards at once)
shards() {
  local i
  for i in 0 1 2 3 4 5 6 7; do
    GTEST_TOTAL_SHARDS=8 GTEST_SHARD_INDEX=$i "$bin/gpu_decode_test" --gtest_filter='*Fp8*' \
      >"$out/tests_shard$i.txt" 2>&1 &
  done
  wait
  cat "$out"/tests_shard[0-7].txt
}
step "tests gpu_decode_test *Fp8*" 150 "$out/tests_kernels.txt" bash -c "$(declare -f shards); \
  bin='$bin' out='$out' shards"
rm -f "$out"/tests_shard[0-7].txt
step "tests cuda_session_test *Fp8*" 120 "$out/tests_sessions.txt" "$bin/cuda_session_test" \
  --gtest_filter='*Fp8*'
if [ -x "$bin/cuda_server_test" ]; then
  step "tests cuda_server_test *Fp8*" 60 "$out/tests_server.txt" "$bin/cuda_server_test" \
    --gtest_filter='*Fp8*'
fi
cat "$out"/tests_*.txt 2>/dev/null | grep -hE '^\[  FAILED  \] [A-Za-z]' | sort -u >"$out/tests_failed.txt"

# 2. sanitize
small='*GpuFp8Forward.ForcedGen1AndEmptyCaches/bf16_d128_gqa4_page16:*GpuFp8Forward.ForcedGen1AndEmptyCaches/fp16_d64_mha_page64'
step "compute-sanitizer memcheck" 60 "$out/sanitize_memcheck.txt" compute-sanitizer --tool memcheck \
  --error-exitcode 3 "$bin/gpu_decode_test" --gtest_filter="$small"
tc='*GpuFp8Forward.Fp8TensorCoreKernel/fp16_d256_mha_contig'
step "compute-sanitizer memcheck (tensor cores)" 60 "$out/sanitize_memcheck_tc.txt" compute-sanitizer \
  --tool memcheck --error-exitcode 3 "$bin/gpu_decode_test" --gtest_filter="$tc"
step "compute-sanitizer racecheck (tensor cores)" 60 "$out/sanitize_racecheck_tc.txt" compute-sanitizer \
  --tool racecheck --error-exitcode 3 "$bin/gpu_decode_test" --gtest_filter="$tc"

# 3. bench
if [ -x "$bin/fp8_variants" ]; then
  step "fp8_variants non-causal" 90 "$out/variants.md" "$bin/fp8_variants" --d 128 --d 256 --s 4096 \
    --s 8192 --reps 20
  step "fp8_variants causal" 50 "$out/variants_causal.md" "$bin/fp8_variants" --d 128 --d 256 --s 8192 \
    --causal --reps 20
  # d=128's 192-row tiles where a sequence's last tile wastes most: short and causal sequences.
  step "fp8_variants d=128 short" 40 "$out/variants_short.md" "$bin/fp8_variants" --d 128 \
    --s 512 --s 1024 --s 2048 --variant wg2 --reps 20
  step "fp8_variants d=128 short causal" 40 "$out/variants_short_causal.md" "$bin/fp8_variants" \
    --d 128 --s 1024 --s 2048 --s 4096 --causal --variant wg2 --reps 20
fi
step "bench bench_fp8_forward.py" 150 "$out/bench.log" bash -c "cd '$bin' && exec python3 \
  bench_fp8_forward.py --lib ./libattn_kernels_capi.so --out '$out/bench.md'"

{
  echo "== fp8_forward_h200.sh: $(($(date +%s) - t0)) s of $budget"
  [ -s "$out/tests_failed.txt" ] && { echo "-- failed tests:"; head -n 40 "$out/tests_failed.txt"; }
  cat "$out"/tests_*.txt 2>/dev/null | grep -hE -A3 'Failure$' | head -n 40
  echo "-- FP8 tensor cores' LSE error (largest, in bits of the score magnitude):"
  cat "$out"/tests_*.txt 2>/dev/null | grep -hoE 'LSE error up to 2\^[-0-9.]+' | sort -t^ -k2 -g | tail -n 1
  cat "$out/variants.md" "$out/variants_causal.md" "$out/variants_short.md" \
    "$out/variants_short_causal.md" 2>/dev/null
  [ -f "$out/bench.md" ] && { echo "-- bench_fp8_forward.py tables:"; sed -n '3,200p' "$out/bench.md"; }
  [ -f "$out/bench.md" ] || { echo "-- bench log (no table):"; tail -n 30 "$out/bench.log"; }
  echo "-- steps (rc 124/137: timed out; 99: skipped):"
  printf 'step\trc\ts\tresult\n'
  cat "$status"
} | tee "$out/summary.txt"
tar czf "$out/logs.tgz" -C "$out" --exclude=logs.tgz . 2>/dev/null

#!/usr/bin/env bash
# FP8 on a GPU machine in one call: the FP8 cases of the GPU kernel suites (the FP8 K/V decode
# kernel against the float64 reference), FP8-cache sessions on the CUDA backend against the
# float64 reference (cuda_session_test), what attnd's CUDA backend reports about FP8, decode
# through the service with a bf16 and an FP8 cache (attn-bench --mode=decode, GQA 32/8, d 128),
# and the CPU-semantics accuracy table, with everything in OUT_DIR.
#   [LEVEL_S=seconds per decode level] bench/fp8_h200.sh BIN_DIR OUT_DIR [TEST_SECONDS]
# BIN_DIR holds a gpu-bundle (bin/, env.sh) of attnd, attnctl, attn-bench, gpu_decode_test,
# cuda_session_test and fp8_accuracy (any that is missing is left out).
set -uo pipefail
bundle=$1
out=$2
test_seconds=${3:-300}
bin=$bundle/bin
port=50051
mkdir -p "$out"
# shellcheck disable=SC1091
. "$bundle/env.sh"
export ATTND_BIN=$bin/attnd
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$out/gpu.txt"

summary=()
if [ -x "$bin/gpu_decode_test" ]; then
  start=$(date +%s)
  timeout "$test_seconds" "$bin/gpu_decode_test" --gtest_filter='*Fp8*:*FP8*' >"$out/gpu_decode_test.log" 2>&1
  rc=$?
  summary+=("gpu_decode_test (FP8 cases) rc=$rc $(grep -E '^\[  (PASSED|FAILED)  \]' "$out/gpu_decode_test.log" | tr '\n' ' ') ($(($(date +%s) - start)) s)")
fi

if [ -x "$bin/cuda_session_test" ]; then
  start=$(date +%s)
  timeout "$test_seconds" "$bin/cuda_session_test" --gtest_filter='*Fp8*' \
    >"$out/cuda_session_test.log" 2>&1
  rc=$?
  summary+=("cuda_session_test (FP8 caches) rc=$rc $(grep -E '^\[  (PASSED|FAILED|SKIPPED)  \]' "$out/cuda_session_test.log" | tr '\n' ' ') ($(($(date +%s) - start)) s)")
fi

bin=$bin out=$out port=$port
# shellcheck disable=SC1091
. "$(dirname "$0")/attnd_lib.sh"
if start_attnd; then
  "$bin/attnctl" --target 127.0.0.1:$port info >"$out/server_info.txt" 2>&1
  summary+=("attnctl info rc=$? (fp8 support in server_info.txt)")
  "$bin/attnctl" --target 127.0.0.1:$port session demo --kv_dtype=fp8 --check --heads 32 \
    --kv_heads 8 --head_dim 128 --prefill 64 --chunk 16 >"$out/session_demo_fp8.txt" 2>&1
  summary+=("attnctl session demo --kv_dtype=fp8 --check rc=$?")
  if [ -x "$bin/attn-bench" ]; then
    # The same decode through the service with a bf16 and an FP8 cache: steps/s and the KV bytes
    # read per second (the cache column), sessions x cache tokens as in the kernel targets. Both
    # prefill in chunks of 1024 (FP8: the conversion and the 16-bit forward kernel).
    for kv in "" fp8; do
      for shape in "64 4096" "16 32768" "128 8192"; do
        set -- $shape
        "$bin/attn-bench" --target 127.0.0.1:$port --mode=decode --heads 32 --kv_heads 8 \
          --head_dim 128 --sessions "$1" --cache_tokens "$2" --batch_step "$1" \
          --prefill_chunk 1024 ${kv:+--kv_dtype=$kv} --duration_s "${LEVEL_S:-10}" --warmup_s 2 \
          >>"$out/decode_${kv:-bf16}.txt" 2>&1
        summary+=("attn-bench decode ${kv:-bf16} $1 x $2 rc=$?")
      done
    done
  fi
  stop_attnd
fi
if [ -x "$bin/fp8_accuracy" ]; then
  "$bin/fp8_accuracy" 1024 1 >"$out/fp8_accuracy.txt" 2>&1
  summary+=("fp8_accuracy rc=$?")
fi
printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"

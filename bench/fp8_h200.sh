#!/usr/bin/env bash
# FP8 on a GPU machine in one call: the FP8 cases of the GPU kernel suites (the FP8 K/V decode
# kernel against the float64 reference), what attnd's CUDA backend reports about FP8, and the
# CPU-semantics accuracy table, with everything in OUT_DIR.
#   bench/fp8_h200.sh BIN_DIR OUT_DIR [TEST_SECONDS]
# BIN_DIR holds a gpu-bundle (bin/, env.sh) of attnd, attnctl, gpu_decode_test and fp8_accuracy.
# The service-level bf16-vs-fp8 cache decode comparison needs sessions with an FP8 cache, which
# attnd does not have yet (docs/FP8.md); until then the kernel-level figures are in
# gpu_decode_test's output.
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

bin=$bin out=$out port=$port
# shellcheck disable=SC1091
. "$(dirname "$0")/attnd_lib.sh"
if start_attnd; then
  "$bin/attnctl" --target 127.0.0.1:$port info >"$out/server_info.txt" 2>&1
  summary+=("attnctl info rc=$? (fp8 support in server_info.txt)")
  stop_attnd
fi
if [ -x "$bin/fp8_accuracy" ]; then
  "$bin/fp8_accuracy" 1024 1 >"$out/fp8_accuracy.txt" 2>&1
  summary+=("fp8_accuracy rc=$?")
fi
printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"

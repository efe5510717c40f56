#!/usr/bin/env bash
# The step path on a GPU machine in one call: the GPU suites of sessions, regions and the server,
# then the issue's targets (attn-bench --mode decode and its Echo rows, a lone small Attend, the
# host path of a BatchStep), with the figures in $OUT.
#   bench/step_path_h200.sh BIN_DIR OUT_DIR [TEST_SECONDS]
# BIN_DIR holds a gpu-bundle (bin/, env.sh) of attnd, attnctl, attn-bench, attn-step-bench and the
# cuda_*_test suites; shapes as the sessions results before (GQA 32/8, d 128, bf16, 4k cache).
set -uo pipefail
bundle=$1
out=$2
test_seconds=${3:-150}
bin=$bundle/bin
port=50051
mkdir -p "$out"
# shellcheck disable=SC1091
. "$bundle/env.sh"
export ATTND_BIN=$bin/attnd
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$out/gpu.txt"

# The suites, each bounded; their verdicts go into the summary.
summary=()
for t in cuda_session_test cuda_region_test cuda_server_test cuda_device_lost_test; do
  [ -x "$bin/$t" ] || continue
  start=$(date +%s)
  timeout "$test_seconds" "$bin/$t" >"$out/$t.log" 2>&1
  rc=$?
  summary+=("$t rc=$rc $(grep -E '^\[  (PASSED|FAILED)  \]' "$out/$t.log" | tr '\n' ' ') ($(($(date +%s) - start)) s)")
done

bin=$bin out=$out port=$port
# shellcheck disable=SC1091
. "$(dirname "$0")/attnd_lib.sh"
start_attnd --kv_cache_bytes=17179869184 --allow_shared_memory ${ATTND_EXTRA:-} || exit 1
common=(--target 127.0.0.1:$port --mode decode --layers 1 --cache_tokens 4096 --heads 32
        --kv_heads 8 --head_dim 128 --dtype bf16 --duration_s "${LEVEL_S:-2}" --warmup_s 0.5)
run() { echo "+ attn-bench $*" >>"$out/bench.txt"; "$bin/attn-bench" "$@" 2>&1 | tee -a "$out/bench.txt"; }
run "${common[@]}" --sessions 1 --step_coding stub,wire,gpu --csv "$out/decode.csv" --label lone
run "${common[@]}" --sessions 64 --step_coding stub --csv "$out/decode.csv" --label callers64
run "${common[@]}" --sessions 256 --batch_step 64 --step_coding stub,wire --csv "$out/decode.csv" \
    --label batch64x4
run --target 127.0.0.1:$port --mode unary --concurrency 1 --seq 128 --heads 16 --head_dim 128 \
    --dtype bf16 --duration_s "${LEVEL_S:-2}" --warmup_s 0.5
stop_attnd
# Four step lanes instead of two, and lanes that sleep at once (no look for the next launch).
start_attnd --kv_cache_bytes=17179869184 --step_lanes=4 --step_idle_poll_us=0 || exit 1
run "${common[@]}" --sessions 1 --step_coding stub --csv "$out/decode.csv" --label lone_nopoll
run "${common[@]}" --sessions 256 --batch_step 64 --step_coding stub --csv "$out/decode.csv" \
    --label batch64x4_lanes4
stop_attnd
"$bin/attn-step-bench" --seconds 2 | tee "$out/step_bench.txt"
printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"

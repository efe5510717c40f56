#!/usr/bin/env bash
# The serving-engine targets, measured with attn-bench against attnd on loopback, each pair of
# configurations in one run on the same host:
#   batching: 64 clients of small requests, batching on vs --max_batch_tokens of one request
#   overhead: 4k-token requests, Attend vs Echo of the same bytes
#   streams:  8k-token requests, --streams 4 vs --streams 1
# Usage: bench/service_bench.sh BIN_DIR OUT_DIR [seconds per level]
set -uo pipefail
bin=$1; out=$2; secs=${3:-6}
mkdir -p "$out"
csv=$out/service_bench.csv
port=50151
. "$(dirname "$0")/attnd_lib.sh"

bench() {  # label, attn-bench flags...
  local label=$1; shift
  echo "== $label"
  "$bin/attn-bench" --target 127.0.0.1:$port --duration_s "$secs" --warmup_s 2 \
    --csv "$csv" --label "$label" "$@"
}

small=(--seq 128 --heads 16 --head-dim 128 --dtype bf16 --concurrency 64)
start_attnd && bench "batching on (max_batch_tokens 16384)" "${small[@]}"; stop_attnd
start_attnd --max_batch_tokens=128 && bench "batching off (max_batch_tokens 128)" "${small[@]}"; stop_attnd

big=(--seq 4096 --heads 16 --head-dim 128 --dtype bf16 --concurrency 16)
start_attnd --max_queue_delay_us=0 && {
  bench "overhead: Attend 4k tokens" "${big[@]}"
  bench "overhead: Echo, same bytes" "${big[@]}" --mode echo
}; stop_attnd

huge=(--seq 8192 --heads 16 --head-dim 128 --dtype bf16 --concurrency 8)
start_attnd --streams=4 --max_queue_delay_us=0 && bench "streams 4, 8k tokens" "${huge[@]}"; stop_attnd
start_attnd --streams=1 --max_queue_delay_us=0 && bench "streams 1, 8k tokens" "${huge[@]}"; stop_attnd
echo "== csv: $csv"
cat "$csv"

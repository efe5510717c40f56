#!/usr/bin/env bash
# The batching target next to the transport's own ceiling for the same small requests:
# Echo of the same bytes, Attend with batching, Attend with one request per launch.
# Usage: bench/batching_ceiling.sh BIN_DIR OUT_DIR [seconds]
set -uo pipefail
bin=$1; out=$2; secs=${3:-6}
mkdir -p "$out"
csv=$out/batching_ceiling.csv
port=50152
. "$(dirname "$0")/attnd_lib.sh"
small=(--seq 128 --heads 16 --head-dim 128 --dtype bf16)
run() { local label=$1; shift; echo "== $label"
  "$bin/attn-bench" --target 127.0.0.1:$port --duration_s "$secs" --warmup_s 2 --csv "$csv" \
    --label "$label" "${small[@]}" "$@"; }
start_attnd && {
  run "echo, 64 clients" --mode echo --concurrency 64
  run "attend batching on, 64 clients" --concurrency 64
  run "attend batching on, 64 streams of depth 4" --mode stream --concurrency 64
}; stop_attnd
start_attnd --max_batch_tokens=128 && {
  run "attend one request per launch, 64 clients" --concurrency 64
  run "attend one request per launch, 64 streams of depth 4" --mode stream --concurrency 64
}; stop_attnd
cat "$csv"

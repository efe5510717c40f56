#!/usr/bin/env bash
# Measures gRPC transport settings with attn-bench --mode echo at 1 and 16 clients: for each
# setting, attnd (CPU backend) is started with it as --grpc_arg and the bench's channels get it
# as --channel_arg; one row per (setting, request size, concurrency) goes to a CSV.
#   bench/transport_settings.sh BUILD_DIR OUT.csv [seconds]
set -euo pipefail
build=$1; out=$2; secs=${3:-2}
port=${ATTN_PORT:-50671}
# Each setting is applied on top of gRPC's defaults (which attnd and the client keep).
chunk="grpc.experimental.tcp_min_read_chunk_size=1048576,grpc.experimental.tcp_max_read_chunk_size=8388608,grpc.experimental.tcp_read_chunk_size=1048576"
settings=(
  "grpc_defaults:"
  "frame_1MiB:grpc.http2.max_frame_size=1048576"
  "frame_16MiB:grpc.http2.max_frame_size=16777215"
  "read_chunk_1MiB:$chunk"
  "frame_1MiB+read_chunk:grpc.http2.max_frame_size=1048576,$chunk"
  "write_buffer_8MiB:grpc.http2.write_buffer_size=8388608"
  "bdp_off+lookahead_8MiB:grpc.http2.bdp_probe=0,grpc.http2.lookahead_bytes=8388608"
)
rm -f "$out"
for entry in "${settings[@]}"; do
  name=${entry%%:*}; args=${entry#*:}
  sflag=(); cflag=()
  if [ -n "$args" ]; then sflag+=(--grpc_arg "$args"); cflag+=(--channel_arg "$args"); fi
  "$build/server/attnd" --backend cpu --listen "127.0.0.1:$port" --metrics_listen "" "${sflag[@]}" \
    >/tmp/transport_settings_attnd.log 2>&1 &
  pid=$!
  sleep 1.5
  for seq in 128 2048; do  # requests of ~1.6 MB and ~25 MB (Echo of an Attend-sized payload)
    "$build/client/attn-bench" --target "127.0.0.1:$port" --mode echo --concurrency 1,16 \
      --duration_s "$secs" --warmup_s 0.5 --seq "$seq" --heads 16 --head_dim 128 \
      --tcp_ceiling_s 0 "${cflag[@]}" --label "$name seq=$seq" --csv "$out" >/dev/null
  done
  kill "$pid"; wait "$pid" 2>/dev/null || true
done
python3 - "$out" <<'PY'
import csv, sys
for r in csv.DictReader(open(sys.argv[1])):
    print(f'{r["label"]:32s} conc={r["concurrency"]:>3s} GB/s={float(r["gb_per_s"]):.3f} p50_ms={float(r["p50_ms"]):.2f}')
PY

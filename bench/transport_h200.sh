#!/usr/bin/env bash
# The transport measurements of one run on a GPU host: raw TCP ceiling, gRPC Echo and Attend at
# 1 and 16 clients over 1-100 MB messages (with the ceiling next to each), 1 vs 4 connections of
# one client, gRPC vs host shared memory vs CUDA IPC for 4k-token Attend and for small requests,
# and gRPC's TCP read chunks. Needs attnd, attnctl, attn-bench and attn-tcp-ceiling in BIN.
#   bench/transport_h200.sh BIN OUT_DIR [seconds per level]
# Writes OUT_DIR/*.txt (the tables) and OUT_DIR/*.csv.
set -uo pipefail
bin=$1; out=$2; secs=${3:-2}
mkdir -p "$out"
port=50731
sock=/tmp/attnd-transport-$$.sock
common=(--duration_s "$secs" --warmup_s 0.5 --heads 16 --head_dim 128 --dtype bf16)
. "$(dirname "$0")/attnd_lib.sh"
# Room for 16 clients of 100 MB requests in pinned staging, and for the regions of 64 workers
# (a level's regions are dropped as the next one starts).
start() {  # attnd flags...
  start_attnd --backend="${ATTN_BACKEND:-cuda}" --allow_shared_memory --shm_socket=$sock \
    --shm_max_regions_per_client=1024 --pinned_pool_bytes=$((8 << 30)) \
    --max_inflight_bytes=$((8 << 30)) "$@"
}
bench() {  # name, attn-bench flags...
  local name=$1; shift
  echo "== $name: attn-bench $*" | tee -a "$out/all.txt"
  "$bin/attn-bench" --target 127.0.0.1:$port "${common[@]}" "$@" --label "$name" \
    --csv "$out/bench.csv" 2>&1 | tee -a "$out/all.txt"
}

nproc | sed 's/^/cores: /' | tee "$out/all.txt"
echo "== raw TCP ceiling" | tee -a "$out/all.txt"
"$bin/attn-tcp-ceiling" --request_mb 1,8,64 --concurrency 1,16 --duration_s "$secs" \
  2>&1 | tee -a "$out/all.txt"

start || exit 1
grep "backend" "$out/attnd.log" | head -2 | tee -a "$out/all.txt"
# Echo and Attend, 1 and 16 clients (one connection each), request 3 MB / 25 MB / 100 MB.
for seq in 256 2048 8192; do
  bench "echo seq=$seq" --mode echo --concurrency 1,16 --seq $seq --tcp_ceiling_s 1.5
  bench "attend seq=$seq" --mode unary --concurrency 1,16 --seq $seq --tcp_ceiling_s 1.5
done
# One client process, 16 threads: one connection vs four.
for c in 1 4; do
  bench "echo seq=2048 16 workers 1 client connections=$c" --mode echo --concurrency 16 \
    --channels 1 --connections $c --seq 2048 --tcp_ceiling_s 0
done
# 4k-token Attend: inline gRPC vs host shared memory vs CUDA IPC, 1 and 16 clients.
for t in grpc shm cuda-ipc; do
  bench "attend 4k $t" --transport $t --concurrency 1,16 --seq 4096 --tcp_ceiling_s 0
done
# Small requests (s=128), 64 clients: Echo of the same bytes vs the three transports.
bench "small echo" --mode echo --concurrency 64 --seq 128 --tcp_ceiling_s 0
for t in grpc shm cuda-ipc; do
  bench "small $t" --transport $t --concurrency 64 --seq 128 --tcp_ceiling_s 0
done
stop_attnd
# gRPC's TCP read chunks: 1 MiB (reads up to 8 MiB) on both ends vs gRPC's default.
start --tcp_read_chunk_bytes=1048576 || exit 1
bench "echo seq=2048 read_chunk=1MiB" --mode echo --concurrency 1,16 --seq 2048 \
  --tcp_read_chunk_bytes 1048576 --tcp_ceiling_s 0
bench "echo seq=8192 read_chunk=1MiB" --mode echo --concurrency 1,16 --seq 8192 \
  --tcp_read_chunk_bytes 1048576 --tcp_ceiling_s 0
stop_attnd
rm -f $sock
echo "done" | tee -a "$out/all.txt"

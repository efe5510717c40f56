#!/usr/bin/env bash
# 4k-token Attend (16 heads, d = 128, bf16) through host shared memory on the CUDA backend, with
# the regions registered with the GPU (copied straight between them and the device: attnd's
# default) and without (--shm_max_registered_bytes=0: through pinned staging, as before), next to
# inline gRPC and CUDA IPC regions, at 1 and 16 clients; the targets are >= 3x gRPC's req/s
# through host shm, >= 20x through CUDA IPC. ATTND_FLAGS (e.g. --streams=4) go to every attnd.
# Needs attnd, attnctl and attn-bench in BIN.
#   bench/shm_dma.sh BIN OUT_DIR [seconds per level]
# Writes OUT_DIR/all.txt (the tables), OUT_DIR/bench.csv and OUT_DIR/attnd.log.
set -uo pipefail
bin=$1; out=$2; secs=${3:-2}
mkdir -p "$out"
port=50741
sock=/tmp/attnd-shm-dma-$$.sock
# shellcheck source=attnd_lib.sh
. "$(dirname "$0")/attnd_lib.sh"
common=(--duration_s "$secs" --warmup_s 0.5 --heads 16 --head_dim 128 --dtype bf16 --seq 4096
        --concurrency 1,16 --tcp_ceiling_s 0)
# Room for 16 clients of 50 MB requests in pinned staging and in flight.
flags=(--backend=cuda --allow_shared_memory --shm_socket=$sock --shm_max_regions_per_client=1024
       --pinned_pool_bytes=$((8 << 30)) --max_inflight_bytes=$((8 << 30)))
bench() {  # name, attn-bench flags...
  local name=$1; shift
  echo "== $name: attn-bench $*" | tee -a "$out/all.txt"
  "$bin/attn-bench" --target 127.0.0.1:$port "${common[@]}" "$@" --label "$name" \
    --csv "$out/bench.csv" 2>&1 | tee -a "$out/all.txt"
}

nproc | sed 's/^/cores: /' | tee "$out/all.txt"
start_attnd "${flags[@]}" || exit 1
bench "attend 4k grpc" --transport grpc
bench "attend 4k shm registered" --transport shm
bench "attend 4k cuda-ipc" --transport cuda-ipc
stop_attnd
start_attnd "${flags[@]}" --shm_max_registered_bytes=0 || exit 1
bench "attend 4k shm staged" --transport shm
stop_attnd
rm -f "$sock"

#!/usr/bin/env bash
# Installs what is missing, builds attnd, starts it (CUDA backend where a GPU is usable, else the
# CPU backend), shows a first request answered, then keeps serving until Ctrl-C.
# Flags after the script name go to attnd (e.g. --listen=0.0.0.0:50051).
set -euo pipefail
cd "$(dirname "$0")/.."
ATTN_DEPS_BUILD_ONLY=1 scripts/install-deps.sh
ATTN_TARGETS="attnd attnctl" scripts/build.sh
build=${ATTN_BUILD_DIR:-build}
listen=127.0.0.1:50051
for a in "$@"; do case $a in --listen=*) listen=${a#--listen=};; esac; done
target=${listen/0.0.0.0/127.0.0.1}

"$build/server/attnd" --listen="$listen" "$@" &
pid=$!
trap 'kill -TERM $pid 2>/dev/null; wait $pid' INT TERM
for _ in $(seq 100); do
  "$build/client/attnctl" --target "$target" health >/dev/null 2>&1 && break
  kill -0 $pid 2>/dev/null || { echo "attnd exited" >&2; exit 1; }
  sleep 0.2
done
echo "== attnctl info"
"$build/client/attnctl" --target "$target" info
echo "== a first request: 2 x 256 tokens, 8 heads over 2 KV heads, d=128, bf16, causal, checked"
"$build/client/attnctl" --target "$target" attend --batch 2 --seq 256 --heads 8 --kv-heads 2 \
  --head-dim 128 --dtype bf16 --causal --count 3 --check
echo "== attnd is serving on $listen (metrics on :9464/metrics); Ctrl-C stops it"
wait $pid

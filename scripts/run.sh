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
metrics=0.0.0.0:9464  # attnd's default
# Flags may be written --flag=value or --flag value, with dashes or underscores.
prev=""
for a in "$@"; do
  case $prev in
    --listen) listen=$a ;;
    --metrics_listen|--metrics-listen) metrics=$a ;;
  esac
  case $a in
    --listen=*) listen=${a#--listen=} ;;
    --metrics_listen=*) metrics=${a#--metrics_listen=} ;;
    --metrics-listen=*) metrics=${a#--metrics-listen=} ;;
  esac
  prev=$a
done
target=${listen/0.0.0.0/127.0.0.1}
if [ -n "$metrics" ]; then metrics_note="metrics on ${metrics}/metrics"; else metrics_note="metrics off"; fi

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
echo "== attnd is serving on $listen ($metrics_note); Ctrl-C drains and stops it, a second Ctrl-C at once"
wait $pid

#!/usr/bin/env bash
# Installs what is missing, builds attnd, attnctl, attn-bench and the Python client (build/python),
# starts attnd (CUDA backend where
# a GPU is usable, else the CPU backend), shows a first request answered, then keeps serving until
# Ctrl-C. Flags after the script name go to attnd (e.g. --listen=0.0.0.0:50051); gRPC and metrics
# listen on loopback unless they say otherwise.
#
# Ctrl-C in a terminal reaches attnd itself (same process group): it drains and exits 0, and so
# does this script; a second Ctrl-C ends attnd at once. SIGTERM to this script is passed on.
# ATTN_RUN_SKIP_BUILD=1 uses what is already in the build directory (for tests).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${ATTN_BUILD_DIR:-build}
if [ -z "${ATTN_RUN_SKIP_BUILD:-}" ]; then
  ATTN_DEPS_BUILD_ONLY=1 scripts/install-deps.sh
  ATTN_TARGETS="attnd attnctl attn-bench attnd_python" scripts/build.sh
fi
attnd=$build/server/attnd
attnctl=$build/client/attnctl
listen=127.0.0.1:50051
metrics=127.0.0.1:9464
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
if [ -n "$metrics" ]; then metrics_note="metrics on http://${metrics}/metrics"; else metrics_note="metrics off"; fi

# attnd takes the last value of a flag: those given to run.sh come later and win.
"$attnd" --listen="$listen" --metrics_listen="$metrics" "$@" &
pid=$!
# SIGINT: attnd has it too (a terminal sends it to the whole foreground group) and drains, or
# exits at once on the second; sending it anything more would count as that second signal. (A
# no-op trap, not an ignored signal: the clients started below must still stop on Ctrl-C.)
trap ':' INT
trap 'kill -TERM $pid 2>/dev/null || true' TERM
# Waits for attnd and returns its exit status; a trapped signal interrupts `wait`, so wait again.
wait_attnd() {
  local rc=0
  while :; do
    wait "$pid" && rc=0 || rc=$?
    kill -0 "$pid" 2>/dev/null || return "$rc"
  done
}
serving=""
for _ in $(seq 300); do
  "$attnctl" --target "$target" health >/dev/null 2>&1 && { serving=1; break; }
  kill -0 $pid 2>/dev/null || break
  sleep 0.2
done
if [ -z "$serving" ]; then
  kill -0 $pid 2>/dev/null || { echo "run.sh: attnd exited" >&2; wait_attnd || exit $?; exit 1; }
  echo "run.sh: attnd is not SERVING after 60 s; still waiting for it (Ctrl-C stops it)" >&2
else
  # Failures here are reported and attnd keeps serving (it is what the person asked for).
  echo "== attnctl info"
  "$attnctl" --target "$target" info || echo "run.sh: attnctl info failed" >&2
  echo "== a first request: 2 x 256 tokens, 8 heads over 2 KV heads, d=128, bf16, causal, checked"
  "$attnctl" --target "$target" attend --batch 2 --seq 256 --heads 8 --kv-heads 2 \
    --head-dim 128 --dtype bf16 --causal --count 3 --check ||
    echo "run.sh: the first request failed (above)" >&2
  echo "== try: export PYTHONPATH=\$PWD/$build/python"
  echo "        python3 -m attnd --target $target attend --check --causal"
  echo "        python3 -m attnd --target $target session --check"
  [ -n "$metrics" ] && echo "        curl -s http://$metrics/metrics | grep ^attn_"
  echo "        $build/client/attnctl --target $target info"
  echo "        $build/client/attn-bench --target $target --concurrency 1,8"
  # Last: a terminal (or a test) that sees this line may press Ctrl-C at once.
  echo "== attnd is serving on $target ($metrics_note); Ctrl-C drains and stops it, a second Ctrl-C at once"
fi
rc=0
wait_attnd || rc=$?
exit "$rc"

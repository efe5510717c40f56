#!/usr/bin/env bash
# The metric names in the Grafana dashboard, the Prometheus rules and the prometheus-adapter values
# are checked against the names the built attnd really exposes, and every expression parses
# (promtool). attnd runs with the CPU backend on free loopback ports; one Attend request (and a
# rejected one) and one KV-cache session first, since some families (attn_requests_total) only
# appear after traffic.
#   grafana.sh DEPLOY_DIR BUILD_DIR ATTND ATTNCTL
. "$(dirname "$0")/lib.sh"
. "$(dirname "$0")/../../tests/lib/attnd.sh"
deploy="$(cd "$1" && pwd)"; build="$2"; attnd="$3"; attnctl="$4"
need promtool "Debian package prometheus"
need python3
need curl
[ -x "$attnd" ] || fail "attnd not built: $attnd"
[ -x "$attnctl" ] || fail "attnctl not built: $attnctl"

work="$build/grafana-check"
mkdir -p "$work"
pid=""
cleanup() {
  local rc=$?
  if [ -n "$pid" ]; then kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; fi
  if [ "$rc" != 0 ] && [ "$rc" != "$SKIP" ]; then echo "--- attnd log"; tail -n 20 "$work/attnd.log" || true; fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 1' INT TERM

start_cpu_attnd "$attnd" "$work/attnd.log" 1 || fail "attnd did not start"
pid=$ATTND_PID
attnd_healthy "$attnctl" || fail "attnd did not become healthy in 30 s"
"$attnctl" --target "127.0.0.1:$P" attend --seq 16 --heads 2 --head-dim 64 --count 1 >/dev/null ||
  fail "attnctl attend failed"
"$attnctl" --target "127.0.0.1:$P" attend --seq 16 --heads 2 --head-dim 1000 >/dev/null 2>&1 &&
  fail "attend with --head-dim 1000 succeeded"
# A KV-cache session (create, steps, truncate, fork, close) for the session metrics.
"$attnctl" --target "127.0.0.1:$P" session demo --layers 1 --kv-heads 1 --heads 2 --head-dim 64 \
  --prefill 16 --decode 2 --check >/dev/null || fail "attnctl session demo failed"
curl -fsS --max-time 10 "http://127.0.0.1:$M/metrics" > "$work/attnd.metrics" || fail "scraping attnd /metrics"

timeout 90 python3 "$deploy/tests/grafana_check.py" "$work/attnd.metrics" \
  "$deploy/grafana/attnd-dashboard.json" "$deploy/prometheus/rules" \
  "$deploy/k8s/prometheus-adapter/values.yaml" "$deploy/../server/observability/metrics.cc" "$work" ||
  { rc=$?; [ "$rc" = "$SKIP" ] && exit "$SKIP"; fail "metric names / expressions check"; }

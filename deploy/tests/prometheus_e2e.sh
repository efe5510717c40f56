#!/usr/bin/env bash
# End to end: a real attnd (CPU backend) scraped by a real Prometheus that runs the shipped scrape
# config (job attnd; target, scrape and evaluation interval replaced) and the shipped rules.
# Sends N good and B bad Attend requests with attnctl, then checks through the Prometheus HTTP API
# that the counters, the latency histogram and a recording rule reflect exactly that traffic.
#   prometheus_e2e.sh DEPLOY_DIR ATTND ATTNCTL
# Exit 77 (skip) only when no prometheus binary can be found.
. "$(dirname "$0")/lib.sh"
deploy="$(cd "$1" && pwd)"; attnd="$2"; attnctl="$3"
N="${ATTN_E2E_REQUESTS:-25}"   # successful Attend requests
B="${ATTN_E2E_BAD:-3}"         # INVALID_ARGUMENT Attend requests

command -v prometheus >/dev/null 2>&1 || skip "prometheus not found (Debian package prometheus; scripts/install-deps.sh installs it)"
need curl
need python3
[ -x "$attnd" ] || fail "attnd not built: $attnd"
[ -x "$attnctl" ] || fail "attnctl not built: $attnctl"

work="$(mktemp -d "${TMPDIR:-/tmp}/attn-prom-e2e.XXXXXX")"
pids=()
cleanup() {
  local rc=$?
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  if [ "$rc" != 0 ] && [ "$rc" != "$SKIP" ]; then
    echo "--- attnd log"; tail -n 30 "$work/attnd.log" 2>/dev/null || true
    echo "--- prometheus log"; tail -n 30 "$work/prometheus.log" 2>/dev/null || true
  fi
  rm -rf "$work"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 1' INT TERM

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}
wait_for() {  # wait_for SECONDS WHAT CMD...
  local t="$1" what="$2"; shift 2
  for _ in $(seq $((t * 5))); do "$@" >/dev/null 2>&1 && return 0; sleep 0.2; done
  fail "timed out after ${t}s waiting for $what"
}

# --- attnd ------------------------------------------------------------------------------------
P=$(free_port); M=$(free_port)
"$attnd" --listen="127.0.0.1:$P" --metrics_listen="127.0.0.1:$M" --backend=cpu --threads=2 \
  >"$work/attnd.log" 2>&1 &
pids+=($!)
wait_for 30 "attnd health" "$attnctl" --target "127.0.0.1:$P" health
wait_for 10 "attnd /metrics" curl -fsS "http://127.0.0.1:$M/metrics"

# --- Prometheus with the shipped config and rules -----------------------------------------------
X=$(free_port)
cfg="$work/prometheus.yml"
sed -e "s#- localhost:9464#- 127.0.0.1:$M#" \
    -e "s#scrape_interval: 15s#scrape_interval: 1s#" \
    -e "s#evaluation_interval: 15s#evaluation_interval: 1s#" \
    -e "s#- rules/#- $deploy/prometheus/rules/#" \
    "$deploy/prometheus/prometheus.yml" > "$cfg"
grep -q "127.0.0.1:$M" "$cfg" && grep -q 'scrape_interval: 1s' "$cfg" && grep -q 'evaluation_interval: 1s' "$cfg" &&
  grep -q "job_name: attnd" "$cfg" && grep -q "$deploy/prometheus/rules/" "$cfg" ||
  fail "could not derive the test config from deploy/prometheus/prometheus.yml (its layout changed?)"
if command -v promtool >/dev/null; then promtool check config "$cfg" >/dev/null || fail "derived config is invalid"; fi
prometheus --config.file="$cfg" --storage.tsdb.path="$work/tsdb" --web.listen-address="127.0.0.1:$X" \
  >"$work/prometheus.log" 2>&1 &
pids+=($!)
api="http://127.0.0.1:$X/api/v1"
wait_for 30 "Prometheus ready" curl -fsS "http://127.0.0.1:$X/-/ready"

# query EXPR: prints the single value of an instant query ("" when the result is empty).
query() {
  curl -fsS --max-time 5 "$api/query" --data-urlencode "query=$1" | python3 -c '
import json, sys
r = json.load(sys.stdin)
assert r["status"] == "success", r
res = r["data"]["result"]
if len(res) > 1: sys.exit("more than one series: %s" % res)
print(res[0]["value"][1] if res else "")'
}
# poll SECONDS WHAT EXPR PYCOND: until float(value) satisfies PYCOND (v is the value)
poll() {
  local t="$1" what="$2" expr="$3" cond="$4" v=""
  for _ in $(seq $((t * 2))); do
    v="$(query "$expr" || true)"
    if [ -n "$v" ] && python3 -c "import math,sys; v=float(sys.argv[1]); sys.exit(0 if ($cond) else 1)" "$v"; then
      echo "ok: $what = $v"; return 0
    fi
    sleep 0.5
  done
  fail "$what: '$expr' = '${v:-<empty>}', expected $cond"
}

poll 30 "target up" 'up{job="attnd"}' 'v == 1'

# --- traffic -----------------------------------------------------------------------------------
# A counter series is born on its first increment; Prometheus computes no rate from a series'
# first sample, so one good and one bad request go first, and the rest once those are scraped.
[ "$N" -ge 2 ] && [ "$B" -ge 2 ] || fail "ATTN_E2E_REQUESTS and ATTN_E2E_BAD must be >= 2"
good() {
  "$attnctl" --target "127.0.0.1:$P" attend --seq 64 --heads 4 --head-dim 64 --dtype bf16 --count "$1" \
    >"$work/attnctl.log" 2>&1 || { cat "$work/attnctl.log"; fail "attnctl attend failed"; }
}
bad() {
  for _ in $(seq "$1"); do
    if "$attnctl" --target "127.0.0.1:$P" attend --seq 64 --heads 4 --head-dim 1000 --dtype bf16 \
        >"$work/bad.log" 2>&1; then
      fail "attend with --head-dim 1000 succeeded"
    fi
    grep -q INVALID_ARGUMENT "$work/bad.log" || { cat "$work/bad.log"; fail "bad request did not get INVALID_ARGUMENT"; }
  done
}
echo "sending 1 Attend request and 1 bad one"
good 1
bad 1
poll 30 "first Attend OK scraped" 'attn_requests_total{job="attnd",rpc="Attend",code="OK"}' "v == 1"
poll 30 "first INVALID_ARGUMENT scraped" 'attn_requests_total{job="attnd",rpc="Attend",code="INVALID_ARGUMENT"}' "v == 1"
echo "sending $((N - 1)) more Attend requests and $((B - 1)) more bad ones"
good $((N - 1))
bad $((B - 1))

# --- what Prometheus saw -------------------------------------------------------------------------
poll 30 "Attend OK count" 'attn_requests_total{job="attnd",rpc="Attend",code="OK"}' "v == $N"
poll 30 "Attend INVALID_ARGUMENT count" \
  'attn_requests_total{job="attnd",rpc="Attend",code="INVALID_ARGUMENT"}' "v == $B"
poll 30 "Attend latency observations" \
  'sum(attn_request_duration_seconds_count{job="attnd",rpc="Attend"})' "v == $N + $B"
# The slowest observed request lies below the first bucket whose count reaches the total.
maxobs=$(curl -fsS "$api/query" --data-urlencode 'query=attn_request_duration_seconds_bucket{job="attnd",rpc="Attend"}' |
  python3 -c '
import json, sys
r = json.load(sys.stdin)["data"]["result"]
b = sorted((float(s["metric"]["le"]), float(s["value"][1])) for s in r)
total = b[-1][1]
print(next(le for le, c in b if c >= total))')
echo "slowest Attend request <= $maxobs s (its bucket bound)"
poll 20 "p50 Attend latency (histogram_quantile)" \
  'histogram_quantile(0.5, sum by (le) (attn_request_duration_seconds_bucket{job="attnd",rpc="Attend"}))' \
  "math.isfinite(v) and 0 < v <= $maxobs"
# Recording rules evaluated by this Prometheus (evaluation_interval 1s).
poll 30 "recording rule job:attn_requests:rate5m" 'job:attn_requests:rate5m{job="attnd"}' 'math.isfinite(v) and v > 0'
poll 30 "recording rule job_rpc_code:attn_requests:rate5m (INVALID_ARGUMENT)" \
  'job_rpc_code:attn_requests:rate5m{job="attnd",rpc="Attend",code="INVALID_ARGUMENT"}' 'math.isfinite(v) and v > 0'
poll 30 "recording rule job:attn_request_errors:ratio_rate5m" 'job:attn_request_errors:ratio_rate5m{job="attnd"}' \
  'math.isfinite(v) and 0 < v < 1'
poll 30 "recording rule job_rpc:attn_request_duration_seconds:p50_rate5m" \
  'job_rpc:attn_request_duration_seconds:p50_rate5m{job="attnd",rpc="Attend"}' "math.isfinite(v) and 0 < v <= $maxobs"
poll 10 "attn_build_info" 'attn_build_info{job="attnd"}' 'v == 1'
echo "prometheus e2e: ok"

#!/usr/bin/env bash
# End to end: a real attnd (CPU backend) scraped by a real Prometheus that runs the shipped scrape
# config (job attnd; target, scrape and evaluation interval replaced) and the shipped rules.
# Sends N good and B bad Attend requests with attnctl, then checks through the Prometheus HTTP API
# that the counters are exact, and (prom_exact.py) that histogram_quantile and the p50, error-ratio
# and request-rate recording rules equal, within 1e-6 relative, what the raw samples read back at
# fixed times imply (promql's bucket interpolation and rate() extrapolation re-computed), and
# that the error ratio is B/(N+B).
#   prometheus_e2e.sh DEPLOY_DIR ATTND ATTNCTL
# Exit 77 (skip) only when no prometheus binary can be found.
. "$(dirname "$0")/lib.sh"
. "$(dirname "$0")/../../tests/lib/attnd.sh"
deploy="$(cd "$1" && pwd)"; attnd="$2"; attnctl="$3"
N="${ATTN_E2E_REQUESTS:-25}"   # successful Attend requests (a multiple of 5)
B="${ATTN_E2E_BAD:-5}"         # INVALID_ARGUMENT Attend requests (a multiple of 5)

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

wait_for() {  # wait_for SECONDS WHAT CMD...
  local t="$1" what="$2"; shift 2
  for _ in $(seq $((t * 5))); do "$@" >/dev/null 2>&1 && return 0; sleep 0.2; done
  fail "timed out after ${t}s waiting for $what"
}

# --- attnd ------------------------------------------------------------------------------------
start_cpu_attnd "$attnd" "$work/attnd.log" 2 || fail "attnd did not start"
pids+=("$ATTND_PID")
attnd_healthy "$attnctl" || fail "timed out after 30s waiting for attnd health"
wait_for 10 "attnd /metrics" curl -fsS "http://127.0.0.1:$M/metrics"

# --- Prometheus with the shipped config and rules -----------------------------------------------
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
# Prometheus cannot report a port it picked: it gets a free one, and another if that was taken
# before it bound it (by another test's connection), up to three tries.
start_prometheus() {
  local try pid
  for try in 1 2 3; do
    X=$(free_port)
    prometheus --config.file="$cfg" --storage.tsdb.path="$work/tsdb" --web.listen-address="127.0.0.1:$X" \
      >"$work/prometheus.log" 2>&1 &
    pid=$!
    for _ in $(seq 150); do
      if curl -fsS "http://127.0.0.1:$X/-/ready" >/dev/null 2>&1; then
        pids+=("$pid")
        return 0
      fi
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.2
    done
    kill "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    echo "Prometheus on port $X did not become ready (try $try): $(tail -n 3 "$work/prometheus.log")" >&2
  done
  fail "Prometheus did not become ready in three tries"
}
start_prometheus
api="http://127.0.0.1:$X/api/v1"

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
# A counter series is born on its first increment, and rate() extrapolates each series by its own
# first sample (promql extrapolatedRate): the error ratio is exactly B/(N+B) only when the OK and
# INVALID_ARGUMENT series are first scraped together with first values in the proportion N:B.
# So a priming batch of N/K good and B/K bad requests goes out right after a scrape (both land
# before the next one), and the rest once those are scraped.
K=5
[ "$N" -ge "$K" ] && [ "$B" -ge "$K" ] && [ $((N % K)) = 0 ] && [ $((B % K)) = 0 ] ||
  fail "ATTN_E2E_REQUESTS and ATTN_E2E_BAD must be positive multiples of $K"
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
# Wait for the moment 50 ms after the next scrape (scrapes come every 1 s at a fixed phase).
after_next_scrape() {
  local last now
  last="$(query 'timestamp(up{job="attnd"})')"
  now="$(date +%s.%N)"
  python3 -c 'import math,sys,time; last,now=map(float,sys.argv[1:]); k=max(1,math.ceil(now-last+0.05)); time.sleep(max(0,last+k+0.05-now))' "$last" "$now"
}
after_next_scrape
echo "priming: $((N / K)) Attend requests and $((B / K)) bad ones right after a scrape"
good $((N / K))
bad $((B / K))
poll 30 "priming Attend OK scraped" 'attn_requests_total{job="attnd",rpc="Attend",code="OK"}' "v == $((N / K))"
poll 30 "priming INVALID_ARGUMENT scraped" \
  'attn_requests_total{job="attnd",rpc="Attend",code="INVALID_ARGUMENT"}' "v == $((B / K))"
echo "sending $((N - N / K)) more Attend requests and $((B - B / K)) more bad ones"
good $((N - N / K))
bad $((B - B / K))

# --- what Prometheus saw -------------------------------------------------------------------------
poll 30 "Attend OK count" 'attn_requests_total{job="attnd",rpc="Attend",code="OK"}' "v == $N"
poll 30 "Attend INVALID_ARGUMENT count" \
  'attn_requests_total{job="attnd",rpc="Attend",code="INVALID_ARGUMENT"}' "v == $B"
poll 30 "Attend latency observations" \
  'sum(attn_request_duration_seconds_count{job="attnd",rpc="Attend"})' "v == $N + $B"
# Recording rules evaluated by this Prometheus (evaluation_interval 1s) on the final counts.
poll 30 "recording rule job_rpc_code:attn_requests:rate5m (INVALID_ARGUMENT)" \
  'job_rpc_code:attn_requests:rate5m{job="attnd",rpc="Attend",code="INVALID_ARGUMENT"}' 'math.isfinite(v) and v > 0'
poll 30 "error ratio rule sees the final counts" \
  'job:attn_request_errors:ratio_rate5m{job="attnd"} and on (job) (min_over_time(sum by (job) (attn_requests_total{job="attnd"})[3s:1s]) == '"$((N + B))"')' \
  'math.isfinite(v)'
# A few more evaluations on the final counts, then the exact checks (raw samples read back at
# fixed times with time=, histogram_quantile and rate() re-computed; see prom_exact.py).
sleep 4
timeout 60 python3 "$(dirname "$0")/prom_exact.py" "$api" "$N" "$B" || fail "exact checks"
poll 10 "attn_build_info" 'attn_build_info{job="attnd"}' 'v == 1'
echo "prometheus e2e: ok"

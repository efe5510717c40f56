#!/usr/bin/env bash
# attn-bench against a real attnd (CPU backend, loopback): --rate holds the offered rate in
# stream mode (and unary), --compare_echo adds an Echo row per level and the ratio columns
# (table, CSV, JSON), --lb round_robin is accepted; --help of attn-bench and attnctl lists
# their own flags.
#   attn_bench_test.sh ATTND ATTN_BENCH ATTNCTL
set -euo pipefail
attnd="$1"; bench="$2"; attnctl="$3"
work="$(mktemp -d "${TMPDIR:-/tmp}/attn-bench-test.XXXXXX")"
pid=""
cleanup() {
  local rc=$?
  if [ -n "$pid" ]; then kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; fi
  [ "$rc" = 0 ] || { echo "--- attnd log"; tail -n 20 "$work/attnd.log" || true; }
  rm -rf "$work"
  exit "$rc"
}
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
. "$(dirname "$0")/../../tests/lib/attnd.sh"
# --help prints to stdout and exits 1 (Abseil); the flags must be the program's own.
help_lists() {  # program, flags...
  local prog=$1; shift
  local out; out=$("$prog" --help 2>&1 || true)
  for f in "$@"; do
    grep -q -- "--$f " <<<"$out" || fail "$(basename "$prog") --help does not list --$f"
  done
}
help_lists "$bench" target mode concurrency compare_echo rate lb tcp_ceiling_s transport connections
help_lists "$attnctl" target check lb
start_cpu_attnd "$attnd" "$work/attnd.log" 2
pid=$ATTND_PID
attnd_healthy "$attnctl" || fail "attnd did not become healthy"
shape=(--seq 16 --heads 2 --head-dim 64 --dtype bf16)

# --rate in stream mode: 2 streams, 40 requests/s in all, over 3 s. The closed loop (no --rate)
# runs far faster than that on this shape, so a rate near 40/s shows the schedule is kept.
for mode in stream unary; do  # (no TCP ceiling: rates only)
  "$bench" --target "127.0.0.1:$P" --mode $mode --rate 40 --concurrency 2 --duration_s 3 \
    --warmup_s 0.5 --tcp_ceiling_s 0 "${shape[@]}" --json "$work/rate-$mode.json"
  python3 - "$work/rate-$mode.json" "$mode" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))[0]
assert r["mode"] == sys.argv[2] and r["rate"] == 40 and r["errors"] == 0, r
assert 34 <= r["requests_per_s"] <= 46, f"{sys.argv[2]} --rate 40 gave {r['requests_per_s']} req/s"
print(f"ok: {sys.argv[2]} --rate 40 -> {r['requests_per_s']} req/s")
PY
done
"$bench" --target "127.0.0.1:$P" --mode stream --concurrency 2 --duration_s 1 --warmup_s 0.3 \
  "${shape[@]}" --json "$work/closed.json"
python3 -c '
import json, sys
r = json.load(open(sys.argv[1]))[0]
assert r["requests_per_s"] > 100, r
print("ok: stream closed loop", r["requests_per_s"], "req/s")' "$work/closed.json"

# --compare_echo: per level the mode row, then Echo; ratios = mode over Echo (req/s, p50).
"$bench" --target "ipv4:127.0.0.1:$P" --lb round_robin --mode unary --concurrency 1,2 \
  --duration_s 1 --warmup_s 0.3 "${shape[@]}" --compare_echo --tcp_ceiling_s 0.3 --csv "$work/cmp.csv" \
  --json "$work/cmp.json" | tee "$work/cmp.txt"
grep -q 'rps/echo' "$work/cmp.txt" || fail "no rps/echo column in the table"
grep -q 'x_tcp' "$work/cmp.txt" || fail "no x_tcp (raw TCP ceiling) column in the table"
python3 - "$work/cmp.json" "$work/cmp.csv" <<'PY'
import csv, json, math, sys
rows = json.load(open(sys.argv[1]))
assert [(r["mode"], r["concurrency"]) for r in rows] == [("unary", 1), ("echo", 1), ("unary", 2), ("echo", 2)], rows
for a, e in zip(rows[0::2], rows[1::2]):
    assert a["errors"] == 0 and e["errors"] == 0 and e["requests"] > 0, (a, e)
    assert math.isclose(a["echo_rps_ratio"], a["requests_per_s"] / e["requests_per_s"], rel_tol=1e-4), (a, e)
    assert math.isclose(a["echo_p50_ratio"], a["p50_ms"] / e["p50_ms"], rel_tol=1e-4), (a, e)
    assert "echo_rps_ratio" not in e
    # The raw TCP ceiling with the same bytes and concurrency, measured in the same run.
    assert a["tcp_gb_per_s"] > 0 and e["tcp_gb_per_s"] == a["tcp_gb_per_s"], (a, e)
c = list(csv.DictReader(open(sys.argv[2])))
assert [r["mode"] for r in c] == ["unary", "echo", "unary", "echo"], c
for r, j in zip(c, rows):
    if r["mode"] == "unary":
        assert math.isclose(float(r["echo_rps_ratio"]), j["echo_rps_ratio"], rel_tol=1e-4), (r, j)
        assert math.isclose(float(r["echo_p50_ratio"]), j["echo_p50_ratio"], rel_tol=1e-4), (r, j)
    else:
        assert r["echo_rps_ratio"] == "" and r["echo_p50_ratio"] == "", r
print("ok: --compare_echo rows and ratios (table, CSV, JSON)")
PY

# --transport shm: refused (with the reason) by this attnd, which does not allow shared memory;
# served by one started with --allow_shared_memory.
if "$bench" --target "127.0.0.1:$P" --transport shm --concurrency 1 --duration_s 0.5 \
     --warmup_s 0.1 "${shape[@]}" >"$work/shm-off.txt" 2>&1; then
  fail "--transport shm succeeded against an attnd without --allow_shared_memory"
fi
grep -q -- "--allow_shared_memory" "$work/shm-off.txt" || fail "no reason given: $(cat "$work/shm-off.txt")"
P2=$(free_port)
"$attnd" --listen="127.0.0.1:$P2" --metrics_listen= --backend=cpu --threads=2 \
  --allow_shared_memory --shm_socket="$work/regions.sock" >"$work/attnd-shm.log" 2>&1 &
pid2=$!
trap 'kill $pid2 2>/dev/null || true; cleanup' EXIT
P_SAVE=$P; P=$P2; attnd_healthy "$attnctl" || fail "attnd with shared memory did not start"; P=$P_SAVE
"$bench" --target "127.0.0.1:$P2" --transport shm --concurrency 1,2 --duration_s 1 --warmup_s 0.3 \
  "${shape[@]}" --json "$work/shm.json"
python3 - "$work/shm.json" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))
assert [(r["mode"], r["concurrency"]) for r in rows] == [("shm", 1), ("shm", 2)], rows
for r in rows:
    assert r["errors"] == 0 and r["requests"] > 10, r
print("ok: --transport shm", [round(r["requests_per_s"]) for r in rows], "req/s")
PY
kill $pid2; wait $pid2 2>/dev/null || true

#!/usr/bin/env bash
# attn-bench against a real attnd (CPU backend, loopback): --rate holds the offered rate in
# stream mode (and unary), --compare_echo adds an Echo row per level and the ratio columns
# (table, CSV, JSON), --lb round_robin is accepted, --client_coding wire and protobuf both run
# Attend and Echo without errors, FP8 Attend too; --help of attn-bench and attnctl lists
# their own flags. Sessions: `attnctl session demo --check` passes (and fails as it should on bad
# input), `attn-bench --mode decode` through Step and BatchStep (rows, Echo twins, cache length
# held by truncation, KV bandwidth).
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
help_lists "$bench" target mode concurrency compare_echo rate lb sessions layers cache_tokens batch_step tcp_ceiling_s transport connections client_coding
help_lists "$attnctl" target check lb layers prefill decode truncate connections
start_cpu_attnd "$attnd" "$work/attnd.log" 2 || fail "attnd did not start"
pid=$ATTND_PID
attnd_healthy "$attnctl" || fail "attnd did not become healthy"
shape=(--seq 16 --heads 2 --head-dim 64 --dtype bf16)

# --rate in stream mode: 2 streams, 40 requests/s in all, over 3 s. The closed loop (no --rate)
# runs far faster than that on this shape, so a rate near 40/s shows the schedule is kept. A
# sanitizer build computes several times slower: 8/s there.
rate=40
[ -n "${ATTN_SANITIZER:-}" ] && rate=8
for mode in stream unary; do  # (no TCP ceiling: rates only)
  "$bench" --target "127.0.0.1:$P" --mode $mode --rate $rate --concurrency 2 --duration_s 3 \
    --warmup_s 0.5 --tcp_ceiling_s 0 "${shape[@]}" --json "$work/rate-$mode.json"
  python3 - "$work/rate-$mode.json" "$mode" "$rate" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))[0]
rate = int(sys.argv[3])
assert r["mode"] == sys.argv[2] and r["rate"] == rate and r["errors"] == 0, r
assert 0.85 * rate <= r["requests_per_s"] <= 1.15 * rate, \
    f"{sys.argv[2]} --rate {rate} gave {r['requests_per_s']} req/s"
print(f"ok: {sys.argv[2]} --rate {rate} -> {r['requests_per_s']} req/s")
PY
done
# The closed loop with either client coding (wire: the client library's raw stream).
for coding in wire protobuf; do
  "$bench" --target "127.0.0.1:$P" --mode stream --concurrency 2 --duration_s 1 --warmup_s 0.3 \
    "${shape[@]}" --client_coding $coding --json "$work/closed.json" | tee "$work/closed.txt"
  grep -q "client coding $coding" "$work/closed.txt" || fail "stream mode did not say its coding ($coding)"
  python3 -c '
import json, sys
r = json.load(open(sys.argv[1]))[0]
assert r["errors"] == 0 and r["requests_per_s"] > 100, r
assert r["server_compute_us"] > 0, r  # the server timings came back with the responses
print("ok: stream closed loop,", sys.argv[2], "coding:", r["requests_per_s"], "req/s")' "$work/closed.json" $coding
  # Refused items come back on the open stream with the server's status, counted as errors.
  "$bench" --target "127.0.0.1:$P" --mode stream --concurrency 1 --duration_s 0.5 --warmup_s 0.1 \
    --seq 16 --heads 2 --head-dim 1000 --dtype bf16 --client_coding $coding --tcp_ceiling_s 0 \
    >"$work/refused.txt" 2>&1 || true  # (non-zero: the level had errors)
  grep -q "first error: head_dim 1000 (q.shape\[2\]) is not supported" "$work/refused.txt" ||
    fail "stream ($coding): a refused item's status did not come back: $(cat "$work/refused.txt")"
done

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

# --client_coding: the client library's raw calls (the default) and the generated stub both
# answer every call; the first line says which ran; a bad value is refused.
for coding in wire protobuf; do
  "$bench" --target "127.0.0.1:$P" --mode unary --client_coding $coding --concurrency 2 \
    --duration_s 0.5 --warmup_s 0.2 "${shape[@]}" --compare_echo --tcp_ceiling_s 0 \
    --json "$work/coding-$coding.json" | tee "$work/coding-$coding.txt"
  grep -q "client coding $coding" "$work/coding-$coding.txt" || fail "the table does not say --client_coding $coding"
  python3 - "$work/coding-$coding.json" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))
assert [r["mode"] for r in rows] == ["unary", "echo"], rows
assert all(r["errors"] == 0 and r["requests"] > 5 for r in rows), rows
PY
done
rc=0; "$bench" --target "127.0.0.1:$P" --client_coding json >"$work/bad.txt" 2>&1 || rc=$?
[ "$rc" = 64 ] && grep -q -- '--client_coding must be' "$work/bad.txt" || fail "--client_coding json: rc $rc"
echo "ok: --client_coding wire and protobuf"

# FP8 Attend: all three tensors e4m3 (unary, both codings), and k and v only (stream); no errors.
# FP8 tensors travel in the request: another transport is refused.
for args in "--mode unary --dtype fp8 --client_coding wire" "--mode unary --dtype fp8 --client_coding protobuf" \
            "--mode stream --dtype bf16 --kv_dtype fp8"; do
  # shellcheck disable=SC2086
  "$bench" --target "127.0.0.1:$P" $args --concurrency 2 --duration_s 1 --warmup_s 0.3 \
    --seq 16 --heads 2 --head-dim 64 --json "$work/fp8.json"
  python3 - "$work/fp8.json" "$args" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))[0]
assert r["errors"] == 0 and r["requests"] > 5, (sys.argv[2], r)
PY
done
rc=0; "$bench" --target "127.0.0.1:$P" --dtype fp8 --transport shm >"$work/bad.txt" 2>&1 || rc=$?
[ "$rc" = 64 ] && grep -q -- 'FP8 tensors travel in the request' "$work/bad.txt" || fail "fp8 over shm: rc $rc"
echo "ok: FP8 Attend (q, k, v and k, v only)"

# --- sessions ----------------------------------------------------------------------------------
# The demo with every step checked against the float64 reference: bf16 with the lse, then fp16
# with a chunked prefill and a sliding window.
"$attnctl" --target "127.0.0.1:$P" session demo --layers 2 --kv-heads 2 --heads 8 --head-dim 64 \
  --dtype bf16 --prefill 100 --decode 20 --lse --check --seed 5 | tee "$work/demo.txt"
grep -q '^PASS: ' "$work/demo.txt" || fail "session demo did not print PASS"
grep -q 'step after close: NOT_FOUND' "$work/demo.txt" || fail "session demo did not check NOT_FOUND after close"
steps=$(grep -c -E '^(prefill|decode) ' "$work/demo.txt")
# 2 layers x (1 prefill + 20 decode) on the parent, then 2 tokens x 2 layers on the fork and on it.
[ "$steps" = 50 ] || fail "session demo made $steps steps, expected 50"
"$attnctl" --target "127.0.0.1:$P" session demo --layers 1 --kv-heads 1 --heads 4 --head-dim 128 \
  --dtype fp16 --prefill 70 --chunk 32 --decode 5 --window-left 16 --check | tee "$work/demo2.txt"
grep -q '^PASS: ' "$work/demo2.txt" || fail "session demo (fp16, chunks, window) did not print PASS"
[ "$(grep -c '^prefill ' "$work/demo2.txt")" = 3 ] || fail "a 70-token prefill in chunks of 32 is not 3 steps"
# An FP8 cache (the server quantizes k_new/v_new; the check reads the cache as quantized): its
# pages hold twice the tokens of the bf16 demo's rows of the same shape.
"$attnctl" --target "127.0.0.1:$P" session demo --layers 2 --kv-heads 2 --heads 8 --head-dim 64 \
  --dtype bf16 --kv-dtype fp8 --prefill 40 --chunk 16 --decode 5 --check | tee "$work/demo_fp8.txt"
grep -q '^PASS: ' "$work/demo_fp8.txt" || fail "session demo (FP8 cache) did not print PASS"
page_tokens() { sed -n 's/.*pages of \([0-9]*\) tokens.*/\1/p' "$1" | head -1; }
[ "$(page_tokens "$work/demo_fp8.txt")" = $((2 * $(page_tokens "$work/demo.txt"))) ] ||
  fail "an FP8 cache's pages do not hold twice the tokens of a bf16 one"
# Bad input: refused by the server (exit 2, its code), or by attnctl before any call (64).
rc=0; "$attnctl" --target "127.0.0.1:$P" session demo --head-dim 1000 --check >"$work/bad.txt" 2>&1 || rc=$?
[ "$rc" = 2 ] && grep -q INVALID_ARGUMENT "$work/bad.txt" || { cat "$work/bad.txt"; fail "head dim 1000: rc $rc"; }
rc=0; "$attnctl" --target "127.0.0.1:$P" session demo --heads 8 --kv-heads 3 >"$work/bad.txt" 2>&1 || rc=$?
[ "$rc" = 64 ] || { cat "$work/bad.txt"; fail "--heads 8 --kv-heads 3: rc $rc, expected 64"; }
rc=0; "$attnctl" --target "127.0.0.1:$P" session demo --prefill 3 --decode 0 --truncate 5 >"$work/bad.txt" 2>&1 || rc=$?
[ "$rc" = 2 ] && grep -q INVALID_ARGUMENT "$work/bad.txt" || { cat "$work/bad.txt"; fail "truncate past the start: rc $rc"; }

# attn-bench --mode decode: Step (one caller per session), then BatchStep (2 sessions per call).
# The checks below want more than 20 steps of each: 4 s under a sanitizer, which computes slower.
dshape=(--layers 2 --cache_tokens 64 --heads 8 --kv_heads 2 --head_dim 64 --dtype bf16 --decode_window 4)
dur=1
[ -n "${ATTN_SANITIZER:-}" ] && dur=4
"$bench" --target "127.0.0.1:$P" --mode decode --sessions 2 "${dshape[@]}" --duration_s $dur --warmup_s 0.3 \
  --json "$work/decode.json" --csv "$work/decode.csv" | tee "$work/decode.txt"
"$bench" --target "127.0.0.1:$P" --mode decode --sessions 3 --batch_step 2 "${dshape[@]}" --duration_s $dur \
  --warmup_s 0.3 --json "$work/decode-batch.json" --csv "$work/decode.csv"
grep -q 'steps/echo' "$work/decode.txt" || fail "no steps/echo column in the decode table"
python3 - "$work/decode.json" "$work/decode-batch.json" "$work/decode.csv" <<'PY'
import csv, json, math, sys
step, batch = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
assert [r["mode"] for r in step] == ["step", "echo"], step
assert [r["mode"] for r in batch] == ["batch_step", "echo"], batch
kv_bytes_per_token = 2 * 2 * 64 * 2  # K and V, 2 KV heads, head dim 64, bf16
for (d, e), callers, per_call in ((step, 2, 1), (batch, 2, 1.5)):
    assert d["errors"] == 0 and e["errors"] == 0, (d, e)
    assert d["sessions"] == e["sessions"] and d["callers"] == e["callers"] == callers, (d, e)
    assert math.isclose(d["steps_per_call"], per_call), d
    assert d["steps"] > 20 and e["steps"] > 20, (d, e)
    # Truncation every 4 decode tokens keeps each layer between 65 and 68 tokens after a step.
    assert 65 <= d["mean_cache_tokens"] <= 68, d
    assert math.isclose(d["kv_bytes_per_s"], d["steps_per_s"] * d["mean_cache_tokens"] * kv_bytes_per_token,
                        rel_tol=1e-6), d
    assert math.isclose(d["tokens_per_s"], d["steps_per_s"] / 2, rel_tol=1e-9), d
    assert math.isclose(d["echo_steps_ratio"], d["steps_per_s"] / e["steps_per_s"], rel_tol=1e-4), (d, e)
    assert math.isclose(d["echo_p50_ratio"], d["p50_ms"] / e["p50_ms"], rel_tol=1e-4), (d, e)
    assert "echo_steps_ratio" not in e and "kv_bytes_per_s" not in e, e
    assert d["request_bytes"] == e["request_bytes"] > 0 and d["response_bytes"] == e["response_bytes"] > 0
    assert d["p50_ms"] > 0 and d["p99_ms"] >= d["p50_ms"] and d["server_compute_us"] > 0, d
rows = list(csv.DictReader(open(sys.argv[3])))
assert [r["mode"] for r in rows] == ["step", "echo", "batch_step", "echo"], rows
assert rows[0]["kv_bytes_per_s"] != "" and rows[1]["kv_bytes_per_s"] == "", rows
print("ok: decode rows (Step, BatchStep) with Echo twins, cache held at 65-68 tokens, KV bandwidth")
PY
# With an FP8 cache: one byte per cached element in the KV bandwidth.
"$bench" --target "127.0.0.1:$P" --mode decode --sessions 2 "${dshape[@]}" --kv_dtype fp8 \
  --duration_s $dur --warmup_s 0.3 --json "$work/decode-fp8.json" | tee "$work/decode-fp8.txt"
grep -q 'with an FP8 E4M3 KV cache' "$work/decode-fp8.txt" || fail "decode --kv_dtype fp8: no FP8 cache"
python3 - "$work/decode-fp8.json" <<'PY'
import json, math, sys
d = json.load(open(sys.argv[1]))[0]
assert d["mode"] == "step" and d["errors"] == 0 and d["steps"] > 20, d
assert math.isclose(d["kv_bytes_per_s"], d["steps_per_s"] * d["mean_cache_tokens"] * 2 * 2 * 64,
                    rel_tol=1e-6), d
print("ok: decode with an FP8 cache")
PY
rc=0; "$bench" --target "127.0.0.1:$P" --mode decode --kv_dtype fp7 >"$work/bad.txt" 2>&1 || rc=$?
[ "$rc" = 64 ] && grep -q -- '--kv_dtype must be fp8' "$work/bad.txt" || fail "--kv_dtype fp7: rc $rc"
rc=0; "$bench" --target "127.0.0.1:$P" --mode decode --concurrency 4 >"$work/bad.txt" 2>&1 || rc=$?
[ "$rc" = 64 ] && grep -q -- '--concurrency does not apply' "$work/bad.txt" || fail "decode took --concurrency (rc $rc)"
# --transport shm: refused (with the reason) by this attnd, which does not allow shared memory;
# served by one started with --allow_shared_memory.
if "$bench" --target "127.0.0.1:$P" --transport shm --concurrency 1 --duration_s 0.5 \
     --warmup_s 0.1 "${shape[@]}" >"$work/shm-off.txt" 2>&1; then
  fail "--transport shm succeeded against an attnd without --allow_shared_memory"
fi
grep -q -- "--allow_shared_memory" "$work/shm-off.txt" || fail "no reason given: $(cat "$work/shm-off.txt")"
"$attnd" --listen=127.0.0.1:0 --metrics_listen= --backend=cpu --threads=2 \
  --allow_shared_memory --shm_socket="$work/regions.sock" >"$work/attnd-shm.log" 2>&1 &
pid2=$!
trap 'kill $pid2 2>/dev/null || true; cleanup' EXIT
P_SAVE=$P
attnd_ports "$work/attnd-shm.log" "$pid2" || fail "attnd with shared memory did not start"
P2=$P
attnd_healthy "$attnctl" || fail "attnd with shared memory did not become healthy"
P=$P_SAVE
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

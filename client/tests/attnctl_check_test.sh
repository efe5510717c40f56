#!/usr/bin/env bash
# attnctl attend --check against a real attnd (CPU backend, loopback): a verdict line with the
# tolerance and the largest error, exit 0 on PASS; FAIL and exit 3 when an answer is over the
# tolerance (forced here with --check_tolerance far below what bf16 can reach); FP8 Attend (all
# three e4m3, or k and v only) checked the same way.
#   attnctl_check_test.sh ATTND ATTNCTL
set -euo pipefail
attnd="$1"; attnctl="$2"
work="$(mktemp -d "${TMPDIR:-/tmp}/attnctl-check-test.XXXXXX")"
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
start_cpu_attnd "$attnd" "$work/attnd.log" 2 || fail "attnd did not start"
pid=$ATTND_PID
attnd_healthy "$attnctl" || fail "attnd did not become healthy"
attend=("$attnctl" --target "127.0.0.1:$P" attend --seq 64 --heads 4 --kv-heads 2 --head-dim 64
        --dtype bf16 --causal --count 3 --check)

rc=0
"${attend[@]}" >"$work/pass.txt" 2>&1 || rc=$?
cat "$work/pass.txt"
[ "$rc" = 0 ] || fail "attend --check exited $rc on correct answers"
grep -Eq '^check: PASS: 3 answers agree with the CPU backend: largest relative error [0-9.e+-]+ <= tolerance 1\.5e-02 \(bf16\)$' \
  "$work/pass.txt" || fail "no PASS verdict with the bf16 tolerance"

rc=0
"${attend[@]}" --check_tolerance=1e-12 >"$work/fail.txt" 2>&1 || rc=$?
cat "$work/fail.txt"
[ "$rc" = 3 ] || fail "attend --check exited $rc on an answer over the tolerance, want 3"
grep -Eq '^check: FAIL: request 0 differs from the CPU backend: relative error [0-9.e+-]+ > tolerance 1\.0e-12 \(bf16\)$' \
  "$work/fail.txt" || fail "no FAIL verdict naming the error and the tolerance"
grep -q 'check: PASS' "$work/fail.txt" && fail "PASS printed after a FAIL"

# FP8 Attend: q, k and v as E4M3 codes (o in fp16, descales per (sequence, KV head)), and FP8 k
# and v with bf16 q (one descale per tensor): checked on the values the codes stand for, with the
# output type's tolerance (this server has no FP8 tensor cores); a bad --o_dtype is refused.
for case in "--dtype fp8 --o_dtype fp16 --fp8_per_head:fp16:fp8" "--dtype bf16 --kv_dtype fp8:bf16:bf16"; do
  IFS=: read -r flags tol_type label <<<"$case"
  want_tol=$([ "$tol_type" = fp16 ] && echo '3\.0e-03' || echo '1\.5e-02')
  rc=0
  # shellcheck disable=SC2086
  "$attnctl" --target "127.0.0.1:$P" attend --seq 40 --batch 2 --heads 4 --kv-heads 2 --head-dim 64 \
    --causal --count 2 --check $flags >"$work/fp8.txt" 2>&1 || rc=$?
  cat "$work/fp8.txt"
  [ "$rc" = 0 ] || fail "attend --check $flags exited $rc"
  grep -Eq "^check: PASS: 2 answers agree with the CPU backend: largest relative error [0-9.e+-]+ <= tolerance $want_tol \($label\)\$" \
    "$work/fp8.txt" || fail "no PASS verdict for $flags"
done
rc=0
"$attnctl" --target "127.0.0.1:$P" attend --dtype fp8 --o_dtype fp32 >"$work/bad.txt" 2>&1 || rc=$?
cat "$work/bad.txt"
[ "$rc" != 0 ] || fail "--o_dtype fp32 with --dtype fp8 was accepted"
grep -q -- "--o_dtype must be bf16 or fp16" "$work/bad.txt" || fail "no message naming --o_dtype"
echo "ok: attnctl attend --check prints PASS/FAIL with the tolerance, FP8 included"

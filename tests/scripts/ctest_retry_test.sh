#!/usr/bin/env bash
# scripts/ctest_retry.sh on a throwaway ctest project: a test that fails once and then passes is
# reported FLAKY and does not fail the run; one that always fails, or one whose first output holds
# a sanitizer report, fails it; with no failures nothing is reported.
#   ctest_retry_test.sh SOURCE_DIR
set -uo pipefail
src=$1
unset ATTN_TEST_RETRIES  # the defaults are under test
work=$(mktemp -d "${TMPDIR:-/tmp}/ctest-retry-test.XXXXXX")
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*" >&2; [ -f "$work/out.txt" ] && sed 's/^/  > /' "$work/out.txt" >&2; exit 1; }

# project NAME TEST...: a project whose tests are "name:script" pairs (bash -c scripts).
project() {
  local dir="$work/$1"
  shift
  mkdir -p "$dir"
  {
    echo 'cmake_minimum_required(VERSION 3.20)'
    echo 'project(t NONE)'
    echo 'enable_testing()'
    local t
    for t in "$@"; do
      printf 'add_test(NAME %s COMMAND bash -c [=[%s]=])\n' "${t%%:*}" "${t#*:}"
    done
  } >"$dir/CMakeLists.txt"
  cmake -S "$dir" -B "$dir/b" >/dev/null || fail "cmake of $1"
}
# Fails on its first run (leaves a mark in $work), passes after.
once="if [ -f $work/mark ]; then exit 0; fi; touch $work/mark; echo first-run-output; exit 1"

project clean "ok:true" "ok2:echo fine"
"$src/scripts/ctest_retry.sh" "$work/clean/b" >"$work/out.txt" 2>&1 || fail "a passing project failed"
[ ! -s "$work/clean/b/Testing/Temporary/FailureReport.txt" ] || fail "a passing project has a report"

project flaky "ok:true" "flaky:$once"
"$src/scripts/ctest_retry.sh" "$work/flaky/b" -j 2 >"$work/out.txt" 2>&1 || fail "a flaky test failed the run"
grep -q "^ctest: flaky: FLAKY: failed, then passed on its retry$" "$work/out.txt" || fail "flaky not reported"
grep -q "^  | first-run-output$" "$work/out.txt" || fail "the flaky test's first output is missing"
grep -q "ctest: ok:" "$work/out.txt" && fail "a passing test was reported"

rm -f "$work/mark"
project broken "ok:true" "flaky:$once" "bad:echo always-bad; exit 1"
"$src/scripts/ctest_retry.sh" "$work/broken/b" >"$work/out.txt" 2>&1 && fail "a test that always fails passed the run"
grep -q "^ctest: bad: failed, and failed again on its retry$" "$work/out.txt" || fail "bad not reported"
grep -q "^ctest: flaky: FLAKY" "$work/out.txt" || fail "flaky not reported next to a real failure"

rm -f "$work/mark"
report="if [ -f $work/mark ]; then exit 0; fi; touch $work/mark; echo 'ERROR: AddressSanitizer: heap-use-after-free'; exit 66"
project sanitized "asan:$report"
"$src/scripts/ctest_retry.sh" "$work/sanitized/b" >"$work/out.txt" 2>&1 &&
  fail "a sanitizer report passed the run because the retry passed"
grep -q "^ctest: asan: failed with a sanitizer report$" "$work/out.txt" || fail "sanitizer report not named"

rm -f "$work/mark"
project noretry "flaky:$once"
ATTN_TEST_RETRIES=0 "$src/scripts/ctest_retry.sh" "$work/noretry/b" >"$work/out.txt" 2>&1 &&
  fail "ATTN_TEST_RETRIES=0 retried"
grep -q "^ctest: flaky: failed$" "$work/out.txt" || fail "ATTN_TEST_RETRIES=0: failure not reported"
echo "PASS: ctest_retry.sh retries, reports and fails as documented"

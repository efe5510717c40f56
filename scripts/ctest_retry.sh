#!/usr/bin/env bash
# ctest with one retry of the tests that failed, and a report of them.
#
#   scripts/ctest_retry.sh BUILD_DIR [CTEST_ARGS...]
#
# Runs ctest in BUILD_DIR, then the tests that failed once more, alone (ATTN_TEST_RETRIES, default
# 1; 0: none). A test that passes on its retry passes, but is reported as FLAKY with its first
# failure's output so that it gets fixed; one that fails again fails the run, and so does one whose
# first output holds a sanitizer report, whatever its retry does. The report (one line per failed
# test and the end of its first output) is printed at the end and kept in
# BUILD_DIR/Testing/Temporary/FailureReport.txt for scripts/test.sh's summary. Exits with ctest's
# status when a failure stands, else 0.
set -uo pipefail
build=$1
shift
tmp="$build/Testing/Temporary"
report="$tmp/FailureReport.txt"
mkdir -p "$tmp"
rm -f "$tmp/LastTestsFailed.log" "$tmp"/FirstRun*.log "$report"

rc=0
(cd "$build" && ctest "$@") || rc=$?
[ $rc -ne 0 ] && [ -s "$tmp/LastTestsFailed.log" ] || exit $rc
cp "$tmp/LastTestsFailed.log" "$tmp/FirstRunFailed.log"
cp "$tmp/LastTest.log" "$tmp/FirstRunTest.log"

# output NAME: the test's output in the first run's log.
output() {
  awk -v t="$1" '/^[0-9]+\/[0-9]+ Test: / { on = (substr($0, index($0, "Test: ") + 6) == t); next }
                 on && /^<end of output>$/ { on = 0 }
                 on' "$tmp/FirstRunTest.log"
}
sanitizer_report='ERROR: (Address|Leak)Sanitizer|runtime error:|WARNING: ThreadSanitizer|SUMMARY: [A-Za-z]*Sanitizer'

retries=${ATTN_TEST_RETRIES:-1}
retry_rc=1
if [ "$retries" -gt 0 ]; then
  echo "== ctest_retry.sh: running the $(wc -l <"$tmp/FirstRunFailed.log") failed test(s) again, alone"
  (cd "$build" && ctest --rerun-failed --repeat "until-pass:$retries" "$@" -j 1) && retry_rc=0
fi
# ctest keeps LastTestsFailed.log when a rerun passes: the retry's own failures, if any.
retry_failed=""
[ "$retries" -gt 0 ] && [ $retry_rc -ne 0 ] && retry_failed=$(cut -d: -f2- "$tmp/LastTestsFailed.log")

stands=0
while IFS=: read -r _ name; do
  out=$(output "$name")
  if grep -qE "$sanitizer_report" <<<"$out"; then
    verdict="failed with a sanitizer report"
    stands=1
  elif [ "$retries" -eq 0 ]; then
    verdict="failed"
    stands=1
  elif grep -qxF -- "$name" <<<"$retry_failed"; then
    verdict="failed, and failed again on its retry"
    stands=1
  else
    verdict="FLAKY: failed, then passed on its retry"
  fi
  echo "ctest: $name: $verdict"
  tail -n 40 <<<"$out" | sed 's/^/  | /'
done <"$tmp/FirstRunFailed.log" >"$report"
echo
echo "== ctest_retry.sh: the tests that failed in the first run"
cat "$report"
[ $stands -eq 0 ] && exit 0
exit $rc

#!/bin/sh
# ctest tsan_canary: the deliberate race in tsan_canary_test must come out of TSan, through
# tsan.supp and scripts/tsan_triage.py, as a report in attnd's own code. Keeps both honest.
#   tsan_canary.sh CANARY_EXE SOURCE_DIR
set -u
canary=$1
src=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
TSAN_OPTIONS="history_size=7:halt_on_error=0:exitcode=0:suppressions=$src/tests/sanitizers/tsan.supp:log_path=$dir/tsan" \
  "$canary" > "$dir/canary.out" 2>&1 || { echo "tsan_canary: the canary itself failed"; cat "$dir/canary.out"; exit 1; }
if python3 "$src/scripts/tsan_triage.py" --src "$src" "$dir" > "$dir/triage.out"; then
  echo "tsan_canary: the deliberate race was not reported"
  cat "$dir/triage.out"
  exit 1
fi
if ! grep -q "tsan_canary_test.cc" "$dir/triage.out"; then
  echo "tsan_canary: something was reported, but not the canary's race"
  cat "$dir/triage.out"
  exit 1
fi
echo "tsan_canary: the deliberate race was reported as attnd's own"

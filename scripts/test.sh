#!/usr/bin/env bash
# Installs what is missing, builds everything and runs every test (ctest). GPU tests skip with
# a message where no GPU is found. Extra arguments go to cmake's configure step. Where nvcc
# exists the CUDA kernels are always compiled (ATTN_CUDA=ON), GPU or not.
#
# Then, on the CPU parts: the sanitizer builds (scripts/sanitize.sh; ATTN_SANITIZERS, default
# "address thread", "none" skips) and a bounded fuzz run (scripts/fuzz.sh; ATTN_FUZZ_SECONDS,
# default 60, 0 skips). Every step runs even when an earlier one failed (ctest only after a
# successful build); a summary at the end gives each step's result and time, and the script exits
# non-zero when any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
build=${ATTN_BUILD_DIR:-build}
summary=()
passed=0
failed=0
skipped=0

record() {  # record <name> <PASS|FAIL|SKIP> <seconds> [note]
  summary+=("$(printf '%-22s %-4s %5s s%s' "$1" "$2" "$3" "${4:+  ($4)}")")
  case $2 in PASS) passed=$((passed + 1)) ;; FAIL) failed=$((failed + 1)) ;; *) skipped=$((skipped + 1)) ;; esac
}
step() {  # step <name> <command...>: runs it and records its result and duration
  local name=$1 start rc
  shift
  echo "== test.sh: $name"
  start=$(date +%s)
  "$@"
  rc=$?
  if [ $rc -eq 0 ]; then
    record "$name" PASS $(($(date +%s) - start))
  else
    record "$name" FAIL $(($(date +%s) - start)) "exit $rc"
  fi
  return $rc
}

# One line per skip reason of the GPU tests (they skip themselves where no GPU is usable), read
# from ctest's log of the last run: gtest prints "<file>:<line>: Skipped" and then the reason.
gpu_skip_summary() {
  local log="$build/Testing/Temporary/LastTest.log"
  [ -f "$build/Testing/Temporary/FirstRunTest.log" ] && log="$build/Testing/Temporary/FirstRunTest.log"  # before a retry
  [ -f "$log" ] || return 0
  awk '/^[0-9]+\/[0-9]+ Test: / { gpu = ($3 ~ /(^|\/)(Gpu|CudaServer|CudaDeviceLost)/) }
       gpu && /: Skipped$/ { getline reason; n[reason]++ }
       END { for (r in n) printf "test.sh: %d GPU tests skipped: %s\n", n[r], r }' "$log"
}

# What scripts/ctest_retry.sh reported of each ctest run that had failures (main, ASan, TSan), so
# that the end of a long CI log still says what failed, and what was flaky.
failure_reports() {
  local d
  for d in "$build" "${ATTN_ASAN_BUILD_DIR:-build-asan}" "${ATTN_TSAN_BUILD_DIR:-build-tsan}"; do
    [ -s "$d/Testing/Temporary/FailureReport.txt" ] || continue
    echo "test.sh: failures in $d:"
    sed 's/^/test.sh: /' "$d/Testing/Temporary/FailureReport.txt"
  done
}

ctest_ran=""
cuda=()
if [ -z "${ATTN_CUDA:-}" ] && { command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ]; }; then
  cuda=(-DATTN_CUDA=ON)
fi

if step "install-deps" scripts/install-deps.sh; then
  if step "build" scripts/build.sh "${cuda[@]}" "$@"; then
    scripts/nvcc_times.sh "$build" || true  # where the CUDA part of the build's time went
    step "ctest" scripts/ctest_retry.sh "$build" --output-on-failure -j "${ATTN_TEST_JOBS:-2}" --timeout 600
    ctest_ran=1
  else
    record "ctest" SKIP 0 "the build failed"
  fi
  sanitizers=${ATTN_SANITIZERS:-address thread}
  if [ "$sanitizers" != "none" ] && [ -n "$sanitizers" ]; then
    for s in $sanitizers; do
      step "sanitize $s" "$root/scripts/sanitize.sh" "$s"
    done
  fi
  fuzz_seconds=${ATTN_FUZZ_SECONDS:-60}
  if [ "$fuzz_seconds" != "0" ]; then
    step "fuzz ${fuzz_seconds} s" "$root/scripts/fuzz.sh" "$fuzz_seconds"
  fi
fi

echo
echo "== test.sh: summary"
printf 'test.sh: %s\n' "${summary[@]}"
[ -n "$ctest_ran" ] && gpu_skip_summary
failure_reports
skipped_note=""
[ "$skipped" -gt 0 ] && skipped_note=", $skipped skipped"
echo "test.sh: $passed passed, $failed failed$skipped_note"
[ "$failed" -eq 0 ]

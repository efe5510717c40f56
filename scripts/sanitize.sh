#!/usr/bin/env bash
# Builds the CPU parts (no CUDA, no benchmarks) with sanitizers and runs the unit and end-to-end
# tests under them (ctest, deploy checks excluded).
#
#   scripts/sanitize.sh                 # both: address (ASan+UBSan, build-asan), thread (TSan, build-tsan)
#   scripts/sanitize.sh address         # one of them
#
# Any sanitizer report fails the test that caused it (halt_on_error=1, exit code 66/67).
# Both run every unit and end-to-end test (ctest minus the deploy checks); ATTN_ASAN_TESTS /
# ATTN_TSAN_TESTS (a ctest -R regex) narrow that. Extra cmake arguments: ATTN_SANITIZE_CMAKE_ARGS.
# TSan reports go to build-tsan/tsan-reports/ and scripts/tsan_triage.py fails the run on any in
# attnd's own code; why (Debian's gRPC is not TSan-instrumented): tests/sanitizers/tsan.supp.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
kinds=("$@")
[ ${#kinds[@]} -gt 0 ] || kinds=(address thread)
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
jobs=${ATTN_JOBS:-$(nproc)}
test_jobs=${ATTN_TEST_JOBS:-2}

for kind in "${kinds[@]}"; do
  start=$(date +%s)
  case "$kind" in
    address)
      dir=${ATTN_ASAN_BUILD_DIR:-build-asan}
      san=address,undefined
      regex=${ATTN_ASAN_TESTS:-.}
      ;;
    thread)
      dir=${ATTN_TSAN_BUILD_DIR:-build-tsan}
      san=thread
      regex=${ATTN_TSAN_TESTS:-.}
      ;;
    *) echo "sanitize.sh: unknown sanitizer '$kind' (address or thread)" >&2; exit 2 ;;
  esac
  echo "== sanitize.sh: $kind ($san) in $dir"
  if [ ! -f "$dir/CMakeCache.txt" ]; then
    cmake -S . -B "$dir" "${gen[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DATTN_CUDA=OFF \
      -DATTN_BUILD_BENCH=OFF -DATTN_SANITIZE="$san" ${ATTN_SANITIZE_CMAKE_ARGS:-}
  fi
  cmake --build "$dir" -j "$jobs"
  built=$(date +%s)
  (
    export ASAN_OPTIONS="halt_on_error=1:abort_on_error=0:detect_leaks=1:detect_stack_use_after_return=0:strict_string_checks=1:exitcode=66"
    export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:exitcode=67"
    export LSAN_OPTIONS="suppressions=$root/tests/sanitizers/lsan.supp:print_suppressions=0"
    # TSan writes its reports to files; scripts/tsan_triage.py then fails the run on any report
    # in attnd's own code (reports inside Debian's uninstrumented gRPC cannot be judged).
    tsan_logs="$root/$dir/tsan-reports"
    rm -rf "$tsan_logs" && mkdir -p "$tsan_logs"
    export TSAN_OPTIONS="history_size=7:halt_on_error=0:exitcode=0:second_deadlock_stack=1:suppressions=$root/tests/sanitizers/tsan.supp:print_suppressions=0:log_path=$tsan_logs/tsan"
    # Sanitized code runs several times slower: the tests read this to scale their budgets.
    export ATTN_SANITIZER="$kind"
    cd "$dir"
    rc=0
    # A test that fails without a sanitizer report is run once more (scripts/ctest_retry.sh).
    # The Python client's suites (label python) test the client, whose server paths the C++
    # suites cover: left to the main ctest run.
    "$root/scripts/ctest_retry.sh" . --output-on-failure -j "$test_jobs" --timeout 900 -LE 'deploy|python' -R "$regex" || rc=$?
    if [ "$kind" = thread ]; then
      python3 "$root/scripts/tsan_triage.py" --src "$root" "$tsan_logs" || rc=1
    fi
    exit "$rc"
  )
  end=$(date +%s)
  echo "== sanitize.sh: $kind passed: build $((built - start)) s, tests $((end - built)) s"
done

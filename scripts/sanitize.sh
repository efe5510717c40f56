#!/usr/bin/env bash
# Builds the CPU parts (no CUDA, no benchmarks) with sanitizers and runs the unit and end-to-end
# tests under them (ctest, deploy checks excluded).
#
#   scripts/sanitize.sh                 # both: address (ASan+UBSan, build-asan), thread (TSan, build-tsan)
#   scripts/sanitize.sh address         # one of them
#
# Any sanitizer report fails the test that caused it (halt_on_error=1, exit code 66/67).
# TSan runs the tests that do not go through gRPC (kernels, batcher, fuzz path; see below);
# ATTN_TSAN_TESTS (a ctest -R regex) changes it. Extra cmake arguments: ATTN_SANITIZE_CMAKE_ARGS.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
kinds=("$@")
[ ${#kinds[@]} -gt 0 ] || kinds=(address thread)
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
jobs=${ATTN_JOBS:-$(nproc)}
test_jobs=${ATTN_TEST_JOBS:-2}

# TSan builds only what its test subset needs; ASan builds everything (every test in ctest).
tsan_targets=(cpu_attention_test batcher_test fuzz_regression_test)

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
      # Only tests whose threads do not run through gRPC: Debian's gRPC (and its Abseil) is not
      # built with -fsanitize=thread, so TSan cannot see its synchronization and reports
      # thousands of races inside gRPC's call, arena and transport code in any test that makes
      # calls (measured: >2000 reports over the server tests). The batcher (real threads, a fake
      # backend), the CPU kernel's thread pool and the fuzz code path are covered.
      regex=${ATTN_TSAN_TESTS:-^(CpuAttention|Batcher|FuzzRegression)}
      ;;
    *) echo "sanitize.sh: unknown sanitizer '$kind' (address or thread)" >&2; exit 2 ;;
  esac
  echo "== sanitize.sh: $kind ($san) in $dir"
  if [ ! -f "$dir/CMakeCache.txt" ]; then
    cmake -S . -B "$dir" "${gen[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DATTN_CUDA=OFF \
      -DATTN_BUILD_BENCH=OFF -DATTN_SANITIZE="$san" ${ATTN_SANITIZE_CMAKE_ARGS:-}
  fi
  tflags=()
  if [ "$kind" = thread ]; then
    for t in "${tsan_targets[@]}"; do tflags+=(--target "$t"); done
  fi
  cmake --build "$dir" -j "$jobs" "${tflags[@]}"
  built=$(date +%s)
  (
    export ASAN_OPTIONS="halt_on_error=1:abort_on_error=0:detect_leaks=1:detect_stack_use_after_return=0:strict_string_checks=1:exitcode=66"
    export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:exitcode=67"
    export LSAN_OPTIONS="suppressions=$root/tests/sanitizers/lsan.supp:print_suppressions=0"
    export TSAN_OPTIONS="halt_on_error=1:exitcode=66:second_deadlock_stack=1:suppressions=$root/tests/sanitizers/tsan.supp:print_suppressions=0"
    # Sanitized code runs several times slower: the tests read this to scale their budgets.
    export ATTN_SANITIZER="$kind"
    cd "$dir"
    ctest --output-on-failure -j "$test_jobs" --timeout 900 -LE deploy -R "$regex"
  )
  end=$(date +%s)
  echo "== sanitize.sh: $kind passed: build $((built - start)) s, tests $((end - built)) s"
done

#!/usr/bin/env bash
# Installs what is missing, builds everything and runs every test (ctest). GPU tests skip with
# a message where no GPU is found. Extra arguments go to cmake's configure step.
#
# Then, on the CPU parts: the sanitizer builds (scripts/sanitize.sh; ATTN_SANITIZERS, default
# "address thread", "none" skips) and a bounded fuzz run (scripts/fuzz.sh; ATTN_FUZZ_SECONDS,
# default 60, 0 skips). Each step's duration is printed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
timings=()
step() {  # step <name> <command...>: runs it and records how long it took
  local name=$1 start
  shift
  start=$(date +%s)
  "$@"
  timings+=("$name: $(($(date +%s) - start)) s")
}
scripts/install-deps.sh
step "build" scripts/build.sh "$@"
step "ctest" bash -c "cd '${ATTN_BUILD_DIR:-build}' && ctest --output-on-failure -j '${ATTN_TEST_JOBS:-2}' --timeout 600"
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
printf 'test.sh: %s\n' "${timings[@]}"

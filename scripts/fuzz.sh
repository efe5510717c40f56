#!/usr/bin/env bash
# Builds the libFuzzer targets (clang++, -fsanitize=fuzzer,address,undefined) in
# ${ATTN_FUZZ_BUILD_DIR:-build-fuzz} and runs each for its share of N seconds (default 60), on its
# checked-in seeds (tests/fuzz/corpus/<target>/) plus a working corpus in the build dir:
#   attend   AttendRequest bytes: wire reader, validation, region resolution, CPU kernel
#   session  programs of session requests: session manager, step validation, CPU backend
#   region   Attends and steps whose tensors the input places in shared-memory regions
#   import   ImportSession streams: header and page checks, page accounting, the bytes kept
# and prints, per target and process, the executions, executions per second (wall clock) and
# executions per CPU second (the speed on one core, also on a busy machine).
#
#   scripts/fuzz.sh            # 60 s: 15 s per target (what CI runs)
#   scripts/fuzz.sh 3600       # 15 minutes per target; see docs/RELIABILITY.md (Fuzzing)
#   ATTN_FUZZ_JOBS=2 scripts/fuzz.sh 3600     # two processes per target, side by side
#   ATTN_FUZZ_TARGETS="region" scripts/fuzz.sh 600   # one target, all 600 s
#   ATTN_FUZZ_NICE=19          # run the fuzzers under nice -n 19 (a shared machine)
#
# A crash, leak, timeout or broken invariant leaves <target>-crash-* (timeout-*, oom-*, leak-*)
# files in the build dir's fuzz/artifacts/; the script then fails. Once fixed, copy the file to
# tests/fuzz/regressions/<target>/: fuzz_regression_test replays it in the normal build.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
seconds=${1:-60}
dir=${ATTN_FUZZ_BUILD_DIR:-build-fuzz}
read -r -a targets <<<"${ATTN_FUZZ_TARGETS:-attend session region import}"
jobs=${ATTN_FUZZ_JOBS:-1}
clang=${CLANG_CXX:-$(command -v clang++ || command -v clang++-14 || true)}
if [ -z "$clang" ]; then
  echo "fuzz.sh: clang++ not found (apt-get install clang)" >&2
  exit 1
fi
clang_c=${clang/clang++/clang}
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
if [ ! -f "$dir/CMakeCache.txt" ]; then
  cmake -S . -B "$dir" "${gen[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_COMPILER="$clang" -DCMAKE_C_COMPILER="$clang_c" \
    -DCMAKE_CXX_FLAGS="-fsanitize=fuzzer-no-link" \
    -DATTN_CUDA=OFF -DATTN_BUILD_BENCH=OFF -DATTN_SANITIZE=address,undefined \
    -DATTN_BUILD_FUZZERS=ON
fi
build_targets=(--target make_fuzz_seeds)
for t in "${targets[@]}"; do build_targets+=(--target "${t}_fuzzer"); done
cmake --build "$dir" -j "${ATTN_JOBS:-$(nproc)}" "${build_targets[@]}"
mkdir -p "$dir/fuzz/corpus" "$dir/fuzz/artifacts" "$dir/fuzz/logs"
rm -f "$dir"/fuzz/artifacts/* "$dir"/fuzz/logs/*
"$dir/tests/fuzz/make_fuzz_seeds" "$dir/fuzz/corpus"
export ASAN_OPTIONS="halt_on_error=1:detect_leaks=1:allocator_may_return_null=1"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
share=$((seconds / ${#targets[@]}))
[ "$share" -lt 1 ] && share=1
nice_cmd=()
[ -n "${ATTN_FUZZ_NICE:-}" ] && nice_cmd=(nice -n "$ATTN_FUZZ_NICE")

# fuzz_stat <log> <name>: the value of libFuzzer's final "stat::<name>:" line, or "-".
fuzz_stat() { sed -n "s/^stat::$2: *//p" "$1" | tail -1 | grep . || echo -; }

failed=0
summary=()
for t in "${targets[@]}"; do
  echo "== fuzz.sh: ${t}_fuzzer for $share s ($jobs process(es))"
  mkdir -p "$dir/fuzz/corpus/$t"
  pids=()
  for ((j = 1; j <= jobs; ++j)); do
    # Processes of one target share its working corpus (each reloads what the others add). The
    # CPU time each takes (bash's time) gives its executions per CPU second: its speed on one
    # core, whatever else the machine runs.
    (
      TIMEFORMAT='cpu_seconds: %U %S'
      time "${nice_cmd[@]}" "$dir/tests/fuzz/${t}_fuzzer" "$dir/fuzz/corpus/$t" \
        "$root/tests/fuzz/corpus/$t" -max_total_time="$share" -max_len=8192 -timeout=10 \
        -rss_limit_mb=2048 -artifact_prefix="$dir/fuzz/artifacts/$t-" -print_final_stats=1 \
        >"$dir/fuzz/logs/$t-$j.log" 2>&1
    ) 2>"$dir/fuzz/logs/$t-$j.cpu" &
    pids+=($!)
  done
  for ((j = 1; j <= jobs; ++j)); do
    rc=0
    wait "${pids[$((j - 1))]}" || rc=$?
    log="$dir/fuzz/logs/$t-$j.log"
    grep -Ev '^#[0-9]+\s+(NEW|REDUCE|pulse|RELOAD)' "$log" | grep -Ev '^stat::' | tail -5
    runs=$(fuzz_stat "$log" number_of_executed_units)
    rate=$(fuzz_stat "$log" average_exec_per_sec)
    cpu_rate=$(awk -v runs="$runs" '/^cpu_seconds:/ && runs + 0 > 0 && $2 + $3 > 0 {
      printf "%.0f", runs / ($2 + $3) }' "$dir/fuzz/logs/$t-$j.cpu")
    result=ok
    if [ "$rc" -ne 0 ]; then
      # The finding itself, which the tail above may have cut: the broken invariant or the
      # sanitizer's report with its stack.
      grep -E -A 24 'invariant violated|^==[0-9]+==ERROR|runtime error:' "$log" | head -40 >&2
      result="FAILED (exit $rc)"
      failed=1
    fi
    summary+=("$(printf '%-8s %4d %6d s %12s %10s %12s  %s' "$t" "$j" "$share" "$runs" "$rate" \
      "${cpu_rate:--}" "$result")")
  done
done
if compgen -G "$dir/fuzz/artifacts/*" >/dev/null; then failed=1; fi

echo "== fuzz.sh: $seconds s over ${#targets[@]} target(s), $jobs process(es) each"
printf '%-8s %4s %8s %12s %10s %12s  %s\n' target proc time executions exec/s exec/cpu-s result
printf '%s\n' "${summary[@]}"
if [ "$failed" -ne 0 ]; then
  echo "fuzz.sh: a fuzz target failed; logs in $dir/fuzz/logs/, inputs in $dir/fuzz/artifacts/:" >&2
  ls -l "$dir/fuzz/artifacts/" >&2
  exit 1
fi
echo "== fuzz.sh: no finding"

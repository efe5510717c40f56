#!/usr/bin/env bash
# Builds the libFuzzer target attend_fuzzer (clang++, -fsanitize=fuzzer,address,undefined) in
# ${ATTN_FUZZ_BUILD_DIR:-build-fuzz} and runs it for N seconds (default 60) on the checked-in
# seeds (tests/fuzz/corpus/) plus a working corpus in the build dir.
#
#   scripts/fuzz.sh            # 60 s
#   scripts/fuzz.sh 3600       # an hour; see README (Reliability)
#   ATTN_FUZZ_JOBS=2 scripts/fuzz.sh 3600   # two fuzzing processes
#
# A crash or broken invariant leaves crash-*/timeout-*/oom-* files in the build dir's
# artifacts/; the script then fails. Copy the file to tests/fuzz/regressions/ once it is fixed:
# fuzz_regression_test replays it in the normal build.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
seconds=${1:-60}
dir=${ATTN_FUZZ_BUILD_DIR:-build-fuzz}
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
cmake --build "$dir" -j "${ATTN_JOBS:-$(nproc)}" --target attend_fuzzer make_attend_seeds
mkdir -p "$dir/fuzz/corpus" "$dir/fuzz/artifacts"
rm -f "$dir"/fuzz/artifacts/*
"$dir/tests/fuzz/make_attend_seeds" "$dir/fuzz/corpus"
export ASAN_OPTIONS="halt_on_error=1:detect_leaks=1:allocator_may_return_null=1"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
jobs=${ATTN_FUZZ_JOBS:-1}
extra=()
[ "$jobs" -gt 1 ] && extra=(-jobs="$jobs" -workers="$jobs")
echo "== fuzz.sh: attend_fuzzer for $seconds s ($jobs process(es))"
set +e
"$dir/tests/fuzz/attend_fuzzer" "$dir/fuzz/corpus" "$root/tests/fuzz/corpus" \
  -max_total_time="$seconds" -max_len=8192 -timeout=10 -rss_limit_mb=2048 \
  -artifact_prefix="$dir/fuzz/artifacts/" -print_final_stats=1 "${extra[@]}" \
  2>&1 | tee "$dir/fuzz/last-run.log" | grep -Ev '^#[0-9]+\s+(NEW|REDUCE|pulse)' 
rc=${PIPESTATUS[0]}
set -e
if [ "$rc" -ne 0 ] || compgen -G "$dir/fuzz/artifacts/*" >/dev/null; then
  echo "fuzz.sh: attend_fuzzer failed (exit $rc); inputs in $dir/fuzz/artifacts/:" >&2
  ls -l "$dir/fuzz/artifacts/" >&2
  exit 1
fi
echo "== fuzz.sh: no crash in $seconds s"

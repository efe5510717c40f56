#!/usr/bin/env bash
# Configures and builds attnd into ${ATTN_BUILD_DIR:-build}. Extra arguments go to cmake's
# configure step (e.g. -DATTN_CUDA_ARCHS=90a -DATTN_HEAD_DIMS="64;128"); ATTN_TARGETS limits
# what is built (default: everything).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${ATTN_BUILD_DIR:-build}
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S . -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release "$@"
elif [ $# -gt 0 ]; then
  cmake -S . -B "$build" "$@"
fi
targets=()
for t in ${ATTN_TARGETS:-}; do targets+=(--target "$t"); done
cmake --build "$build" -j "${ATTN_JOBS:-$(nproc)}" "${targets[@]}"

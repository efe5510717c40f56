#!/usr/bin/env bash
# Configures and builds attnd into ${ATTN_BUILD_DIR:-build}. Extra arguments go to cmake's
# configure step (e.g. -DATTN_CUDA_ARCHS=90a -DATTN_HEAD_DIMS="64;128"); ATTN_TARGETS limits
# what is built (default: everything).
#
# CUDA kernels: on a first configure where no GPU is visible (no nvidia-smi, or it lists none),
# they are not built even when nvcc exists, which keeps a first build on a laptop fast.
# ATTN_CUDA=ON (or -DATTN_CUDA=ON) builds them anyway, ATTN_CUDA=OFF never; an existing build
# directory keeps what it was configured with.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${ATTN_BUILD_DIR:-build}
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)

gpu_visible() { nvidia-smi -L 2>/dev/null | grep -q '^GPU '; }
asks_cuda() {  # true when the arguments set ATTN_CUDA themselves
  local a
  for a in "$@"; do case $a in -DATTN_CUDA=* | -DATTN_CUDA:*=*) return 0 ;; esac; done
  return 1
}

cuda=()
if [ -n "${ATTN_CUDA:-}" ]; then
  cuda=(-DATTN_CUDA="$ATTN_CUDA")
elif [ ! -f "$build/CMakeCache.txt" ] && ! asks_cuda "$@" && ! gpu_visible; then
  echo "build.sh: no GPU visible: building without the CUDA kernels (ATTN_CUDA=ON builds them)"
  cuda=(-DATTN_CUDA=OFF)
fi
if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S . -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release "${cuda[@]}" "$@"
elif [ $# -gt 0 ] || [ ${#cuda[@]} -gt 0 ]; then
  cmake -S . -B "$build" "${cuda[@]}" "$@"
fi
targets=()
for t in ${ATTN_TARGETS:-}; do targets+=(--target "$t"); done
cmake --build "$build" -j "${ATTN_JOBS:-$(nproc)}" "${targets[@]}"

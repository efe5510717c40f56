#!/usr/bin/env bash
# Wall seconds of the CUDA compiles of a build, per kernel family, from ninja's log (the last
# build of each object): where a cold CI build's time goes. Parallel compiles overlap, so the sum
# exceeds the build's wall time at -j2 and more.
#   scripts/nvcc_times.sh [BUILD_DIR]   (default: build)
set -euo pipefail
log=${1:-build}/.ninja_log
[ -f "$log" ] || { echo "nvcc_times.sh: no $log (a Ninja build is needed)"; exit 0; }
# The log appends each build's entries: the last one of each object counts.
awk -F'\t' '
  $4 ~ /\.cu\.o$/ { secs[$4] = ($2 - $1) / 1000.0 }
  END {
    for (o in secs) {
      f = "other CUDA"
      if (o ~ /flash_fwd_sm90_paged_hdim/) f = "gen2 paged (sm_90a)"
      else if (o ~ /flash_fwd_sm90_hdim/) f = "gen2 (sm_90a)"
      else if (o ~ /flash_fwd_paged_hdim/) f = "gen1 paged"
      else if (o ~ /flash_fwd_hdim/) f = "gen1"
      else if (o ~ /decode_fp8_hdim/) f = "decode fp8 kv"
      else if (o ~ /decode_hdim/) f = "decode"
      else if (o ~ /cuda_attention\.cu/) f = "dispatch"
      else if (o ~ /sm90_variants/) f = "sm90_variants (bench)"
      t[f] += secs[o]; n[f]++; total += secs[o]; objects++
    }
    for (f in t) printf "nvcc_times.sh: %-22s %3d objects %7.1f s\n", f, n[f], t[f]
    printf "nvcc_times.sh: %-22s %3d objects %7.1f s\n", "(all CUDA)", objects, total
  }' "$log"

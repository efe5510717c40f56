#!/usr/bin/env bash
# Nsight Compute on the shipped FP8 forward kernel (one launch each at d=128 and d=256, s=8k,
# B*S = 16k, as fp8_variants runs it): the full section set, the details page and the per-SASS
# source page, summarised by ncu_source_summary.py. Run on the GPU host from the repository root:
#   . VARIANTS_BUNDLE/env.sh && kernels/bench/ncu/ncu_fp8_forward.sh VARIANTS_BUNDLE OUT_DIR [NCU]
# VARIANTS_BUNDLE: a gpu-bundle of fp8_variants (-DATTN_SM90_VARIANTS=ON). ncu locks the SM clock
# at base for its passes: read shares and stall reasons from it, not times. VARIANT=NAME with
# KERNEL=REGEX (a part of its traits' name, e.g. MaskFlipped) profiles an fp8_variants variant
# instead of the shipped kernel (at d=128, variant mufu's traits are the shipped ones).
set -uo pipefail
bundle=$1
out=$2
ncu=${3:-/usr/local/cuda/bin/ncu}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
for d in 128 256; do
  timeout 150 "$ncu" --kernel-name-base demangled -k "regex:${KERNEL:-FlashFwdSm90Fp8Kernel}" -s 2 -c 1 --set full --import-source yes -f \
    -o "$out/fp8d$d" "$bundle/bin/fp8_variants" --d "$d" --s 8192 --reps 1 --variant "${VARIANT:-mufu}" \
    >"$out/run$d.txt" 2>&1
  "$ncu" -i "$out/fp8d$d.ncu-rep" --page details --print-details all >"$out/details$d.txt" 2>&1
  "$ncu" -i "$out/fp8d$d.ncu-rep" --page source --csv --print-source sass >"$out/source$d.csv" 2>&1
  python3 "$here/ncu_source_summary.py" "$out/source$d.csv" --top 30 >"$out/summary$d.md"
done

#!/usr/bin/env bash
# The generation-2 (sm_90a) kernel's measurements of one run on a Hopper GPU host:
#  1. sm90_timeline on the shapes where the kernel is furthest from cuDNN (per-phase cycles of the
#     consumer warpgroups, and the share of time with no product waiting);
#  2. the standard sweep (bench_vs_torch.py: bf16 and fp16, B*S = 16k, H*D = 2048, s = 512..16k,
#     d = 64/128/256, causal off and on; generation 1, generation 2, torch flash and cuDNN);
#  3. the variants of timeline_kernels.h against production (sm90_timeline --variant);
#  4. the generation-2 GPU tests;
#  softmax_variants and accuracy (not in the default list): the split key loop and the polynomial
#  exponentials against production; each kernel's error against float64 attention.
# BIN holds sm90_timeline (-DATTN_SM90_TIMELINE=ON), gpu_attention_test, libattn_kernels_capi.so
# bench_vs_torch.py and accuracy_vs_fp64.py; the results go to OUT_DIR (timeline.md, sweep.md,
# variants.md, softmax_variants.md, accuracy.md, tests.txt).
#   kernels/bench/gen2_h200.sh BIN OUT_DIR [timeline|sweep|variants|softmax_variants|accuracy|tests ...]
set -uo pipefail
bin=$(cd "$1" && pwd)
out=$2
shift 2
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(timeline variants sweep tests)
mkdir -p "$out"
rc=0

timeline() {
  # d, s, flags: where v7.1 measured lowest against cuDNN (docs/PERF.md), and a long d=128 for
  # reference.
  local shapes=("128 16384" "128 16384 --narrow" "128 1024" "64 4096 --causal" "64 16384"
                "256 16384" "256 1024 --causal")
  local s
  for s in "${shapes[@]}"; do
    echo "== sm90_timeline --d ${s/ / --s }"
    # shellcheck disable=SC2086
    timeout 60 "$bin/sm90_timeline" --d ${s/ / --s } || rc=1
    echo
  done >"$out/timeline.md" 2>&1
}

sweep() {
  (cd "$bin" && python3 bench_vs_torch.py \
      --lib gen1=./libattn_kernels_capi.so@1,gen2=./libattn_kernels_capi.so@2 \
      --dims 64,128,256 --seqlens 512,1024,2048,4096,8192,16384 --dtypes bf16,fp16 \
      --causal 0,1 --reps 5 --min-ms 10 --out "$out/sweep.md") >"$out/sweep.log" 2>&1 || rc=1
}

variants() {
  local runs=("rescale_on_change 64 16384" "rescale_on_change 64 4096 --causal"
              "rescale_on_change 128 16384" "rescale_on_change 256 16384"
              "keys176 128 16384" "keys176 128 4096" "keys176 128 1024" "keys176 128 4096 --causal"
              "keys80 256 16384" "keys80 256 4096" "keys80 256 1024 --causal"
              "overlap 128 16384 --narrow" "overlap 128 16384" "overlap 64 16384 --narrow"
              "overlap 128 4096 --causal --narrow" "overlap 256 16384" "overlap 256 1024 --causal"
              "cluster_kv 256 16384" "cluster_kv 256 4096" "cluster_kv 256 1024"
              "cluster_kv 128 12288" "cluster_kv 128 16384 --narrow" "cluster_kv 128 3072"
              "cluster_kv 64 12288" "cluster_kv 64 16384 --narrow")
  local r v d rest
  for r in "${runs[@]}"; do
    read -r v d rest <<<"$r"
    echo "== sm90_timeline --variant $v --d $d --s $rest"
    # shellcheck disable=SC2086
    # A variant that hangs (none has run on a GPU yet) costs a minute, not the whole call.
    timeout 60 "$bin/sm90_timeline" --variant "$v" --d "$d" --s $rest || rc=1
    echo
  done >"$out/variants.md" 2>&1
}

# The split key loop (unmasked tiles without the mask) and the exponentials partly by polynomial,
# each against production.
softmax_variants() {
  local shapes=("64 16384" "64 4096 --causal" "64 1024" "128 16384" "128 16384 --narrow" "128 4096"
                "128 1024" "128 4096 --causal" "256 16384" "256 4096" "256 1024 --causal")
  local v s
  for s in "${shapes[@]}"; do
    for v in split_mask exp2_poly4 exp2_poly8; do
      echo "== sm90_timeline --variant $v --d ${s/ / --s }"
      # shellcheck disable=SC2086
      timeout 60 "$bin/sm90_timeline" --variant "$v" --d ${s/ / --s } || rc=1
      echo
    done
  done >"$out/softmax_variants.md" 2>&1
}

# Each kernel's error against float64 attention (accuracy_vs_fp64.py).
accuracy() {
  (cd "$bin" && python3 accuracy_vs_fp64.py \
      --lib gen1=./libattn_kernels_capi.so@1,gen2=./libattn_kernels_capi.so@2 \
      --out "$out/accuracy.md") >"$out/accuracy.log" 2>&1 || rc=1
}

tests() {
  "$bin/gpu_attention_test" --gtest_filter='Gen2/*' >"$out/tests.txt" 2>&1 || rc=1
  tail -n 3 "$out/tests.txt"
}

for p in "${parts[@]}"; do
  start=$(date +%s)
  case $p in
    timeline | sweep | variants | softmax_variants | accuracy | tests) "$p" ;;
    *) echo "gen2_h200.sh: unknown part '$p' (timeline sweep variants softmax_variants accuracy tests)" >&2
       exit 2 ;;
  esac
  echo "gen2_h200.sh: $p: $(($(date +%s) - start)) s"
done
exit $rc

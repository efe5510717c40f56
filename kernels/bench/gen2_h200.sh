#!/usr/bin/env bash
# The generation-2 (sm_90a) kernel's measurements of one run on a Hopper GPU host:
#  1. sm90_timeline on the shapes where the kernel is furthest from cuDNN (per-phase cycles of the
#     consumer warpgroups, and the share of time with no product waiting);
#  2. the standard sweep (bench_vs_torch.py: bf16 and fp16, B*S = 16k, H*D = 2048, s = 512..16k,
#     d = 64/128/256, causal off and on; generation 1, generation 2, torch flash and cuDNN);
#  3. the variants of timeline_kernels.h against production (sm90_timeline --variant);
#  4. the generation-2 GPU tests;
#  not in the default list: accuracy (each kernel's error against float64 attention), clocks
#  (rate, SM clock and power under sustained load), sass (cuobjdump), traffic (DRAM bytes per
#  launch, Nsight Compute), ncu_sections (Nsight Compute), tests_tilings (the tests with each tiling forced), sanitize (memcheck and
#  racecheck) and sweep_soaked (the sweep with each kernel timed at its own sustained clock).
# BIN holds sm90_timeline (-DATTN_SM90_TIMELINE=ON), gpu_attention_test, libattn_kernels_capi.so
# and the Python tools of kernels/bench; the results go to OUT_DIR, one file per part.
#   kernels/bench/gen2_h200.sh BIN OUT_DIR [PART ...]   (PART: one of the names in the case below)
set -uo pipefail
bin=$(cd "$1" && pwd)
out=$2
shift 2
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(timeline variants sweep tests)
mkdir -p "$out"
rc=0
# bench_vs_torch.py --lib; GEN2_LIBS overrides it (e.g. to add an earlier build's library).
gens=${GEN2_LIBS:-gen1=./libattn_kernels_capi.so@1,gen2=./libattn_kernels_capi.so@2}

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

# The standard sweep: interleaved timings (every kernel at the same clocks: work per clock), and
# soaked ones (each kernel first run alone for 0.5 s: the clock its own power draw allows).
sweep() {
  standard_sweep sweep
}
sweep_soaked() {
  standard_sweep sweep_soaked --soak-ms 500
}
standard_sweep() {
  local name=$1
  shift
  (cd "$bin" && python3 bench_vs_torch.py --lib "$gens" \
      --dims 64,128,256 --seqlens 512,1024,2048,4096,8192,16384 --dtypes bf16,fp16 \
      --causal 0,1 --reps 5 --min-ms 10 "$@" --out "$out/$name.md") >"$out/$name.log" 2>&1 || rc=1
}

variants() {
  # d=256's wide tiling runs the overlapped key loop, which ignores rescale_on_change and
  # split_mask (and cluster_kv was measured on the plain loop): at d=256 those run narrow.
  local runs=("rescale_on_change 64 16384" "rescale_on_change 64 4096 --causal"
              "rescale_on_change 128 16384" "rescale_on_change 256 16384 --narrow"
              "keys176 128 16384" "keys176 128 4096" "keys176 128 1024" "keys176 128 4096 --causal"
              "keys80 256 16384 --narrow" "keys80 256 4096 --narrow" "keys80 256 2048 --narrow"
              "keys80 256 1024 --causal --narrow" "keys80 256 4096 --causal --narrow"
              "keys80 256 16384 --causal --narrow"
              "overlap 128 16384 --narrow --production wide" "overlap 256 16384 --production narrow"
              "overlap 256 1024 --causal --production narrow"
              "cluster_kv 256 16384 --narrow" "cluster_kv 128 12288"
              "split_mask 128 16384" "split_mask 128 4096 --causal"
              "split_mask 256 4096 --causal --narrow"
              "trim_edges 64 16384" "trim_edges 128 2048 --causal"
              "trim_edges 64 1024 --causal --narrow"
              "fma_exp2_2 64 16384" "fma_exp2_2 64 4096 --causal")
  # GEN2_VARIANTS="v d s [flags];v d s [flags];...": these runs instead.
  [ -z "${GEN2_VARIANTS:-}" ] || IFS=';' read -ra runs <<<"$GEN2_VARIANTS"
  local r v d rest
  for r in "${runs[@]}"; do
    read -r v d rest <<<"$r"
    echo "== sm90_timeline --variant $v --d $d --s $rest"
    # shellcheck disable=SC2086
    # A variant that hangs costs a minute, not the whole call.
    timeout 60 "$bin/sm90_timeline" --variant "$v" --d "$d" --s $rest || rc=1
    echo
  done >"$out/variants.md" 2>&1
}

# Each kernel's error against float64 attention (accuracy_vs_fp64.py).
accuracy() {
  (cd "$bin" && python3 accuracy_vs_fp64.py --lib "$gens" --out "$out/accuracy.md") \
      >"$out/accuracy.log" 2>&1 || rc=1
}

# Rate, SM clock and power of gen2, cuDNN and flash under sustained load (clocks_under_load.py).
clocks() {
  (cd "$bin" && python3 clocks_under_load.py --lib gen2=./libattn_kernels_capi.so@2 \
      --out "$out/clocks.md") >"$out/clocks.log" 2>&1 || rc=1
}

# SASS of the library's and sm90_timeline's kernels (xz), for reading off the GPU host.
sass() {
  cuobjdump -sass "$bin/libattn_kernels_capi.so" | xz -T4 >"$out/capi.sass.xz" || rc=1
  cuobjdump -sass "$bin/sm90_timeline" | xz -T4 >"$out/timeline.sass.xz" || rc=1
}

# DRAM bytes per launch of gen2 and cuDNN (memory_traffic.py under Nsight Compute), short causal
# and non-causal shapes, where the tile order decides how often K/V comes from memory.
traffic() {
  (cd "$bin" && timeout 300 ncu --clock-control none \
      --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct,gpu__time_duration.sum \
      -k 'regex:FlashFwdSm90|cudnn' --csv --page raw python3 memory_traffic.py \
      --lib gen2=./libattn_kernels_capi.so@2 \
      --shapes 64:1024:1,128:1024:1,128:2048:1,256:1024:1,64:1024:0,128:1024:0) \
      >"$out/traffic.csv" 2>"$out/traffic.log" || rc=1
}

# Nsight Compute's main sections for the production kernel (the third launch: after two warm-ups).
ncu_sections() {
  local s
  for s in "128 16384" "64 16384" "256 16384"; do
    # shellcheck disable=SC2086
    timeout 120 ncu --kernel-name-base mangled -k 'regex:KernelINS1_1[46]Sm90(Wide|Narrow)Traits' \
      --launch-skip 2 --launch-count 1 --section SpeedOfLight --section ComputeWorkloadAnalysis \
      --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
      --section InstructionStats "$bin/sm90_timeline" --d ${s/ / --s } --reps 3 || rc=1
  done >"$out/ncu.txt" 2>&1
}

# gtest's count lines (ran, passed, skipped, failed) of the output on stdin.
gtest_counts() {
  grep -E '^\[ +(PASSED|FAILED|SKIPPED) +\] [0-9]+ test|^\[=+\] [0-9]+ tests? '
}

tests() {
  "$bin/gpu_attention_test" --gtest_filter='Gen2/*' >"$out/tests.txt" 2>&1 || rc=1
  gtest_counts <"$out/tests.txt"
}

# The generation-2 tests with each tiling forced (ATTN_SM90_TILING: 1 wide, 2 narrow).
tests_tilings() {
  local t
  for t in 1 2; do
    echo "== ATTN_SM90_TILING=$t"
    ATTN_SM90_TILING=$t "$bin/gpu_attention_test" --gtest_filter='Gen2/*' 2>&1 | gtest_counts || rc=1
  done >"$out/tests_tilings.txt" 2>&1
  grep -q FAILED "$out/tests_tilings.txt" && rc=1
  cat "$out/tests_tilings.txt"
}

# compute-sanitizer's memcheck and racecheck on the small generation-2 problems.
sanitize() {
  local tool
  for tool in memcheck racecheck; do
    echo "== compute-sanitizer --tool $tool"
    timeout 300 compute-sanitizer --tool "$tool" --error-exitcode 3 "$bin/gpu_attention_test" \
      --gtest_filter='Gen2/GpuSmoke*' 2>&1 | tail -n 6 || rc=1
  done >"$out/sanitize.txt" 2>&1
  cat "$out/sanitize.txt"
}

for p in "${parts[@]}"; do
  start=$(date +%s)
  case $p in
    timeline | sweep | sweep_soaked | variants | accuracy | clocks | sass | traffic | ncu_sections | \
      tests | tests_tilings | sanitize) "$p" ;;
    *) echo "gen2_h200.sh: unknown part '$p' (timeline sweep variants accuracy clocks" \
            "sass traffic ncu_sections tests tests_tilings sanitize sweep_soaked)" >&2
       exit 2 ;;
  esac
  echo "gen2_h200.sh: $p: $(($(date +%s) - start)) s"
done
exit $rc

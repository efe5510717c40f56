#!/usr/bin/env bash
# The generation-2 (sm_90a) kernel's measurements of one run on a Hopper GPU host:
#  1. the standard sweep (bench_vs_torch.py: bf16 and fp16, B*S = 16k, H*D = 2048, s = 512..16k,
#     d = 64/128/256, causal off and on; generation 1, generation 2, torch flash and cuDNN);
#  2. the variants of variant_kernels.h against production (sm90_variants --variant);
#  3. the generation-2 GPU tests;
#  not in the default list: accuracy (each kernel's error against float64 attention), clocks
#  (rate, SM clock and power under sustained load), sass (cuobjdump), traffic (DRAM bytes per
#  launch, Nsight Compute), ncu_sections (Nsight Compute), tests_tilings (the tests with each tiling forced), sanitize (memcheck and
#  racecheck), sweep_soaked (the sweep with each kernel timed at its own sustained clock) and
#  paged (paged_fp8_h200.sh: generation 2 over paged K/V, decode splits and FP8 K/V decode:
#  smoke cases, gpu_decode_test in 8 shards, bench_decode.py, memcheck and racecheck, each bounded).
# BIN holds sm90_variants (-DATTN_SM90_VARIANTS=ON), gpu_attention_test, gpu_decode_test (and for
# 'paged' gpu_decode_test_trap, a -DATTN_SM90_HANG_TRAP=ON build of it), libattn_kernels_capi.so,
# paged_fp8_h200.sh and the Python tools of kernels/bench; the results go to OUT_DIR, one file per
# part.
#   kernels/bench/gen2_h200.sh BIN OUT_DIR [PART ...]   (PART: one of the names in the case below)
set -uo pipefail
bin=$(cd "$1" && pwd)
out=$2
shift 2
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(variants sweep tests)
mkdir -p "$out"
rc=0
# bench_vs_torch.py --lib; GEN2_LIBS overrides it (e.g. to add an earlier build's library).
gens=${GEN2_LIBS:-gen1=./libattn_kernels_capi.so@1,gen2=./libattn_kernels_capi.so@2}

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
  local runs=("keys176 128 16384" "keys176 128 4096" "keys176 128 1024" "keys176 128 4096 --causal"
              "keys80 256 16384 --narrow" "keys80 256 4096 --narrow" "keys80 256 2048 --narrow"
              "keys80 256 1024 --causal --narrow" "keys80 256 4096 --causal --narrow"
              "keys80 256 16384 --causal --narrow"
              "overlap 128 16384 --narrow --production wide" "overlap 256 16384 --production narrow"
              "overlap 256 1024 --causal --production narrow"
              "split_mask 128 16384" "split_mask 128 4096 --causal"
              "split_mask 256 4096 --causal --narrow"
              "trim_edges 64 16384" "trim_edges 128 2048 --causal"
              "trim_edges 64 1024 --causal --narrow")
  # GEN2_VARIANTS="v d s [flags];v d s [flags];...": these runs instead.
  [ -z "${GEN2_VARIANTS:-}" ] || IFS=';' read -ra runs <<<"$GEN2_VARIANTS"
  local r v d rest
  for r in "${runs[@]}"; do
    read -r v d rest <<<"$r"
    echo "== sm90_variants --variant $v --d $d --s $rest"
    # shellcheck disable=SC2086
    # A variant that hangs costs a minute, not the whole call.
    timeout 60 "$bin/sm90_variants" --variant "$v" --d "$d" --s $rest || rc=1
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

# SASS of the library's and sm90_variants' kernels (xz), for reading off the GPU host.
sass() {
  cuobjdump -sass "$bin/libattn_kernels_capi.so" | xz -T4 >"$out/capi.sass.xz" || rc=1
  cuobjdump -sass "$bin/sm90_variants" | xz -T4 >"$out/variants.sass.xz" || rc=1
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
      --section InstructionStats "$bin/sm90_variants" --d ${s/ / --s } --reps 3 || rc=1
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

# The generation-2 tests with each tiling forced (ATTN_TEST_GEN2_TILING: 1 wide, 2 narrow).
tests_tilings() {
  local t
  for t in 1 2; do
    echo "== ATTN_TEST_GEN2_TILING=$t"
    ATTN_TEST_GEN2_TILING=$t "$bin/gpu_attention_test" --gtest_filter='Gen2/*' 2>&1 | gtest_counts || rc=1
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

# Paged generation 2, the decode splits and FP8 K/V decode: paged_fp8_h200.sh (bounded: a smoke
# case per head dim first, each step under a timeout, nothing that forces generation 2 on paged
# K/V after a hang), its logs and tables in OUT_DIR/paged.
paged() {
  bash "$bin/paged_fp8_h200.sh" "$bin" "$out/paged" "${GEN2_PAGED_BUDGET_S:-540}" || rc=1
}

for p in "${parts[@]}"; do
  start=$(date +%s)
  case $p in
    sweep | sweep_soaked | variants | accuracy | clocks | sass | traffic | ncu_sections | \
      tests | tests_tilings | sanitize | paged) "$p" ;;
    *) echo "gen2_h200.sh: unknown part '$p' (sweep variants accuracy clocks" \
            "sass traffic ncu_sections tests tests_tilings sanitize sweep_soaked paged)" >&2
       exit 2 ;;
  esac
  echo "gen2_h200.sh: $p: $(($(date +%s) - start)) s"
done
exit $rc

#!/usr/bin/env bash
# A GPU host's checks of the merged tree, in parts that each fit one bounded device call:
#   kernels  kernels/bench/bench_decode.py: decode at every small batch with a sweep of forced KV
#            splits beside the plan's choice (the split rule), the memory-bound points, torch
#            flash and cuDNN beside
#   forward  kernels/bench/bench_vs_torch.py: d=256 over s = 512..16k, and d=64/128 at s=512,
#            against torch SDPA cuDNN and flash
#   suites   cuda_session_test, cuda_region_test, cuda_server_test (each against this bundle's
#            attnd)
#   python   client/python/gpu_check.sh tests (every pytest suite against the CUDA backend)
#   steps    attn-bench --mode decode: a lone Step (stub, wire and GPU-region coding) and its Echo,
#            BatchStep of 64 from 4 callers, after their sessions' prefill
#   example  client/python/gpu_check.sh example 1 (an 8b-shaped decoder, teacher-forced tokens)
#   handoff  attn-session-transfer-bench --over_grpc: sessions moved by the drain's hand-off over
#            loopback gRPC into a CPU and a CUDA peer (GB/s)
# Every part runs under its own timeout; logs and tables go to OUT_DIR/PART, and a line per part
# to OUT_DIR/summary.txt.
#   . BUNDLE/env.sh && bench/gpu_verify_h200.sh BUNDLE OUT_DIR PART...
# BUNDLE: a gpu-bundle of attnd, attnctl, attn-bench, the cuda_*_test suites, with
# lib/libattn_kernels_capi.so beside the other libraries.
set -uo pipefail
self_dir=$(cd "$(dirname "$0")" && pwd)
self=$self_dir/$(basename "$0")
inner=""
if [ "${1:-}" = --inner ]; then inner=$2; shift 2; fi  # one part's body, run under part's timeout
bundle=$(cd "$1" && pwd)
out=$2
shift 2
mkdir -p "$out"
out=$(cd "$out" && pwd)
bin=$bundle/bin
export ATTND_BIN=$bin/attnd
py=${PYTHON:-python3}
summary=$out/summary.txt
[ -n "$inner" ] || nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader >"$out/gpu.txt" 2>&1

# part NAME LIMIT_S CMD...: CMD (a command, or one of the functions below through --inner) with its output to OUT/NAME/log.txt, its verdict to the summary.
part() {
  local name=$1 limit=$2
  shift 2
  mkdir -p "$out/$name"
  local s rc
  s=$(date +%s)
  timeout -k 5 "$limit" "$@" >"$out/$name/log.txt" 2>&1
  rc=$?
  printf '%s rc=%s %ss %s\n' "$name" "$rc" "$(($(date +%s) - s))" \
    "$(grep -hE '^\[  (PASSED|FAILED)  \]|passed|failed' "$out/$name/log.txt" | tail -n 3 | tr '\n' ' ')" \
    | tee -a "$summary"
}

kernels() {
  "$py" kernels/bench/bench_decode.py --lib "$bundle/lib/libattn_kernels_capi.so" --out "$out/kernels/decode.md" \
    --decode "${DECODE_POINTS:-1x4096,1x8192,1x16384,1x32768,1x131072,2x32768,4x8192,8x4096,8x32768,16x4096,64x4096,16x32768,128x8192}" \
    --pages 16 --prefill "" --split-sweep "${SPLIT_SWEEP:-2,4,8,16,32,33,64}" --fp8 "" --reps 7 --min-ms 10
}

forward() {
  local lib=$bundle/lib/libattn_kernels_capi.so
  "$py" kernels/bench/bench_vs_torch.py --lib "$lib" --out "$out/forward/d256.md" --dims 256 \
    --dtypes bf16 --seqlens 512,1024,2048,4096,8192,16384 --reps 7 --min-ms 10
  "$py" kernels/bench/bench_vs_torch.py --lib "$lib" --out "$out/forward/s512.md" --dims 64,128 \
    --dtypes bf16,fp16 --seqlens 512 --reps 7 --min-ms 10
}

suites() {
  local t
  for t in cuda_session_test cuda_region_test cuda_server_test; do
    echo "== $t"
    timeout "${SUITE_TIMEOUT:-120}" "$bin/$t" 2>&1 | tee "$out/suites/$t.log" |
      grep -E '^\[  (PASSED|FAILED|SKIPPED)  \]|^\[==========\]'
  done
}

# One attnd per value of STEP_LANES (--step_lanes; ATTND_EXTRA: more flags) and per set of flags in
# STEP_VARIANTS (space-separated sets, each of comma-separated attnd flags; "-" for none), the
# whole list STEP_ROUNDS times over, so that variants alternate; per level, the means of
# attn_step_phase_duration_seconds (bench/step_phases.py) into steps/phases.md.
steps() {
  local port=50051 mport=9464 lanes variant round
  local common=(--target 127.0.0.1:$port --mode decode --layers 1 --cache_tokens 4096 --heads 32
                --kv_heads 8 --head_dim 128 --dtype bf16 --duration_s "${LEVEL_S:-3}" --warmup_s 0.5)
  local scrape=("$py" "$self_dir/step_phases.py" scrape "http://127.0.0.1:$mport/metrics")
  local header=--header
  for round in $(seq "${STEP_ROUNDS:-1}"); do
  for variant in ${STEP_VARIANTS:--}; do
  for lanes in ${STEP_LANES:-4}; do
    local flags=() tag="lanes$lanes"
    if [ "$variant" != - ]; then
      IFS=, read -r -a flags <<<"$variant"
      tag="$tag${variant//[^a-z0-9]/_}"
    fi
    [ "${STEP_ROUNDS:-1}" -gt 1 ] && tag="$tag-r$round"
    local log=$out/steps/attnd-$tag.log
    "$bin/attnd" --listen=127.0.0.1:$port --metrics_listen=127.0.0.1:$mport --backend=cuda \
      --kv_cache_bytes=17179869184 --allow_shared_memory --step_lanes="$lanes" "${flags[@]}" ${ATTND_EXTRA:-} >"$log" 2>&1 &
    attnd_pid=$!
    trap 'kill -TERM $attnd_pid 2>/dev/null' EXIT
    for _ in $(seq 300); do grep -q 'serving attn.v1' "$log" && break; sleep 0.2; done
    "${scrape[@]}" "$out/steps/m0"
    "$bin/attn-bench" "${common[@]}" --sessions 1 --step_coding "${LONE_CODINGS:-stub,wire,gpu}" \
      --csv "$out/steps/decode.csv" --label "lone-$tag"
    "${scrape[@]}" "$out/steps/m1"
    # The same set-up twice (256 sessions prefilled to 4k), once with a tiny measured part: the
    # difference is the decode level's alone.
    "$bin/attn-bench" "${common[@]}" --sessions 256 --batch_step 64 --step_coding "${BATCH_CODINGS:-wire}" \
      --duration_s 0.05 --warmup_s 0 --label "setup-only" >"$out/steps/setup-lanes$lanes.txt"
    "${scrape[@]}" "$out/steps/m2"
    "$bin/attn-bench" "${common[@]}" --sessions 256 --batch_step 64 --step_coding "${BATCH_CODINGS:-wire}" \
      --csv "$out/steps/decode.csv" --label "batch64x4-$tag"
    "${scrape[@]}" "$out/steps/m3"
    "$py" "$self_dir/step_phases.py" diff "$out/steps/m0" "$out/steps/m1" "lone, $tag (all codings)" $header >>"$out/steps/phases.md"
    header=
    "$py" "$self_dir/step_phases.py" diff "$out/steps/m2" "$out/steps/m3" "BatchStep 64 x 4, $tag" \
      --less "$out/steps/m1" "$out/steps/m2" >>"$out/steps/phases.md"
    kill -TERM $attnd_pid
    wait $attnd_pid
  done
  done
  done
  cat "$out/steps/phases.md"
}

handoff() {
  local peer
  for peer in cpu cuda; do
    echo "== peer $peer"
    "$bin/attn-session-transfer-bench" --over_grpc --repeats="${HANDOFF_REPEATS:-3}" \
      --page_bytes=32768 --peer_backend=$peer
  done
}

if [ -n "$inner" ]; then
  "$inner"
  exit $?
fi
for p in "$@"; do
  case $p in
    kernels) part kernels "${KERNELS_TIMEOUT:-200}" "$self" --inner kernels "$bundle" "$out" ;;
    forward) part forward "${FORWARD_TIMEOUT:-200}" "$self" --inner forward "$bundle" "$out" ;;
    suites) mkdir -p "$out/suites"; part suites "${SUITES_TIMEOUT:-380}" "$self" --inner suites "$bundle" "$out" ;;
    python) part python "${PYTHON_TIMEOUT:-320}" env OUT="$out/python" ATTND_BIN_DIR="$bin" \
              TESTS_TIMEOUT=$((${PYTHON_TIMEOUT:-320} - 10)) client/python/gpu_check.sh tests ;;
    steps) mkdir -p "$out/steps"; part steps "${STEPS_TIMEOUT:-240}" "$self" --inner steps "$bundle" "$out" ;;
    example) part example "${EXAMPLE_TIMEOUT:-300}" env OUT="$out/example" ATTND_BIN_DIR="$bin" \
               EXAMPLE_TIMEOUT=$((${EXAMPLE_TIMEOUT:-300} - 10)) client/python/gpu_check.sh example 1 ;;
    handoff) part handoff "${HANDOFF_TIMEOUT:-200}" "$self" --inner handoff "$bundle" "$out" ;;
    *) echo "gpu_verify_h200: unknown part $p" >&2 ;;
  esac
done
cat "$summary"

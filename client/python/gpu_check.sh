#!/usr/bin/env bash
# The Python client on a GPU host, in one command per part (each fits in 10 minutes):
#
#   tests    the pytest suites (tests/python) against attnd's CUDA backend: every dtype and shape
#            family against float64, bad inputs, sessions, streams, asyncio, host regions, CUDA IPC
#            regions, torch tensors on the GPU, transformers' generate() with the KV cache in attnd
#   example  examples/remote_decoder.py --size 8b: batch 1 (with the teacher-forced comparison)
#            and batch 32, over gRPC and over a CUDA IPC region ("example 1" or "example 32"
#            runs one batch size)
#   bench    in one command (about 9 minutes at most): bench/python_client_bench.py (the Python
#            sync and asyncio clients against attn-bench), bench/python_step_overhead.py (a
#            decode step's Python, library and grpcio parts), bench/python_batch_regions_bench.py
#            (where a batch-32 decode BatchStep's client time goes, GPU regions and host regions,
#            prepared against coded per call), and the example at --size 8b --batch 32 over
#            CUDA IPC and gRPC (attnd's added us per layer)
#
# Usage, from the repository root (no argument: every part):
#   . .gpu/env.sh && client/python/gpu_check.sh [tests|example [1|32]|bench]...
# Environment: ATTND_BIN_DIR (default .gpu/bin: attnd, attn-bench), OUT (results; default
# gpu-python-results), PYTHON (default python3), BENCH_ARGS (more arguments of the benchmark),
# EXAMPLE_ARGS (more arguments of the example), TESTS_TIMEOUT, EXAMPLE_TIMEOUT (seconds per
# part; defaults 580, 570); the bench part's runs: BENCH_TIMEOUT (180), OVERHEAD_TIMEOUT (45),
# REGIONS_TIMEOUT (100), BENCH_EXAMPLE_TIMEOUT (250), EXAMPLE_KV_CACHE_BYTES (attnd's cache for
# the example), REGIONS_ARGS (more arguments of the regions benchmark),
# BENCH_EXAMPLE_ARGS (the example's transports and more; default --transport cuda-ipc,grpc).
#
# The blocking client's native transport loads $ATTND_NATIVE_LIB (default: the bundle's
# libattn_client_c.so, in $ATTND_BIN_DIR when gpu-bundle was given build/client/
# libattn_client_c.so with the executables); without it the client runs on grpcio and says so.
#
# The package is imported from client/python. Its protocol descriptors
# (client/python/attnd/_proto/_descriptor_set.py, git-ignored) are generated from proto/ with
# protoc or grpc_tools when either is here; a host with neither needs the file made elsewhere
# (`python3 -m attnd._proto.build` in client/python) and brought along.
set -uo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
bin=${ATTND_BIN_DIR:-.gpu/bin}
out=${OUT:-gpu-python-results}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONPATH=$root/client/python${PYTHONPATH:+:$PYTHONPATH}
export PYTHONDONTWRITEBYTECODE=1
if [ -z "${ATTND_NATIVE_LIB:-}" ] && [ -f "$bin/libattn_client_c.so" ]; then
  export ATTND_NATIVE_LIB=$(cd "$bin" && pwd)/libattn_client_c.so
fi

note() { echo "== gpu_check: $*"; }

descriptors=client/python/attnd/_proto/_descriptor_set.py
if [ ! -f "$descriptors" ]; then
  (cd client/python && "$py" -m attnd._proto.build >/dev/null) || {
    echo "gpu_check: $descriptors is missing and cannot be generated here (no protoc, no" \
         "grpc_tools): run 'python3 -m attnd._proto.build' in client/python elsewhere and bring" \
         "the file along" >&2
    exit 2
  }
fi
[ -x "$bin/attnd" ] || { echo "gpu_check: no $bin/attnd (ATTND_BIN_DIR)" >&2; exit 2; }

"$py" - <<'EOF' 2>&1 | tee "$out/environment.txt"
import importlib, platform
print("python", platform.python_version())
for name in ("grpc", "google.protobuf", "numpy", "torch", "transformers", "ml_dtypes", "pytest"):
    try:
        m = importlib.import_module(name)
        print(name, getattr(m, "__version__", "?"))
    except ImportError as e:
        print(name, "missing:", e)
import torch
print("cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
import attnd, attnd._proto
print("attnd package", attnd.__file__)
EOF

# start_attnd LOG FLAG...: attnd on loopback ports it picks; sets TARGET and ATTND_PID.
start_attnd() {
  local log=$1
  shift
  "$bin/attnd" --listen=127.0.0.1:0 --metrics_listen=127.0.0.1:0 --backend=cuda "$@" >"$log" 2>&1 &
  ATTND_PID=$!
  for _ in $(seq 300); do
    line=$(grep -a -m1 -o 'serving attn.v1 on port [0-9]*' "$log" || true)
    if [ -n "$line" ]; then
      TARGET=127.0.0.1:${line##* }
      return 0
    fi
    kill -0 "$ATTND_PID" 2>/dev/null || break
    sleep 0.2
  done
  echo "gpu_check: attnd did not start; the end of $log:" >&2
  tail -n 20 "$log" >&2
  return 1
}
stop_attnd() { kill -TERM "$ATTND_PID" 2>/dev/null; wait "$ATTND_PID" 2>/dev/null; }

rc=0
run_tests() {
  note "pytest against the CUDA backend -> $out/pytest.log"
  ATTND=$bin/attnd ATTND_TEST_BACKEND=cuda timeout "${TESTS_TIMEOUT:-580}" "$py" -m pytest -q -rs -p no:cacheprovider \
    --junitxml="$out/pytest.xml" tests/python 2>&1 | tee "$out/pytest.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
}

# run_example BATCHES SECONDS NAME ARGS...: the example at --size 8b on an attnd of its own.
# Its KV cache (EXAMPLE_KV_CACHE_BYTES, default 16 GiB) holds batch 32's three sessions per layer
# (the run, its fork and the speculative fork: ~10 GB) with room to spare; the Python process
# beside it needs ~47 GB at batch 32 (weights, three local caches, prefill logits), so a larger
# attnd cache leaves an 80 GB GPU short.
run_example() {
  local batches=$1 seconds=$2 name=$3
  shift 3
  start_attnd "$out/attnd-$name.log" --allow_shared_memory \
    --kv_cache_bytes="${EXAMPLE_KV_CACHE_BYTES:-17179869184}" --max_session_tokens=8192 ||
    { rc=1; return; }
  note "examples/remote_decoder.py --size 8b --batch $batches $* against $TARGET"
  timeout "$seconds" "$py" examples/remote_decoder.py --target "$TARGET" --size 8b --batch "$batches" \
    "$@" --json "$out/$name.json" 2>&1 | tee "$out/$name.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
  stop_attnd
}

run_bench() {
  start_attnd "$out/attnd-bench.log" --kv_cache_bytes=8589934592 || { rc=1; return; }
  note "bench/python_client_bench.py against $TARGET"
  timeout "${BENCH_TIMEOUT:-180}" "$py" bench/python_client_bench.py --target "$TARGET" --attn-bench "$bin/attn-bench" \
    --duration 3 --rounds 2 --json "$out/python_client_bench.json" \
    --dump-stacks-after "$(( ${BENCH_TIMEOUT:-180} - 10 ))" ${BENCH_ARGS:-} 2>&1 |
    tee "$out/python_client_bench.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
  note "bench/python_step_overhead.py against $TARGET"
  timeout "${OVERHEAD_TIMEOUT:-45}" "$py" bench/python_step_overhead.py --target "$TARGET" \
    --attn-bench "$bin/attn-bench" --cache 4096 --calls 2000 --rounds 2 --duration 2 2>&1 |
    tee "$out/python_step_overhead.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
  stop_attnd

  start_attnd "$out/attnd-regions.log" --allow_shared_memory --kv_cache_bytes=8589934592 ||
    { rc=1; return; }
  local region
  for region in cuda host; do
    note "bench/python_batch_regions_bench.py --region $region against $TARGET"
    timeout "$(( ${REGIONS_TIMEOUT:-100} / 2 ))" "$py" bench/python_batch_regions_bench.py \
      --target "$TARGET" --region "$region" --calls 200 --rounds 3 \
      --json "$out/python_batch_regions_$region.json" ${REGIONS_ARGS:-} 2>&1 |
      tee "$out/python_batch_regions_$region.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
  done
  stop_attnd

  # shellcheck disable=SC2086  # BENCH_EXAMPLE_ARGS is a list of arguments
  run_example 32 "${BENCH_EXAMPLE_TIMEOUT:-250}" bench_remote_decoder_8b_batch32 \
    ${BENCH_EXAMPLE_ARGS:---transport cuda-ipc,grpc}
}

parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(tests example bench)
i=0
while [ $i -lt ${#parts[@]} ]; do
  case ${parts[$i]} in
    tests) run_tests ;;
    example)
      if [ $((i + 1)) -lt ${#parts[@]} ] && [[ ${parts[$((i + 1))]} =~ ^[0-9,]+$ ]]; then
        i=$((i + 1))
        # shellcheck disable=SC2086  # EXAMPLE_ARGS is a list of arguments
        run_example "${parts[$i]}" "${EXAMPLE_TIMEOUT:-570}" "remote_decoder_8b_batch${parts[$i]}" ${EXAMPLE_ARGS:-}
      else
        # shellcheck disable=SC2086
        run_example 1 "${EXAMPLE_TIMEOUT:-570}" remote_decoder_8b_batch1 ${EXAMPLE_ARGS:-}
        # shellcheck disable=SC2086
        run_example 32 "${EXAMPLE_TIMEOUT:-570}" remote_decoder_8b_batch32 ${EXAMPLE_ARGS:-}
      fi ;;
    bench) run_bench ;;
    *) echo "gpu_check: unknown part '${parts[$i]}' (tests, example [BATCH], bench)" >&2; rc=2 ;;
  esac
  i=$((i + 1))
done
note "results in $out (exit $rc)"
exit $rc

#!/usr/bin/env bash
# Session hand-off on the CUDA backend, on a GPU host: builds attnd and the tests with the CUDA
# kernels, runs the hand-off tests of session_replicas_test and the Python client's with every
# replica on the CUDA backend (pages read and written through the step device's copies), then the
# hand-off bench over loopback gRPC into a CPU and a CUDA peer. Prints what it runs.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${ATTN_BUILD_DIR:-build-gpu}
run() { echo "+ $*"; "$@"; }
ATTN_BUILD_DIR=$build ATTN_CUDA=ON \
  ATTN_TARGETS="attnd session_replicas_test kv_cache_test attn-session-transfer-bench" \
  run scripts/build.sh -DATTN_CUDA_ARCHS=90a
run "$build/tests/server/kv_cache_test" --gtest_filter='SessionTransfer*:SessionManagerTest.*'
ATTND_TEST_BACKEND=cuda run "$build/tests/server/session_replicas_test" \
  --gtest_filter='SessionHandoff.*:ImportSessionTest.*'
ATTND_TEST_BACKEND=cuda ATTND="$build/server/attnd" \
  run /usr/bin/python3 -m pytest -q tests/python/test_sessions.py -k handed_off
for peer in cpu cuda; do
  run "$build/server/attn-session-transfer-bench" --over_grpc --repeats=5 --page_bytes=32768 \
    --peer_backend=$peer
done

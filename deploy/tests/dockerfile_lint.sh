#!/usr/bin/env bash
# Lints the Dockerfile with the npm package dockerfile-utils (pinned in deploy/tools).
#   dockerfile_lint.sh DEPLOY_DIR BUILD_DIR
. "$(dirname "$0")/lib.sh"
deploy="$1"; build="$2"
install_tools "$deploy" "$build"
timeout 60 node "$deploy/tools/lint-dockerfile.js" "$deploy/Dockerfile" || fail "Dockerfile lint"
# Things the image must keep (the issue's contract).
d="$deploy/Dockerfile"
grep -q -E '^FROM nvidia/cuda:\$\{CUDA_VERSION\}-devel-\$\{UBUNTU\} AS build' "$d" || fail "build stage is not the CUDA devel image"
grep -q -E '^FROM nvidia/cuda:\$\{CUDA_VERSION\}-runtime-\$\{UBUNTU\}' "$d" || fail "runtime stage is not the CUDA runtime image"
grep -q -E '^EXPOSE 50051 9464$' "$d" || fail "EXPOSE 50051 9464 missing"
grep -q -E '^USER [1-9][0-9]*' "$d" || fail "runtime user is not a non-root uid"
grep -q -E '^HEALTHCHECK .*' "$d" && grep -q -E 'attnctl", "--target", "127.0.0.1:50051", "health"' "$d" || fail "HEALTHCHECK via attnctl health missing"
grep -q -E '^ENTRYPOINT \["attnd", "--listen=0.0.0.0:50051", "--metrics_listen=0.0.0.0:9464"\]' "$d" || fail "ENTRYPOINT"
echo "Dockerfile lint ok"

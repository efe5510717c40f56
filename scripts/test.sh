#!/usr/bin/env bash
# Installs what is missing, builds everything and runs every test (ctest). GPU tests skip with
# a message where no GPU is found. Extra arguments go to cmake's configure step.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh "$@"
cd "${ATTN_BUILD_DIR:-build}"
ctest --output-on-failure -j "${ATTN_TEST_JOBS:-2}" --timeout 600

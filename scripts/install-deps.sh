#!/usr/bin/env bash
# Installs, from Debian 12 packages, whatever attnd needs to build, test and run that is missing.
# Idempotent: a second run installs nothing. Needs root (or sudo).
set -euo pipefail

# libbenchmark-dev: Google Benchmark, for kernels/bench/dtype_convert_bench.
build_pkgs=(
  build-essential cmake ninja-build ccache pkg-config git
  libgrpc++-dev libgrpc-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev prometheus-cpp-dev libssl-dev zlib1g-dev libcurl4-openssl-dev
  libgtest-dev libgmock-dev libbenchmark-dev
)
# The Python client (client/python, built into build/python): what it imports, and the
# interpreter's headers for its compiled decode step (attnd._fast). Small, and installed with the
# build packages so that scripts/run.sh can show it.
client_pkgs=(python3 python3-grpcio python3-protobuf python3-numpy python3-dev)
# Tools the tests use: promtool and a real Prometheus, openssl for TLS certificates, yamllint,
# clang for the fuzzer and sanitizer builds, curl for scraping, python3 for the TSan triage, and
# for the Python client's suites (tests/python) pytest, pip (its install test) and torch (1.13,
# CPU: the torch suites and the example; `apt-get install python3-torch` took 1m45s on a 2-core VM,
# 182 MB of packages).
test_pkgs=(prometheus openssl yamllint clang libclang-rt-14-dev curl python3-pytest python3-pip
           python3-torch)

want=("${build_pkgs[@]}" "${client_pkgs[@]}")
[ "${ATTN_DEPS_BUILD_ONLY:-0}" = 1 ] || want+=("${test_pkgs[@]}")

missing=()
# Node.js may come from elsewhere than Debian; only its command matters (npm-based linters).
if [ "${ATTN_DEPS_BUILD_ONLY:-0}" != 1 ] && ! command -v npm >/dev/null; then
  want+=(nodejs npm)
fi
for p in "${want[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q '^install ok installed$' || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: everything is installed"
  exit 0
fi
echo "install-deps: installing ${missing[*]}"
sudo=""
[ "$(id -u)" = 0 ] || sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"

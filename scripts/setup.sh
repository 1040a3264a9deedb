#!/usr/bin/env bash
# Installs what a fresh Debian 12 machine lacks for the C++ library, then configures
# build/release (Release, warnings as errors) and builds the library and fusednorm-bench, the
# main job: nothing else, so the README's first command stays quick. scripts/test.sh builds
# the rest of the tree (test suites, CUDA emulation) in the same build directory.
# Idempotent: a second run only rebuilds what changed.
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
command -v cmake >/dev/null || need+=(cmake)
command -v g++ >/dev/null || need+=(g++)
command -v make >/dev/null || need+=(make)
[ -f /usr/include/hwy/highway.h ] || need+=(libhwy-dev)
[ -f /usr/include/gtest/gtest.h ] || need+=(libgtest-dev)
if [ ${#need[@]} -gt 0 ]; then
  echo "setup: installing ${need[*]}"
  sudo_cmd=""
  [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${need[@]}" >/dev/null
fi

# The CUDA backend is compiled whenever nvcc is on PATH or in /usr/local/cuda (it needs no GPU),
# unless FUSEDNORM_CUDA=OFF (ON: required; default AUTO).
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi

jobs=$(nproc)
cmake -S . -B build/release -DCMAKE_BUILD_TYPE=Release -DFUSEDNORM_WERROR=ON \
  -DFUSEDNORM_CUDA="${FUSEDNORM_CUDA:-AUTO}" >/dev/null
cmake --build build/release -j"$jobs" --target fusednorm-bench

#!/usr/bin/env bash
# Runs every test on a fresh or prepared machine, installing what is missing first:
#   1. C++ library, benchmark and GoogleTest suite (Release, warnings as errors; the CUDA
#      sources are compiled when nvcc exists, their SASS checked with cuobjdump from PyPI,
#      and GPU tests skip without a GPU),
#   2. the same suite under AddressSanitizer + UndefinedBehaviorSanitizer,
#   3. the installed package consumed by a separate CMake project (find_package),
#   4. fusednorm-bench on a small problem (checks its results against the reference),
#   5. the Python package's pytest suite (when python/ exists).
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc)

# Each stage's wall time, printed when the next one starts and at the end, so that a CI log
# shows where the time went (CI allows 90 minutes; a fresh, slow 2-core machine took 80).
stage_name="" stage_start=$SECONDS
stage() {
  if [ -n "$stage_name" ]; then
    echo "   [$stage_name: $((SECONDS - stage_start)) s; $SECONDS s since the start]"
  fi
  stage_name=$1 stage_start=$SECONDS
  [ -z "$1" ] || echo "== $1"
}
trap 'stage ""' EXIT

# ccache: step 5 builds the Python extension, which compiles the library's sources again;
# with the same flags as step 1 (FUSEDNORM_WERROR below) they come from the cache. The cache
# lives outside the checkout (CCACHE_DIR, default ~/.cache/fusednorm-ccache) and is keyed
# on paths relative to it (CCACHE_BASEDIR), so a fresh clone on a machine that ran the
# tests before (CI) compiles only what changed, the CUDA sources (nvcc) included.
if ! command -v ccache >/dev/null; then
  sudo_cmd=""
  [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  { $sudo_cmd apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
      $sudo_cmd apt-get install -y -qq ccache >/dev/null; } || echo "test: no ccache (builds uncached)"
fi
if command -v ccache >/dev/null; then
  export CMAKE_CXX_COMPILER_LAUNCHER=ccache CMAKE_CUDA_COMPILER_LAUNCHER=ccache \
    CCACHE_DIR="${CCACHE_DIR:-$HOME/.cache/fusednorm-ccache}" CCACHE_BASEDIR="$PWD"
  ccache --zero-stats >/dev/null
fi

stage "1. build and C++ tests (Release)"
if [ "${FUSEDNORM_CUDA:-AUTO}" != OFF ] && { command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ]; }; then
  scripts/setup_sass_tools.sh  # cuobjdump / nvdisasm for the SASS checks of the CUDA build
fi
scripts/setup.sh                          # prerequisites, the library and fusednorm-bench
cmake --build build/release -j"$jobs"     # the rest: test suites, CUDA emulation
ctest --test-dir build/release --output-on-failure -j"$jobs"

stage "2. C++ tests under AddressSanitizer + UndefinedBehaviorSanitizer"
# Only the AVX2 and scalar (EMU128) kernels: step 1 ran every target; here each extra target
# costs minutes of sanitized compilation. EMU128 shares the SSE targets' fp16 code path.
cmake -S . -B build/asan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFUSEDNORM_SANITIZE=address,undefined \
  -DFUSEDNORM_CUDA=OFF -DFUSEDNORM_BUILD_TOOLS=OFF -DFUSEDNORM_WERROR=ON \
  -DFUSEDNORM_HWY_DISABLED_TARGETS="HWY_SSSE3|HWY_SSE4|HWY_AVX3" >/dev/null
cmake --build build/asan -j"$jobs"
ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
  ctest --test-dir build/asan --output-on-failure -j"$jobs"

stage "3. install and find_package from another project"
rm -rf build/install build/consumer
cmake --install build/release --prefix build/install >/dev/null
cmake -S tests/install -B build/consumer -DCMAKE_PREFIX_PATH="$PWD/build/install" >/dev/null
cmake --build build/consumer -j"$jobs" >/dev/null
build/consumer/consumer

stage "4. fusednorm-bench smoke run (results checked against the fp64 reference)"
build/release/tools/fusednorm-bench --rows 64 --dim 1000 --repeat 3

if [ -f scripts/setup_python.sh ] && [ -d tests/python ]; then
  stage "5. Python package tests"
  CMAKE_ARGS="${CMAKE_ARGS:-} -DFUSEDNORM_WERROR=ON" scripts/setup_python.sh
  if command -v ccache >/dev/null; then ccache --show-stats | grep -iE "hits|misses" || true; fi
  .venv/bin/python -m pytest tests/python -q
fi

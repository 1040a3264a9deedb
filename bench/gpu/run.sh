#!/usr/bin/env bash
# fusednorm on the device machine (H200): build, CUDA correctness tests, then one table of
# every op x dtype x shape for fusednorm and its peers, each as a % of a device-to-device
# copy measured in the same run. Full CSV and logs go to $OUT. Budget: < 5 minutes.
#
#   bench/gpu/run.sh            from the repository root (or anywhere: it cds there)
#   SANITIZE=1 bench/gpu/run.sh also the compute-sanitizer checks (about +3 minutes)
#
# Steps and rough time limits (the whole script is meant to end well inside 5 minutes):
#   1. configure + build gpu_bench and the CUDA tests, sm_90 only, -j16
#   2. ctest: launch-planner tests and GPU correctness tests (C++); with SANITIZE=1 the GPU
#      tests again under compute-sanitizer memcheck / racecheck / synccheck (quick sweep);
#      the CUDA pytest subset when the Python package is importable
#   3. gpu_bench (fusednorm, CUDA events, L2 flushed) -> $OUT/fusednorm.csv
#   4. peers.py (torch, torch.compile, F.layer_norm, Liger if importable) -> $OUT/bench.csv,
#      table on stdout and in $OUT/table.txt
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/fusednorm-gpu-bench}
mkdir -p "$OUT"
BUILD=build-gpu
export PATH=/usr/local/cuda/bin:$PATH
export PYTHONUNBUFFERED=1
t0=$SECONDS
stamp() { echo "== [$((SECONDS - t0)) s] $*"; }

# Carried wheels (bench/gpu/pack_deps.sh: Liger-Kernel) into a private site directory.
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/gpu.txt"

# Highway / GoogleTest: carried prefix from bench/gpu/pack_deps.sh when the image lacks them.
cmake_extra=()
if [ -d build-deps/usr ]; then
  cmake_extra+=("-DCMAKE_PREFIX_PATH=$PWD/build-deps/usr")
  export LD_LIBRARY_PATH=$PWD/build-deps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
fi
generator=()
command -v ninja > /dev/null && generator=(-G Ninja)

stamp "configure"
if ! cmake -S bench/gpu -B "$BUILD" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_CUDA_ARCHITECTURES=90 -DFUSEDNORM_CUDA=ON -DPython3_EXECUTABLE="$(command -v python3)" \
    "${cmake_extra[@]}" > "$OUT/configure.log" 2>&1; then
  tail -40 "$OUT/configure.log"; echo "configure FAILED"; exit 1
fi
stamp "build"
targets=(gpu_bench fusednorm_cuda_tests fusednorm_cuda_plan_tests)
# The PyTorch extension when configure found torch (bench/gpu/CMakeLists.txt).
grep -q "^FUSEDNORM_BUILD_PYTHON:BOOL=ON" "$BUILD/CMakeCache.txt" && targets+=(fusednorm_torch)
if ! cmake --build "$BUILD" -j16 --target "${targets[@]}" > "$OUT/build.log" 2>&1; then
  grep -E "error|Error" "$OUT/build.log" | head -40; echo "build FAILED"; exit 1
fi

stamp "ctest (planner + GPU correctness)"
ctest --test-dir "$BUILD/fusednorm" -R "LaunchPlan|Cuda" --output-on-failure --timeout 240 \
  > "$OUT/ctest.log" 2>&1
ctest_rc=$?
grep -E "tests passed|tests failed|Failed|\*\*\*" "$OUT/ctest.log" | head -30

# SANITIZE=1: the GPU tests again under compute-sanitizer (works on the Firecracker
# machines, not on gVisor: KINDS.md), on the quick sweep (every D, so every kernel kind, at
# most 3 rows; the staged-backward test keeps 301 rows). Each tool is time-boxed.
if [ "${SANITIZE:-0}" != 0 ]; then
  tests_bin=$BUILD/fusednorm/tests/cuda/fusednorm_cuda_tests
  for tool in memcheck racecheck synccheck; do
    stamp "compute-sanitizer --tool $tool (quick sweep)"
    FUSEDNORM_TEST_QUICK=1 timeout 150 compute-sanitizer --tool "$tool" --error-exitcode 3 \
      "$tests_bin" > "$OUT/sanitize-$tool.log" 2>&1
    echo "$tool: exit $? (0 clean, 3 sanitizer errors, 124 timed out)"
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Invalid|Race|hazard|FAILED" "$OUT/sanitize-$tool.log" | head -8
  done
fi

# The package from the source tree, with the extension just built (also for peers.py).
torch_lib=$BUILD/fusednorm/python/libfusednorm_torch.so
if [ -f "$torch_lib" ]; then
  export FUSEDNORM_LIBRARY=$PWD/$torch_lib PYTHONPATH=$PWD/python:${PYTHONPATH:-}
fi
if python3 -c "import fusednorm, torch; assert torch.cuda.is_available() and fusednorm.has_cuda()" 2> "$OUT/import.err"; then
  stamp "pytest (CUDA subset)"
  python3 -m pytest -q -p no:cacheprovider -k cuda tests/python > "$OUT/pytest.log" 2>&1
  tail -5 "$OUT/pytest.log"
else
  echo "pytest: fusednorm with CUDA not importable here: CUDA pytest subset skipped"; tail -2 "$OUT/import.err"
fi

stamp "gpu_bench"
if ! "$BUILD/gpu_bench" > "$OUT/fusednorm.csv" 2> "$OUT/gpu_bench.err"; then
  cat "$OUT/gpu_bench.err"; echo "gpu_bench FAILED"
fi
stamp "peers"
python3 bench/gpu/peers.py "$OUT/fusednorm.csv" "$OUT/bench.csv" --budget 120 \
  2> "$OUT/peers.err" | tee "$OUT/table.txt"
grep -v "^peers: liger\|^peers: fusednorm" "$OUT/peers.err" | tail -5
stamp "done (ctest exit $ctest_rc); CSV: $OUT/bench.csv"
exit $ctest_rc

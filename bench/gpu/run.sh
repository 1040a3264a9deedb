#!/usr/bin/env bash
# fusednorm on the device machine (H200): build, CUDA correctness tests, then one table of
# every op x dtype x shape for fusednorm and its peers, each as a % of a device-to-device
# copy measured in the same run. Full CSV and logs go to $OUT. Budget: < 5 minutes.
#
#   bench/gpu/run.sh            from the repository root (or anywhere: it cds there)
#   SANITIZE=1 bench/gpu/run.sh also the compute-sanitizer checks (about +3 minutes)
#   DEADLINE_S=570 (default)    seconds the whole script may take: the peers' budget and the
#                               sanitizers' time boxes shrink to fit it, so that a device call
#                               with timeout_s a little above it always returns its files
#
# Steps and rough time limits (the whole script is meant to end well inside 5 minutes):
#   1. configure + build gpu_bench and the CUDA tests, sm_90 only, -j16
#   2. ctest: launch-planner tests and GPU correctness tests (C++); the CUDA pytest subset
#      when the Python package is importable
#   3. gpu_bench (fusednorm, CUDA events, L2 flushed) -> $OUT/fusednorm.csv
#   4. peers.py (torch, torch.compile, F.layer_norm, Liger if importable) -> $OUT/bench.csv,
#      table on stdout and in $OUT/table.txt
#   5. SANITIZE=1: compute-sanitizer memcheck / racecheck / synccheck on the GPU tests (quick
#      sweep), last, in the time that is left
# The device tool brings back at most 8 files from $OUT: the logs are kept in $OUT/logs.tar.gz
# (rewritten after each step, so that a run cut short still returns what it did).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/fusednorm-gpu-bench}
mkdir -p "$OUT"
LOGS=$(mktemp -d)
pack_logs() { tar czf "$OUT/logs.tar.gz" -C "$LOGS" . 2> /dev/null; }
BUILD=build-gpu
DEADLINE=${DEADLINE_S:-570}
export PATH=/usr/local/cuda/bin:$PATH
export PYTHONUNBUFFERED=1
t0=$SECONDS
stamp() { pack_logs; echo "== [$((SECONDS - t0)) s] $*"; }
left() { echo $((DEADLINE - (SECONDS - t0))); }

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
    "${cmake_extra[@]}" > "$LOGS/configure.log" 2>&1; then
  tail -40 "$LOGS/configure.log"; echo "configure FAILED"; exit 1
fi
stamp "build"
# The library, the benchmark and the CUDA tests first; the PyTorch extension (when configure
# found torch: bench/gpu/CMakeLists.txt) on its own, so that a failure there costs only the
# pytest subset and the fusednorm_py rows, not the run.
if ! cmake --build "$BUILD" -j16 --target gpu_bench fusednorm_cuda_tests fusednorm_cuda_plan_tests \
    > "$LOGS/build.log" 2>&1; then
  grep -E "error|Error" "$LOGS/build.log" | head -40; echo "build FAILED"; pack_logs; exit 1
fi
if grep -q "^FUSEDNORM_BUILD_PYTHON:BOOL=ON" "$BUILD/CMakeCache.txt"; then
  stamp "build (PyTorch extension)"
  cmake --build "$BUILD" -j16 --target fusednorm_torch > "$LOGS/build-torch.log" 2>&1 \
    || { grep -E "error" "$LOGS/build-torch.log" | head -20; echo "PyTorch extension build FAILED"; }
fi

stamp "ctest (planner + GPU correctness)"
timeout 240 ctest --test-dir "$BUILD/fusednorm" -R "LaunchPlan|Cuda" --output-on-failure --timeout 200 \
  > "$LOGS/ctest.log" 2>&1
ctest_rc=$?
grep -E "tests passed|tests failed|Failed|\*\*\*|Timeout" "$LOGS/ctest.log" | head -30

# The package from the source tree, with the extension just built (also for peers.py).
torch_lib=$BUILD/fusednorm/python/libfusednorm_torch.so
if [ -f "$torch_lib" ]; then
  export FUSEDNORM_LIBRARY=$PWD/$torch_lib PYTHONPATH=$PWD/python:${PYTHONPATH:-}
fi
if python3 -c "import fusednorm, torch; assert torch.cuda.is_available() and fusednorm.has_cuda()" 2> "$LOGS/import.err"; then
  stamp "pytest (CUDA subset)"
  timeout 150 python3 -m pytest -q -p no:cacheprovider -k cuda tests/python > "$LOGS/pytest.log" 2>&1
  echo "pytest: exit $? (124 timed out)"; tail -5 "$LOGS/pytest.log"
else
  echo "pytest: fusednorm with CUDA not importable here: CUDA pytest subset skipped"; tail -2 "$LOGS/import.err"
fi

stamp "gpu_bench"
# FUSEDNORM_CUDA_LOG_PLANS=1: every distinct launch plan with the grid the backend sized from
# the occupancy answer (resident CTAs per SM), into gpu_bench.err (logs.tar.gz).
if ! FUSEDNORM_CUDA_LOG_PLANS=1 timeout 120 "$BUILD/gpu_bench" > "$OUT/fusednorm.csv" 2> "$LOGS/gpu_bench.err"; then
  grep -v "^fusednorm: cuda plan:" "$LOGS/gpu_bench.err" | tail -20; echo "gpu_bench FAILED"
fi
# The peers get what is left after keeping 240 s for the sanitizers (SANITIZE=1), 30 s to 120 s.
reserve=0
[ "${SANITIZE:-0}" != 0 ] && reserve=240
budget=$(($(left) - reserve - 60))
((budget > 120)) && budget=120
((budget < 30)) && budget=30
stamp "peers (budget $budget s)"
timeout $((budget + 120)) python3 bench/gpu/peers.py "$OUT/fusednorm.csv" "$OUT/bench.csv" --budget "$budget" \
  2> "$LOGS/peers.err" | tee "$OUT/table.txt"
grep -v "^peers: liger\|^peers: fusednorm" "$LOGS/peers.err" | tail -5

# SANITIZE=1: the GPU tests again under compute-sanitizer (works on the Firecracker
# machines, not on gVisor: KINDS.md), on the quick sweep (every D, so every kernel kind, at
# most 3 rows; the staged-backward test keeps 301 rows). Each tool is time-boxed to its share
# of what is left before the deadline (at most 150 s), racecheck last with all that is left:
# on the first H200 run memcheck and synccheck were quick and clean, and racecheck, second
# then, ran out of its 129 s box with the run ending 114 s before its deadline.
sanitize_rc=0
if [ "${SANITIZE:-0}" != 0 ]; then
  tests_bin=$BUILD/fusednorm/tests/cuda/fusednorm_cuda_tests
  tools=(memcheck synccheck racecheck)
  for i in "${!tools[@]}"; do
    tool=${tools[$i]}
    box=$((($(left) - 10) / (${#tools[@]} - i)))
    ((box > 150 && i + 1 < ${#tools[@]})) && box=150
    if ((box < 20)); then echo "$tool: not run (deadline)"; sanitize_rc=1; continue; fi
    stamp "compute-sanitizer --tool $tool (quick sweep, $box s box)"
    FUSEDNORM_TEST_QUICK=1 timeout "$box" compute-sanitizer --tool "$tool" --error-exitcode 3 \
      "$tests_bin" > "$LOGS/sanitize-$tool.log" 2>&1
    rc=$?
    echo "$tool: exit $rc (0 clean, 3 sanitizer errors, 124 timed out)"
    ((rc != 0)) && sanitize_rc=1
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Invalid|Race|hazard|FAILED|PASSED" "$LOGS/sanitize-$tool.log" | head -8
  done
fi
stamp "done (ctest exit $ctest_rc, sanitizers $sanitize_rc); CSV: $OUT/bench.csv"
pack_logs
exit $((ctest_rc != 0 || sanitize_rc != 0))

#!/usr/bin/env bash
# Create or update the Python environment for fusednorm's PyTorch package, then build and
# install the package into it. Idempotent: a second run only rebuilds what changed.
#
#   scripts/setup_python.sh            # venv at .venv, CPU-only extension
#   FUSEDNORM_CUDA=ON scripts/setup_python.sh   # also build the CUDA backend and kernels
#
# Environment:
#   VENV            where the virtual environment lives (default: <repo>/.venv)
#   PYTHON          interpreter that creates it (default: python3; needs >= 3.10)
#   FUSEDNORM_CUDA  ON to build the CUDA backend into the extension (default OFF here:
#                   compiling CUDA is slow and most CI machines have no GPU)
#   FUSEDNORM_TORCH_SPEC  pip requirement for torch (default torch==2.11.0)
#
# Every package is pinned to the version the test suite and the benchmark were last run
# with (2026-11-30), so a fresh machine gets what CI tested; bump them together, after
# running scripts/test.sh. onnxruntime (with onnx to build its model) is the CPU peer of
# `python -m fusednorm.bench`, whose smoke test runs it.
#
# Why torch is installed with its dependencies: the PyPI wheel is a CUDA build whose
# libtorch_cuda.so links libcufile, libcusparseLt and libnvshmem_host; with --no-deps
# `import torch` fails on a machine without them, even for CPU work. The full install is
# ~4.6 GB but takes about a minute on a fast mirror, and pip's cache makes later runs cheap.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${FUSEDNORM_TORCH_SPEC:-torch==2.11.0}"
export FUSEDNORM_CUDA="${FUSEDNORM_CUDA:-OFF}"
# At most two compile jobs: the torch headers make each translation unit ~1 GB of RAM.
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}"

if [[ ! -f /usr/include/hwy/highway.h ]] || ! command -v cmake >/dev/null; then
  echo "setup_python: the C++ build prerequisites are missing (cmake, libhwy-dev);" \
       "run scripts/setup.sh first" >&2
  exit 1
fi

step() { printf '\n==> %s\n' "$*"; }
now() { date +%s; }
t0=$(now)

if [[ ! -x "$VENV/bin/python" ]]; then
  step "creating virtual environment $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

step "installing $TORCH_SPEC and the test/benchmark tools"
t=$(now)
"${PIP[@]}" install -q \
  "$TORCH_SPEC" \
  "scikit-build-core==1.1.2" \
  "numpy==2.4.6" "pytest==9.2.0" "transformers==5.24.0" "matplotlib==3.11.2" "psutil==7.2.2" \
  "onnx==1.23.2" "onnxruntime==1.32.0"
echo "    dependencies: $(( $(now) - t )) s"

if [[ "$FUSEDNORM_CUDA" == "ON" ]] && ! command -v nvcc >/dev/null && [[ -x /usr/local/cuda/bin/nvcc ]]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi
step "building and installing fusednorm (FUSEDNORM_CUDA=$FUSEDNORM_CUDA)"
t=$(now)
# --no-build-isolation: build against the torch installed above (the extension must match
# its ABI exactly) and reuse scikit-build-core's persistent build directory for
# incremental rebuilds.
"${PIP[@]}" install -q --no-build-isolation --no-deps "$ROOT"
echo "    fusednorm: $(( $(now) - t )) s"

"$VENV/bin/python" - <<'EOF'
import torch, fusednorm
print(f"    torch {torch.__version__}, fusednorm {fusednorm.__version__}, "
      f"CUDA kernels: {fusednorm.has_cuda()}, library: {fusednorm.library_path()}")
EOF
echo "==> done in $(( $(now) - t0 )) s"

#!/usr/bin/env bash
# Installs NVIDIA's cuobjdump and nvdisasm from PyPI into build/sass-tools (a virtual
# environment; links in build/sass-tools/bin), for the SASS checks of the CUDA build
# (tests/cuda/check_sass.py, the ctest `cuda_sass`). The CUDA toolkit's own packages are not
# needed: the 13.4 wheels read nvcc 13.0's sm_80 and sm_90 code. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=build/sass-tools
specs=(nvidia-cuda-cuobjdump==13.4.92 nvidia-cuda-nvdisasm==13.4.92)

if [ -x "$venv/bin/cuobjdump" ] && [ -x "$venv/bin/nvdisasm" ] &&
  "$venv/bin/python" -m pip show -q "${specs[@]%%==*}" >/dev/null 2>&1; then
  exit 0
fi
if ! python3 -c 'import ensurepip, venv' 2>/dev/null; then
  echo "setup_sass_tools: installing python3-venv"
  sudo_cmd=""
  [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq python3 python3-venv >/dev/null
fi
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check "${specs[@]}"
bin="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/nvidia/cu13/bin"
for tool in cuobjdump nvdisasm; do
  [ -x "$bin/$tool" ] || { echo "setup_sass_tools: $bin/$tool missing from the wheel" >&2; exit 1; }
  ln -sf "$bin/$tool" "$venv/bin/$tool"
done
"$venv/bin/cuobjdump" --version | tail -1

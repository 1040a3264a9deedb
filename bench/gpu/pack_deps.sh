#!/usr/bin/env bash
# Run HERE (the dev machine), not on the device: copies the build dependencies the device
# image may lack (Highway, GoogleTest: headers, libraries, CMake packages) from this
# machine's Debian packages into build-deps/ (ignored by git via /build*/), and downloads
# Liger-Kernel's wheel (a peer in the benchmark; pure Python over the torch and Triton the
# device has) into .whl/ (ignored). The device call carries both; run.sh uses each only
# when present.
set -euo pipefail
cd "$(dirname "$0")/../.."
rm -rf build-deps
mkdir -p build-deps
for pkg in libhwy-dev libhwy1 libgtest-dev; do
  dpkg -L "$pkg" | while read -r f; do
    if [ -f "$f" ] || [ -L "$f" ]; then
      mkdir -p "build-deps$(dirname "$f")"
      cp -P "$f" "build-deps$f"  # symbolic links stay links (libhwy.so -> libhwy.so.1)
    fi
  done
done
du -sh build-deps
# Liger-Kernel: optional (needs PyPI here); the table then lacks its column.
rm -rf .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl liger-kernel==0.8.5 \
  || echo "pack_deps: Liger-Kernel wheel not downloaded; the benchmark runs without it"
ls .whl 2> /dev/null

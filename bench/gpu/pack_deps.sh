#!/usr/bin/env bash
# Run HERE (the dev machine), not on the device: copies the build dependencies the device
# image may lack (Highway, GoogleTest: headers, libraries, CMake packages) from this
# machine's Debian packages into build-deps/ (ignored by git via /build*/), which the
# device call carries. run.sh uses it only when present.
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

#!/usr/bin/env bash
# Copies what one device run of bench/gpu/run.sh brought back into the repository, so that it
# can be committed before anything else happens: the device tool's files live outside the
# repository and vanish with the session (the nineteenth session's first H200 run was lost
# that way, docs/PERFORMANCE.md).
#
#   bash bench/gpu/save_run.sh FILES_AT [NAME]
#
# FILES_AT: the folder the device tool reported (files_at). NAME: the folder under
# docs/gpu-runs/ (default: UTC date and time, and the commit). Copies table.txt, bench.csv,
# fusednorm.csv and gpu.txt as they are, and from logs.tar.gz the ctest and pytest logs, the
# peers' and gpu_bench's stderr (its launch-plan lines included) and the last 200 lines of
# each sanitizer log (their reports can run to megabytes). Prints what it saved.
set -euo pipefail
cd "$(dirname "$0")/../.."
src=${1:?usage: bench/gpu/save_run.sh FILES_AT [NAME]}
[ -d "$src" ] || { echo "save_run: $src is not a folder" >&2; exit 2; }
name=${2:-$(date -u +%Y-%m-%d-%H%M)-$(git rev-parse --short HEAD)}
dest=docs/gpu-runs/$name
mkdir -p "$dest"
for f in table.txt bench.csv fusednorm.csv gpu.txt; do
  if [ -f "$src/$f" ]; then cp "$src/$f" "$dest/"; else echo "save_run: no $f in $src" >&2; fi
done
if [ -f "$src/logs.tar.gz" ]; then
  logs=$(mktemp -d)
  tar xzf "$src/logs.tar.gz" -C "$logs"
  for f in ctest.log pytest.log peers.err gpu_bench.err import.err build-torch.log; do
    [ -f "$logs/$f" ] && cp "$logs/$f" "$dest/"
  done
  for f in "$logs"/sanitize-*.log; do
    [ -f "$f" ] && tail -200 "$f" > "$dest/$(basename "$f")"
  done
  rm -rf "$logs"
else
  echo "save_run: no logs.tar.gz in $src" >&2
fi
ls -la "$dest"
echo "save_run: now commit it: git add $dest && git commit -m \"GPU run $name\""

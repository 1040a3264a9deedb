#!/usr/bin/env bash
# The CPU figures of docs/PERFORMANCE.md: fusednorm-bench (fused kernels only) on the shapes
# the targets are set for (16384 x 4096, 2048 x 8192, 65536 x 128: every operator, forward
# and backward; 1 x 4096 forward; rms_norm_quant at the first two), every dtype, on the CPU's
# native SIMD target and on AVX2.
# Prints one markdown table; the raw JSON lines go to build/bench_cpu.jsonl.
#
# Environment:
#   FUSEDNORM_BENCH         the binary (default build/release/tools/fusednorm-bench)
#   FUSEDNORM_BENCH_BEFORE  a second binary (e.g. built from an older commit): every case runs
#                           on it right before the same case on FUSEDNORM_BENCH, so both see
#                           the same machine load, and the table gets a "before" column
#   TARGETS                 Highway targets to run (default: "native AVX2"; native = the best
#                           this CPU supports; a target the CPU lacks is skipped)
#   THREADS                 default 2;  REPEAT  timed runs per case, default 15;
#   ROUNDS                  how many times the whole list is run (default 1)
set -euo pipefail
cd "$(dirname "$0")/.."
bench=${FUSEDNORM_BENCH:-build/release/tools/fusednorm-bench}
before=${FUSEDNORM_BENCH_BEFORE:-}
[ -x "$bench" ] || scripts/setup.sh >/dev/null
out=build/bench_cpu.jsonl
mkdir -p build
: > "$out"
repeat=${REPEAT:-15}
threads=${THREADS:-2}
rounds=${ROUNDS:-1}
targets=${TARGETS:-native AVX2}

# One case on one binary; its JSON lines get "which" (before / after) and the round.
run_one() {
  local which=$1 binary=$2 target=$3 round=$4
  shift 4
  local flags=()
  # Older binaries have no --fused-only; they also time the stepwise baseline (dropped below).
  "$binary" --help 2>&1 | grep -q -- --fused-only && flags+=(--fused-only)
  local env_target=()
  [ "$target" = native ] || env_target=(FUSEDNORM_CPU_TARGET="$target")
  env "${env_target[@]}" "$binary" --threads "$threads" --repeat "$repeat" --json "${flags[@]}" "$@" |
    grep '"impl": "fused"' |
    sed "s/^{/{\"which\": \"$which\", \"round\": $round, \"requested_target\": \"$target\", /" >> "$out" || true
}
run() {
  local target=$1 round=$2
  shift 2
  [ -z "$before" ] || run_one before "$before" "$target" "$round" "$@"
  run_one after "$bench" "$target" "$round" "$@"
}

for round in $(seq "$rounds"); do
  for target in $targets; do
    if [ "$target" != native ] && ! FUSEDNORM_CPU_TARGET="$target" "$bench" --rows 1 --dim 64 \
        --op rms_norm --fused-only --repeat 1 --json >/dev/null 2>&1; then
      echo "bench_cpu: target $target is not available on this CPU, skipped" >&2
      continue
    fi
    for dtype in fp32 fp16 bf16; do
      run "$target" "$round" --rows 1 --dim 4096 --dtype "$dtype" --op rms_norm --repeat 2000
      for shape in "16384 4096" "2048 8192" "65536 128"; do
        set -- $shape
        # Every operator on the same inputs (one setup per shape).
        run "$target" "$round" --rows "$1" --dim "$2" --dtype "$dtype" --op all
        # The quantized norm (int8 / e4m3, static / dynamic) on the shapes its targets are for.
        [ "$2" = 128 ] || run "$target" "$round" --rows "$1" --dim "$2" --dtype "$dtype" --op rms_norm_quant
      done
    done
  done
done

python3 - "$out" "$before" <<'PY'
import json, sys
from collections import defaultdict
rows = [json.loads(line) for line in open(sys.argv[1])]
have_before = bool(sys.argv[2])
cases = defaultdict(lambda: defaultdict(list))
order = []
for r in rows:
    # The target the new binary reports (older ones know no FUSEDNORM_CPU_TARGET and run
    # their best target, and say so only in the text output).
    target = r.get("target", r["requested_target"])
    key = (r["requested_target"], r["op"], r["dtype"], r["rows"], r["D"])
    if key not in cases:
        order.append(key)
    cases[key][r["which"]].append(r)
    if r["which"] == "after" or "target" not in cases[key]:
        cases[key]["target"] = target
threads = rows[0]["threads"] if rows else 0
print(f"CPU: {threads} threads; % is of the copy ceiling (the faster of memcpy and a non-temporal")
print("copy of x's size, same threads) measured between the runs of the same case and binary;")
print("several values = one per round (ROUNDS).")
head = "| target | op | dtype | rows x D |"
if have_before:
    head += " before µs | before % of copy |"
head += " µs | % of copy | extra bytes | max abs err |"
print(head)
print("|" + "---|" * (head.count("|") - 1))
fmt = lambda rs, f: " / ".join(f(r) for r in rs) if rs else "–"
for key in order:
    c = cases[key]
    after = c["after"]
    line = f"| {c['target']} | {key[1]} | {key[2]} | {key[3]} x {key[4]} |"
    if have_before:
        line += (f" {fmt(c['before'], lambda r: '%.1f' % r['median_us'])} |"
                 f" {fmt(c['before'], lambda r: '%.0f%%' % r['pct_of_memcpy'])} |")
    line += (f" {fmt(after, lambda r: '%.1f' % r['median_us'])} |"
             f" {fmt(after, lambda r: '%.0f%%' % r['pct_of_memcpy'])} |"
             f" {fmt(after, lambda r: str(r['extra_bytes']))} |"
             f" {fmt(after, lambda r: '%.2g' % r['max_abs_err'])} |")
    print(line)
PY

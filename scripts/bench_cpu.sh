#!/usr/bin/env bash
# The CPU figures of docs/PERFORMANCE.md: fusednorm-bench on the default LLaMA-7B layer case
# and on the shapes the targets are set for, every dtype, all hardware threads. Prints one
# markdown table; the raw JSON lines go to build/bench_cpu.jsonl.
set -euo pipefail
cd "$(dirname "$0")/.."
bench=${FUSEDNORM_BENCH:-build/release/tools/fusednorm-bench}
[ -x "$bench" ] || scripts/setup.sh >/dev/null
out=build/bench_cpu.jsonl
: > "$out"
repeat=${REPEAT:-15}
run() { "$bench" --repeat "$repeat" --json "$@" >> "$out"; }
run --rows 512 --dim 4096 --dtype fp16
for dtype in fp32 fp16 bf16; do run --rows 16384 --dim 4096 --dtype "$dtype"; done
run --rows 65536 --dim 128 --dtype bf16 --op rms_norm
run --rows 1 --dim 1048576 --dtype fp32 --op rms_norm
run --rows 1 --dim 1048576 --dtype fp32 --op rms_norm_backward
python3 - "$out" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
print(f"CPU: {rows[0]['threads']} threads; % is of the copy ceiling measured between the runs of each case")
print("| op | impl | dtype | rows x D | median µs | GB/s | copy GB/s | % of copy | extra bytes | max abs err |")
print("|---|---|---|---|---|---|---|---|---|---|")
for r in rows:
    print(f"| {r['op']} | {r['impl']} | {r['dtype']} | {r['rows']} x {r['D']} | {r['median_us']:.1f} | "
          f"{r['gbps']:.1f} | {r['memcpy_gbps']:.1f} | {r['pct_of_memcpy']:.0f}% | {r['extra_bytes']} | {r['max_abs_err']:.2g} |")
PY

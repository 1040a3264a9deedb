#!/usr/bin/env bash
# Plants known GPU bugs in the CUDA sources, one at a time, and checks that the emulated GPU
# suite (tests/cuda_emu) fails on each: a survivor is a bug the suite would let through.
# Not part of CI (every mutant is a rebuild).
#
#   tests/cuda_emu/mutants.sh                 # every mutant
#   tests/cuda_emu/mutants.sh NAME...         # some (names: the first column of the table)
#   tests/cuda_emu/mutants.sh --list
#
# Works on a scratch copy of the work tree (the tracked and untracked, not ignored files) in
# $MUTANTS_DIR (default build/mutants), never on the work tree itself. Builds only
# fusednorm_cuda_emu_tests there, and runs it under each schedule of SCHEDULES with the
# same race-focused selection as ctest's emulated.schedule.* runs (FUSEDNORM_TEST_QUICK=1).
# Prints a table: mutant -> killed (by which schedules) or survived. MUTANTS_BASELINE=0 skips
# checking first that the unmutated suite passes under every schedule. EMU_ENV: extra
# VAR=value settings for every run, e.g. EMU_ENV="FUSEDNORM_EMU_REGISTERS=128 FUSEDNORM_EMU_SMS=1"
# (the low-occupancy device model of ctest's emulated.schedule.random_3; the planner mutant
# occupancy-slots needs it: at the default model the occupancy answer is the thread count).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
work="${MUTANTS_DIR:-$root/build/mutants}"
schedules=(${SCHEDULES:-forward reverse warp-greedy random:1 random:2 random:3})
timeout_s="${MUTANT_TIMEOUT:-900}"
jobs="${JOBS:-2}"

# ---- The mutants: name, file, the exact text replaced (must occur once), its replacement --

names=() files=() olds=() news=() whys=()
mutant() { names+=("$1"); files+=("$2"); olds+=("$3"); news+=("$4"); whys+=("$5"); }

mutant team-sum-reuse-barrier src/cuda/norm_common.cuh \
'  __syncthreads();  // the previous call'"'"'s readers are done with scratch
' '' \
"team_sum's first __syncthreads() deleted: a fast warp overwrites scratch while others still read the previous call's totals"

mutant cluster-dsmem-reuse src/cuda/norm_common.cuh \
'    // read (the next call writes it only after this barrier).
    cluster.sync();' \
'    // read (the next call writes it only after this barrier).
    __syncthreads();' \
"row_total's second cluster.sync() made a CTA barrier: a CTA rewrites its cluster_slot while another CTA still reads it"

mutant combine-reuse-barrier src/cuda/norm_backward.cuh \
'  __syncthreads();  // combine is reused by the next call' '' \
"write_partial_row's closing barrier deleted: the db call rewrites combine while the dw call still reads it"

mutant finish-barrier src/cuda/finish.cu \
'  lane_sums[threadIdx.y][threadIdx.x] = s;
  __syncthreads();' \
'  lane_sums[threadIdx.y][threadIdx.x] = s;' \
"finish_column_sums_kernel reads the other lanes' sums without waiting for them"

mutant partial-slot src/cuda/norm_backward.cuh \
'  const std::int64_t slot = blockIdx.x / slice.cluster_size;' \
'  const std::int64_t slot = slice.rank;' \
"staged backward writes its dw / db partial row to the slot of its rank, not of its cluster"

mutant vector-tail src/cuda/norm_forward.cuh \
'      if (row_ok && j < nvec) {
        v[k].load(x + j * kVec);' \
'      if (row_ok && j <= nvec) {
        v[k].load(x + j * kVec);' \
"forward register rows load one vector past the row end into the statistics"

mutant alignment-check src/cuda/launch_plan.cpp \
'    if (p != nullptr && reinterpret_cast<std::uintptr_t>(p) % 16 != 0) return false;' \
'    if (p == nullptr) continue;' \
"can_vectorize no longer checks the pointers: 16-byte accesses at unaligned addresses"

mutant rstd-wrong-row src/cuda/norm_backward.cuh \
'      rstd = row_ok ? a.rstd[row] : 0.0f;' \
'      rstd = row_ok ? a.rstd[g * blockDim.y] : 0.0f;' \
"backward register rows use the rstd of their CTA's first row"

mutant addend-wrong-row src/cuda/norm_backward.cuh \
'    v.load(row_ptr<T>(a.dx_addend, row, a.dx_addend_stride) + j * kVec);' \
'    v.load(row_ptr<T>(a.dx_addend, 0, a.dx_addend_stride) + j * kVec);' \
"the fused add's backward adds row 0's dx addend to every row"

mutant schedule-order-sum src/cuda/norm_backward.cuh \
'  const int row_floats = team * kK * kVec;' \
'  if (threadIdx.y == 0) {
    for (int k = 0; k < kK; ++k) {
      const std::int64_t j = threadIdx.x + std::int64_t{k} * team;
      if (j < nvec) store_floats(acc[k], dst + j * kVec);
    }
  }
  __syncthreads();
  if (threadIdx.y != 0) {
    for (int k = 0; k < kK; ++k) {
      const std::int64_t j = threadIdx.x + std::int64_t{k} * team;
      for (int i = 0; i < kVec && j < nvec; ++i) atomicAdd(dst + j * kVec + i, acc[k][i]);
    }
  }
  if (combine != nullptr) return;
  const int row_floats = team * kK * kVec;' \
"the CTA's rows are added into its dw / db partial row with atomicAdd, in the order the warps arrive (not deterministic)"

mutant occupancy-slots src/cuda/launch_plan.cpp \
'    plan.partial_slots = plan.grid;' \
'    plan.partial_slots = clamp_grid(std::min<std::int64_t>(
        {groups, std::int64_t{d.sm_count} * std::max(1, kBackwardThreadsPerSm / plan.threads_per_cta), slot_limit}));' \
"backward register rows: the grid from the occupancy answer, the dw / db partial slots from the thread-only count (the finishing kernel sums slots no CTA wrote)"

mutant quant-amax-unreduced src/cuda/norm_forward.cuh \
'        team_reduce<MaxOp>(amax, team, scratch);
' '' \
"quantized forward (register rows): the amax reduction deleted, so each thread scales by its own columns' amax"

mutant quant-cluster-amax src/cuda/norm_forward.cuh \
'        row_total<kStorage, MaxOp>(amax, scratch, cluster_slot);' \
'        row_total<RowStorage::kSmem, MaxOp>(amax, scratch, cluster_slot);' \
"quantized forward (staged rows): the amax reduced over the CTA only, not the cluster, so each CTA of a cluster scales by its slice's amax"

if [[ "${1:-}" == "--list" ]]; then
  for i in "${!names[@]}"; do printf '%-24s %s\n' "${names[$i]}" "${whys[$i]}"; done
  exit 0
fi
selected=()
if [[ $# -gt 0 ]]; then
  for want in "$@"; do
    found=0
    for i in "${!names[@]}"; do [[ "${names[$i]}" == "$want" ]] && selected+=("$i") && found=1; done
    [[ $found -eq 1 ]] || { echo "mutants.sh: no mutant named $want (--list)" >&2; exit 2; }
  done
else
  selected=("${!names[@]}")
fi

# ---- Scratch copy and baseline ----------------------------------------------------------

src="$work/src" build="$work/build"
mkdir -p "$src"
# The work tree as it is (committed or not), without build outputs.
(cd "$root" && git ls-files -z --cached --others --exclude-standard | tar --null -T - -cf -) | tar -C "$src" -xf -
cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DFUSEDNORM_CUDA=OFF -DFUSEDNORM_BUILD_TOOLS=OFF >/dev/null
binary="$build/tests/cuda_emu/fusednorm_cuda_emu_tests"
# ctest's selection for the racing schedules (tests/cuda_emu/CMakeLists.txt).
filter="$(sed -n 's/^FUSEDNORM_EMU_RACE_FILTER:STRING=//p' "$build/CMakeCache.txt")"

build_tests() { cmake --build "$build" --target fusednorm_cuda_emu_tests -j"$jobs" >"$work/build.log" 2>&1; }

# Runs the suite under one schedule; 0 when it passes.
run_suite() {
  env ${EMU_ENV:-} FUSEDNORM_EMU_SCHEDULE="$1" FUSEDNORM_TEST_QUICK=1 timeout "$timeout_s" "$binary" --gtest_brief=1 \
    --gtest_filter="$filter" ${fail_fast:+--gtest_fail_fast} >"$work/run.log" 2>&1
}

fail_fast=""
echo "mutants.sh: baseline build in $build"
build_tests || { echo "mutants.sh: the unmutated sources do not build (see $work/build.log)" >&2; exit 1; }
for s in "${schedules[@]}"; do
  [[ "${MUTANTS_BASELINE:-1}" == 1 ]] || break
  if ! run_suite "$s"; then
    echo "mutants.sh: the unmutated suite fails under $s (see $work/run.log)" >&2
    exit 1
  fi
done

# ---- Each mutant: apply, rebuild, run every schedule, restore ---------------------------

# Replaces the text exactly once, or fails.
apply() {
  python3 - "$1" "$2" "$3" <<'EOF'
import sys
path, old, new = sys.argv[1:4]
text = open(path).read()
if text.count(old) != 1:
    sys.exit(f"{path}: the mutated text occurs {text.count(old)} times, not once")
open(path, "w").write(text.replace(old, new))
EOF
}

results=()
fail_fast=1  # a mutant's run stops at its first failed test
for i in "${selected[@]}"; do
  name="${names[$i]}" file="$src/${files[$i]}"
  cp "$file" "$work/original"
  trap 'cp "$work/original" "'"$file"'"' EXIT
  if ! apply "$file" "${olds[$i]}" "${news[$i]}"; then
    results+=("$name|does not apply|")
  elif ! build_tests; then
    cp "$work/build.log" "$work/$name.build.log"
    results+=("$name|does not build|see $work/$name.build.log")
  else
    killers=()
    for s in "${schedules[@]}"; do
      run_suite "$s" || killers+=("$s")
      cp "$work/run.log" "$work/$name.$s.log"
    done
    if [[ ${#killers[@]} -gt 0 ]]; then
      results+=("$name|killed|${killers[*]}")
    else
      results+=("$name|SURVIVED|")
    fi
  fi
  cp "$work/original" "$file"
  touch "$file"  # rebuilt with the original at the next build
  trap - EXIT
  echo "mutants.sh: ${results[-1]}"
done
build_tests || true  # leave the scratch build unmutated

printf '\n| mutant | result | killed by (%s%s) |\n| --- | --- | --- |\n' "${schedules[*]}" "${EMU_ENV:+; $EMU_ENV}"
survivors=0
for r in "${results[@]}"; do
  IFS='|' read -r name verdict by <<<"$r"
  printf '| %s | %s | %s |\n' "$name" "$verdict" "$by"
  [[ "$verdict" == killed ]] || survivors=$((survivors + 1))
done
exit $((survivors > 0 ? 1 : 0))

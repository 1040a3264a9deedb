#!/usr/bin/env python3
"""Static checks of the machine code (SASS) of every CUDA kernel in a build.

    check_sass.py --cuobjdump PATH --planner src/cuda/launch_plan.h BINARY...

BINARY: objects, libraries or executables with CUDA code (e.g. libfusednorm.a). For every
kernel of every architecture compiled in, it asserts:
  - no local memory: no LDL / STL instructions and no stack frame (register spills);
  - 128-bit global loads and stores (LDG.E.128 / STG.E.128) in the register-row and staged
    kernels of full 16-byte vectors, for each dtype (and that such kernels were found, so
    the check cannot pass on an empty build); the quantized forward (ForwardVariant's kQuant)
    stores q, 1 byte per element, with the same vector width: 128-bit loads, 64-bit stores
    (STG.E.64) for 16-bit dtypes, and no byte stores (STG.E.U8 / .S8) in either;
  - registers per thread within what the launch planner's CTAs of that kernel allow
    (kRegistersPerSm / the most threads per CTA it launches the family with, launch_plan.h):
    the largest CTA must launch at all. That is the one register assumption the planner
    makes; how many CTAs are resident per SM below it is the CUDA runtime's answer for the
    launched kernel (cudaOccupancyMaxActiveBlocksPerMultiprocessor, ResidentCtas in
    launch_plan.h), with which the persistent grids are sized. The summary prints, per family,
    the CTAs of its largest size resident per SM at its most registers, for the record: more
    registers cost resident CTAs (a longer grid), not correctness.
A failure names the kernel (demangled) and the architecture. cuobjdump and nvdisasm come
from PyPI (nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm); scripts/setup_sass_tools.sh
installs them.
"""
import argparse
import collections
import os
import re
import subprocess
import sys

# Kernel family (by template name) -> the launch_plan.h constant for the most threads per CTA
# the planner launches it with; with kRegistersPerSm, that bounds its registers per thread.
FAMILIES = {
    "norm_forward_register_kernel": "kMaxThreadsPerCta",
    # The quantized register row under __maxnreg__(kQuantRegisterCap) (an A/B: PlanOptions::
    # quant_register_cap); its budget is the cap too (REGISTER_CAPS).
    "norm_forward_register_capped_kernel": "kMaxThreadsPerCta",
    "norm_forward_row_kernel": "kMaxThreadsPerCta",
    "norm_backward_register_kernel": "kMaxThreadsPerCta",
    "norm_backward_row_kernel": "kMaxThreadsPerCta",
    "norm_backward_coef_kernel": "kTwoPassThreads",
    "norm_backward_tile_kernel": "kTileThreads",
    "finish_column_sums_kernel": "kFinishThreads",
    # float64 (norm_f64.cu): checked for spills and registers only. A verification dtype,
    # one double per access by design, so not in VECTORIZED.
    "forward_f64_kernel": "kFloat64Threads",
    "row_stats_f64_kernel": "kFloat64Threads",
    "weight_grads_f64_kernel": "kFloat64Threads",
    "dx_f64_kernel": "kFloat64Threads",
}
MAX_REGISTERS = 255  # per thread, by the instruction set
# Families compiled under __maxnreg__: the launch_plan.h constant that caps their registers.
REGISTER_CAPS = {"norm_forward_register_capped_kernel": "kQuantRegisterCap"}
# Families whose full-vector instantiations must move 16 bytes per global access.
VECTORIZED = ["norm_forward_register_kernel", "norm_forward_register_capped_kernel", "norm_forward_row_kernel",
              "norm_backward_register_kernel", "norm_backward_row_kernel"]
QUANT_ONLY = {"norm_forward_register_capped_kernel"}  # families instantiated for kQuant only
ELEM_BYTES = {"float": 4, "__half": 2, "__nv_bfloat16": 2}
ROW_STORAGE = {"0": "kSmem", "1": "kCluster", "2": "kGlobal"}


def run(cmd):
    result = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if result.returncode != 0:
        sys.exit(f"check_sass: {' '.join(cmd)} failed:\n{result.stderr}")
    return result.stdout


def planner_budgets(header):
    """Family -> (registers per thread the planner's launches allow, why)."""
    text = open(header).read()

    def constant(name):
        m = re.search(r"constexpr\s+int\s+" + name + r"\s*=\s*(\d+)\s*;", text)
        if m is None:
            sys.exit(f"check_sass: {header} defines no {name}")
        return int(m.group(1))

    per_sm = constant("kRegistersPerSm")
    budgets = {}
    for family, threads_name in FAMILIES.items():
        threads = constant(threads_name)
        budgets[family] = (min(MAX_REGISTERS, per_sm // threads),
                           f"kRegistersPerSm / {threads_name} = {per_sm} / {threads}", threads)
        if family in REGISTER_CAPS:
            cap = constant(REGISTER_CAPS[family])
            if cap < budgets[family][0]:
                budgets[family] = (cap, f"__maxnreg__({REGISTER_CAPS[family]} = {cap})", threads)
    return budgets


def resident_ctas(regs, threads, per_sm=65536, max_threads=2048, max_ctas=32):
    """CTAs of `threads` resident per SM at `regs` per thread (allocated per warp in units of
    8 per thread), by registers and threads only: what the occupancy calculator says for a
    kernel without dynamic shared memory."""
    warp_threads = (threads + 31) // 32 * 32
    return min(max_ctas, max_threads // warp_threads, per_sm // ((regs + 7) // 8 * 8 * warp_threads))


def split_template_args(args):
    out, depth, cur = [], 0, ""
    for ch in args:
        if ch in "<(":
            depth += 1
        elif ch in ">)":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


class Kernel:
    def __init__(self, arch, mangled, demangled):
        self.arch, self.mangled, self.demangled = arch, mangled, demangled
        self.family, self.args = None, []
        m = re.search(r"fusednorm::cuda::(?:\(anonymous namespace\)::)?(\w+)(?:<(.*)>)?\(", demangled)
        if m:
            self.family = m.group(1)
            self.args = split_template_args(m.group(2)) if m.group(2) else []
        self.regs = self.stack = self.local = None
        self.instructions = []

    @property
    def dtype(self):
        return self.args[0] if self.args else None

    def full_vector(self):
        return self.dtype in ELEM_BYTES and len(self.args) > 1 and self.args[1] == str(16 // ELEM_BYTES[self.dtype])

    def quantized(self):
        """The quantized forward: ForwardVariant's fifth argument (kQuant) is true."""
        for a in self.args:
            m = re.fullmatch(r"fusednorm::cuda::ForwardVariant<(.*)>", a)
            if m:
                flags = split_template_args(m.group(1))
                return len(flags) == 5 and flags[4] == "true"
        return False

    def storage(self):
        for a in self.args:
            m = re.fullmatch(r"\(fusednorm::cuda::RowStorage\)(\d)", a)
            if m:
                return ROW_STORAGE[m.group(1)]
        return None

    def name(self):
        return f"{self.demangled} [{self.arch}]"


def demangle(names):
    if not names:
        return {}
    out = subprocess.run(["c++filt"], input="\n".join(names), stdout=subprocess.PIPE, text=True, check=True).stdout
    return dict(zip(names, out.splitlines()))


def collect(cuobjdump, binary):
    kernels = {}  # (arch, mangled) -> Kernel
    res = run([cuobjdump, "-res-usage", binary])
    sass = run([cuobjdump, "-sass", binary])
    names = set(re.findall(r"Function (\S+?):?\s*$", res, re.M)) | set(re.findall(r"Function : (\S+)", sass))
    pretty = demangle(sorted(names))

    def kernel(arch, mangled):
        key = (arch, mangled)
        if key not in kernels:
            kernels[key] = Kernel(arch, mangled, pretty.get(mangled, mangled))
        return kernels[key]

    arch, current = None, None
    for line in res.splitlines():
        m = re.match(r"\s*arch = (sm_\d+\w*)", line)
        if m:
            arch = m.group(1)
            continue
        m = re.match(r"\s*Function (\S+):\s*$", line)
        if m:
            current = kernel(arch, m.group(1))
            continue
        m = re.match(r"\s*REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", line)
        if m and current is not None:
            current.regs, current.stack, current.local = (int(g) for g in m.groups())
            current = None
    arch, current = None, None
    for line in sass.splitlines():
        m = re.match(r"\s*arch = (sm_\d+\w*)", line)
        if m:
            arch = m.group(1)
            continue
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            current = kernel(arch, m.group(1))
            continue
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if m and current is not None:
            current.instructions.append(m.group(1))
    return list(kernels.values())


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cuobjdump", required=True)
    parser.add_argument("--planner", required=True, help="src/cuda/launch_plan.h")
    parser.add_argument("binaries", nargs="+")
    args = parser.parse_args()
    for tool in (args.cuobjdump, os.path.join(os.path.dirname(args.cuobjdump), "nvdisasm")):
        if not os.access(tool, os.X_OK):
            sys.exit(f"check_sass: {tool} not found; scripts/setup_sass_tools.sh installs it from PyPI")
    budgets = planner_budgets(args.planner)
    kernels = []
    for binary in args.binaries:
        kernels += collect(args.cuobjdump, binary)

    failures = []
    found_vectorized = collections.defaultdict(set)  # arch -> {(family, dtype)}
    most_regs = collections.defaultdict(int)  # (arch, family) -> max REG
    for k in kernels:
        if k.regs is None:
            failures.append(f"{k.name()}: no resource usage from cuobjdump -res-usage")
            continue
        if k.family not in FAMILIES:
            failures.append(f"{k.name()}: a kernel of no known family (add it to FAMILIES in {__file__})")
            continue
        if not k.instructions:
            failures.append(f"{k.name()}: no SASS from cuobjdump -sass")
        most_regs[(k.arch, k.family)] = max(most_regs[(k.arch, k.family)], k.regs)
        spills = [i for i in k.instructions if i.startswith(("LDL", "STL"))]
        if spills or k.stack or k.local:
            failures.append(f"{k.name()}: local memory (register spills?): {len(spills)} LDL/STL, "
                            f"STACK:{k.stack} LOCAL:{k.local}")
        budget, why, _ = budgets[k.family]
        if k.regs > budget:
            failures.append(f"{k.name()}: {k.regs} registers per thread; the planner's CTAs of this kernel "
                            f"launch only at <= {budget} ({why}, {args.planner})")
        # Cluster kernels compile to a __trap() below sm_90, where the planner never launches them.
        cluster_stub = k.storage() == "kCluster" and int(re.sub(r"\D", "", k.arch)[:2]) < 90
        if k.family in VECTORIZED and k.full_vector() and k.storage() != "kGlobal" and not cluster_stub:
            found_vectorized[k.arch].add((k.family, k.dtype, k.quantized()))
            wanted = [("LDG", "128")]
            if not k.quantized():
                wanted.append(("STG", "128"))
            elif ELEM_BYTES[k.dtype] == 2:
                wanted.append(("STG", "64"))  # 8 q bytes per 16-byte vector of x
            for op, bits in wanted:
                if not any(re.fullmatch(op + r"(\.\w+)*\." + bits + r"(\.\w+)*", i) for i in k.instructions):
                    failures.append(f"{k.name()}: no {bits}-bit {op} ({op}.E.{bits}): its vectors are split")
            if k.quantized():
                byte_stores = [i for i in k.instructions if re.fullmatch(r"STG(\.\w+)*\.[US]8(\.\w+)*", i)]
                if byte_stores:
                    failures.append(f"{k.name()}: {len(byte_stores)} byte stores ({byte_stores[0]}): q's "
                                    "vector store is split")
    archs = sorted({k.arch for k in kernels})
    if not archs:
        failures.append("no CUDA kernels found in " + " ".join(args.binaries))
    for arch in archs:
        for family in VECTORIZED:
            for dtype in ELEM_BYTES:
                if family in QUANT_ONLY:
                    variants = (True,)
                elif family.startswith("norm_forward"):
                    variants = (False, True)
                else:
                    variants = (False,)
                for quantized in variants:
                    if (family, dtype, quantized) not in found_vectorized[arch]:
                        what = ", quantized" if quantized else ""
                        failures.append(f"{family}<{dtype}, full vector{what}> [{arch}]: not found, so not checked")

    print(f"check_sass: {len(kernels)} kernels in {', '.join(archs)}; most registers per thread by family, "
          "and the CTAs of the family's largest size resident per SM at that count:")
    for (arch, family), regs in sorted(most_regs.items()):
        budget, threads = budgets[family][0], budgets[family][2]
        print(f"  {arch} {family:32s} {regs:4d} (launches at <= {budget}; "
              f"{resident_ctas(regs, threads)} x {threads} threads per SM)")
    for f in failures:
        print("FAIL: " + f)
    print(f"check_sass: {len(kernels)} kernels checked, {len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

"""RMSNorm from PyTorch: fusednorm against what a PyTorch user has, on the same tensors.

    python -m fusednorm.bench                    # CUDA when available, else the CPU
    python -m fusednorm.bench --device cpu --dtypes bf16 --shapes 16384x4096 --modes fwd

Implementations:
  stepwise       Hugging Face LlamaRMSNorm's sequence (upcast, pow, mean, rsqrt, multiply,
                 cast, multiply by weight), eager
  torch_rms_norm torch.nn.functional.rms_norm
  torch_compile  torch.compile of the stepwise code (Inductor)
  fusednorm      fusednorm.rms_norm (a fresh output tensor per call)
  fusednorm_out  fusednorm.rms_norm(..., out=y) into a tensor allocated once (forward only)
  onnxruntime    onnxruntime, CPU only, when installed (forward only): RMSNormalization of
                 the standard opset 23, and com.microsoft SkipSimplifiedLayerNormalization
                 for the fused add; inputs and outputs pre-bound with io_binding to the
                 torch tensors' memory, so it neither copies nor allocates per call
Modes: fwd (y = f(x, w)), fwdbwd (forward, then y.backward(dy): dx and dw) and fused_add
(residual += x in place, y = rms_norm(residual); onnxruntime writes the sum to a second
pre-bound buffer instead, the same traffic).

Columns: median wall time of one call in µs over --repeats timed calls (after warm-up; the
implementations take turns call by call; on CUDA with a synchronize around each call); GB/s
of the minimum traffic (fwd: read x, write y, read w; fwdbwd adds read x and dy, write dx
and dw; fused_add: read x and residual, write residual and y, read w), the same byte count
for every implementation; speed-up against stepwise; peak extra memory: the highest amount
of memory allocated during one call beyond what existed before it (outputs, saved
activations, temporaries, gradients). On CUDA that is torch.cuda.max_memory_allocated; on
the CPU it is replayed from the allocation events of torch.profiler(profile_memory=True),
which see every allocation made through PyTorch's allocator (fusednorm's outputs and
workspace included; not onnxruntime's own, shown as '–').

Per-call cost (--overhead, on by default): 1 x 4096 calls timed in batches of 1000, for
torch.add(x, 1), the raw operator torch.ops.fusednorm.rms_norm, the Python function
fusednorm.rms_norm, both with out=, and onnxruntime's run_with_iobinding; with the ratios the
targets are stated in. A chart of GB/s against D for each implementation (forward, one
dtype) goes to --chart.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from dataclasses import dataclass

import torch

import fusednorm

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
IMPLS = ("stepwise", "torch_rms_norm", "torch_compile", "fusednorm", "fusednorm_out", "onnxruntime")
# Implementations that return the output in a buffer they were given: forward modes only.
PREBOUND = ("fusednorm_out", "onnxruntime")
EPS = 1e-6


def stepwise(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(input_dtype)


def stepwise_fused_add(x, residual, weight, eps):
    residual.add_(x)
    return stepwise(residual, weight, eps)


def torch_rms_norm(x, weight, eps):
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)


def torch_fused_add(x, residual, weight, eps):
    residual.add_(x)
    return torch_rms_norm(residual, weight, eps)


@dataclass
class Case:
    """The tensors of one (dtype, shape): every implementation works on the same ones."""

    x: torch.Tensor
    w: torch.Tensor
    dy: torch.Tensor
    residual: torch.Tensor
    y: torch.Tensor  # the pre-bound output of fusednorm_out / onnxruntime
    residual_sum: torch.Tensor  # onnxruntime's fused-add sum output (it cannot write in place)


class OrtRmsNorm:
    """onnxruntime on the CPU with every input and output bound to the torch tensors'
    memory (io_binding), so that run() neither copies nor allocates."""

    _ELEMENT = {torch.float32: 1, torch.float16: 10, torch.bfloat16: 16}  # TensorProto

    def __init__(self, case: Case, fused_add: bool, threads: int) -> None:
        import onnxruntime as ort
        from onnx import TensorProto, helper

        x = case.x
        elem = self._ELEMENT[x.dtype]
        shape = list(x.shape)
        if fused_add:
            node = helper.make_node(
                "SkipSimplifiedLayerNormalization", ["x", "skip", "w"],
                ["y", "", "", "sum"], domain="com.microsoft", epsilon=EPS)
            inputs = ["x", "skip", "w"]
            outputs = ["y", "sum"]
            opsets = [helper.make_opsetid("", 23), helper.make_opsetid("com.microsoft", 1)]
        else:
            node = helper.make_node("RMSNormalization", ["x", "w"], ["y"], axis=-1,
                                    epsilon=EPS, stash_type=1)
            inputs, outputs = ["x", "w"], ["y"]
            opsets = [helper.make_opsetid("", 23)]
        dims = {"x": shape, "skip": shape, "w": [shape[-1]], "y": shape, "sum": shape}
        graph = helper.make_graph(
            [node], "fusednorm_bench",
            [helper.make_tensor_value_info(n, elem, dims[n]) for n in inputs],
            [helper.make_tensor_value_info(n, elem, dims[n]) for n in outputs])
        model = helper.make_model(graph, opset_imports=opsets)
        model.ir_version = 10
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        self.session = ort.InferenceSession(model.SerializeToString(), options,
                                            providers=["CPUExecutionProvider"])
        self.binding = self.session.io_binding()
        tensors = {"x": x, "skip": case.residual, "w": case.w, "y": case.y,
                   "sum": case.residual_sum}
        for n in inputs:
            t = tensors[n]
            self.binding.bind_input(n, "cpu", 0, elem, list(t.shape), t.data_ptr())
        for n in outputs:
            t = tensors[n]
            self.binding.bind_output(n, "cpu", 0, elem, list(t.shape), t.data_ptr())
        self.y = case.y

    def __call__(self, *unused):
        self.session.run_with_iobinding(self.binding)
        return self.y


def onnxruntime_version() -> str | None:
    try:
        import onnx  # noqa: F401
        import onnxruntime
    except ImportError:
        return None
    return onnxruntime.__version__


def make_impls(wanted, case: Case, mode: str, compiled: dict, device: torch.device) -> dict:
    """name -> callable(case) for one mode; implementations that cannot run it are left out."""
    x, w, residual, y = case.x, case.w, case.residual, case.y
    impls = {}
    if mode == "fused_add":
        impls["stepwise"] = lambda: stepwise_fused_add(x, residual, w, EPS)
        impls["torch_rms_norm"] = lambda: torch_fused_add(x, residual, w, EPS)
        if "torch_compile" in compiled:
            fn = compiled["torch_compile_fused_add"]
            impls["torch_compile"] = lambda: fn(x, residual, w, EPS)
        impls["fusednorm"] = lambda: fusednorm.fused_add_rms_norm(x, residual, w, EPS)
        impls["fusednorm_out"] = lambda: fusednorm.fused_add_rms_norm(x, residual, w, EPS, out=y)
    else:
        impls["stepwise"] = lambda: stepwise(x, w, EPS)
        impls["torch_rms_norm"] = lambda: torch_rms_norm(x, w, EPS)
        if "torch_compile" in compiled:
            fn = compiled["torch_compile"]
            impls["torch_compile"] = lambda: fn(x, w, EPS)
        impls["fusednorm"] = lambda: fusednorm.rms_norm(x, w, EPS)
        if mode == "fwd":
            impls["fusednorm_out"] = lambda: fusednorm.rms_norm(x, w, EPS, out=y)
    if "onnxruntime" in wanted and mode != "fwdbwd" and device.type == "cpu" and onnxruntime_version():
        try:
            impls["onnxruntime"] = OrtRmsNorm(case, mode == "fused_add", torch.get_num_threads())
        except Exception as e:  # e.g. a dtype this onnxruntime has no CPU kernel for
            print(f"  onnxruntime: {mode} {x.dtype} not run: {str(e).splitlines()[0][:160]}",
                  file=sys.stderr)
    return {name: impls[name] for name in IMPLS if name in impls and name in wanted}


@dataclass
class Result:
    dtype: str
    rows: int
    cols: int
    mode: str
    impl: str
    median_us: float
    gbps: float
    peak_extra_bytes: int | None
    error: float  # normalized max error of y against fp64 on a sample of rows


def parse_shape(text: str) -> tuple[int, int]:
    rows, _, cols = text.lower().partition("x")
    return int(rows), int(cols)


def traffic_bytes(rows: int, cols: int, dtype: torch.dtype, mode: str) -> int:
    item = torch.empty((), dtype=dtype).element_size()
    matrix = rows * cols * item
    if mode == "fwd":
        return 2 * matrix + cols * item
    if mode == "fused_add":
        return 4 * matrix + cols * item
    return 5 * matrix + 2 * cols * item


class Runner:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def call(self, fn, case: Case, mode: str):
        if mode != "fwdbwd":
            with torch.no_grad():
                return fn()
        y = fn()
        y.backward(case.dy)
        return y

    @staticmethod
    def clear(case: Case) -> None:
        # Outside the measured window: freeing the previous gradients is not the call's cost.
        case.x.grad = None
        case.w.grad = None

    def time_once(self, fn, case: Case, mode: str) -> float:
        self.clear(case)
        self.sync()
        start = time.perf_counter()
        y = self.call(fn, case, mode)
        self.sync()
        elapsed = time.perf_counter() - start
        del y
        return elapsed

    def peak_extra_bytes(self, fn, case: Case, mode: str) -> int:
        self.clear(case)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            y = self.call(fn, case, mode)
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
            del y
            return peak
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            y = self.call(fn, case, mode)
        del y
        events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
        events.sort(key=lambda e: e.start_ns())
        live = peak = 0
        for e in events:  # nbytes: + allocation, - free
            live += e.nbytes()
            peak = max(peak, live)
        return peak


def normalized_error(y: torch.Tensor, h: torch.Tensor, w: torch.Tensor, sample: int = 64) -> float:
    hs = h[:sample].detach().double()
    ref = hs * torch.rsqrt(hs.pow(2).mean(-1, keepdim=True) + EPS) * w.detach().double()
    got = y[:sample].detach().double()
    return ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def make_case(device, dtype, rows, cols) -> Case:
    gen = torch.Generator(device="cpu").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(device, dtype)

    w = (1 + 0.1 * torch.randn(cols, generator=gen)).to(device, dtype)
    x = randn(rows, cols)
    case = Case(x=x, w=w, dy=randn(rows, cols), residual=randn(rows, cols),
                y=torch.empty_like(x), residual_sum=torch.empty_like(x))
    case.y.zero_()  # touched once, as a reused buffer is
    case.residual_sum.zero_()
    return case


def check_error(fn, case: Case, mode: str) -> float:
    """Error of one call's y against fp64, on a copy of the residual (fused_add mutates it)."""
    saved = case.residual.clone() if mode == "fused_add" else None
    with torch.no_grad() if mode != "fwdbwd" else torch.enable_grad():
        y = fn()
    if mode == "fused_add":
        h = (saved.double() + case.x.double())
        case.residual.copy_(saved)
    else:
        h = case.x
    err = normalized_error(y, h, case.w)
    return err


def run_case(runner, wanted, compiled, dtype_name, rows, cols, modes, repeats, warmup, results, log):
    dtype = DTYPES[dtype_name]
    case = make_case(runner.device, dtype, rows, cols)
    for mode in modes:
        case.x.requires_grad_(mode == "fwdbwd")
        case.w.requires_grad_(mode == "fwdbwd")
        impls = make_impls(wanted, case, mode, compiled, runner.device)
        t0 = time.perf_counter()
        times: dict[str, list[float]] = {name: [] for name in impls}
        for name, fn in impls.items():  # warm-up (and torch.compile's compilation)
            for _ in range(warmup):
                runner.time_once(fn, case, mode)
        # Round robin: every implementation sees the same machine conditions, so a burst of
        # other work on the machine cannot favour whichever ran at a quiet moment.
        for _ in range(repeats):
            for name, fn in impls.items():
                times[name].append(runner.time_once(fn, case, mode))
        for name, fn in impls.items():
            us = statistics.median(times[name]) * 1e6
            runner.clear(case)
            err = check_error(fn, case, mode)
            peak = None if name == "onnxruntime" else runner.peak_extra_bytes(fn, case, mode)
            gbps = traffic_bytes(rows, cols, dtype, mode) / (us * 1e-6) / 1e9
            results.append(Result(dtype_name, rows, cols, mode, name, us, gbps, peak, err))
            log(f"  {dtype_name} {rows}x{cols} {mode:9s} {name:15s} {us:12.1f} µs")
        log(f"    ({repeats} rounds, {time.perf_counter() - t0:.1f} s)")
    case.x.grad = case.w.grad = None


def auto_repeats(rows: int, cols: int, requested: int | None) -> int:
    if requested:
        return requested
    # Enough calls for a stable median without spending minutes on the big shapes.
    elements = rows * cols
    return max(5, min(200, int(2e8 // max(elements, 1))))


def print_table(results: list[Result], header: str) -> None:
    print(header)
    print("| dtype | rows×D | mode | impl | median µs | GB/s | vs stepwise | peak extra MB | err |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|")
    base = {(r.dtype, r.rows, r.cols, r.mode): r.median_us for r in results if r.impl == "stepwise"}
    for r in results:
        ref = base.get((r.dtype, r.rows, r.cols, r.mode))
        speedup = f"{ref / r.median_us:.2f}x" if ref else "–"
        peak = "–" if r.peak_extra_bytes is None else f"{r.peak_extra_bytes / 2**20:.1f}"
        print(
            f"| {r.dtype} | {r.rows}×{r.cols} | {r.mode} | {r.impl} | {r.median_us:.1f} | "
            f"{r.gbps:.2f} | {speedup} | {peak} | {r.error:.1e} |"
        )


def print_ratios(results: list[Result]) -> None:
    """The issue's PyTorch targets, as ratios of this run: fusednorm_out faster than
    onnxruntime with a pre-bound output; fusednorm (fresh outputs) faster than torch.compile."""
    by = {(r.dtype, r.rows, r.cols, r.mode, r.impl): r.median_us for r in results}
    cases = sorted({(r.dtype, r.rows, r.cols, r.mode) for r in results},
                   key=lambda c: (list(DTYPES).index(c[0]), c[1:]))
    lines = []
    for dtype, rows, cols, mode in cases:
        def t(impl):
            return by.get((dtype, rows, cols, mode, impl))

        parts = []
        for ours, peer in (("fusednorm_out", "onnxruntime"), ("fusednorm", "torch_compile"),
                           ("fusednorm", "torch_rms_norm"), ("fusednorm_out", "fusednorm")):
            if t(ours) is not None and t(peer) is not None:
                ratio = t(peer) / t(ours)
                parts.append(f"{ours} {ratio:.2f}x {peer}" + ("" if ratio >= 1 else " (slower)"))
        if parts:
            lines.append(f"  {dtype} {rows}x{cols} {mode}: " + "; ".join(parts))
    if lines:
        print("\nSpeed ratios (peer time / fusednorm time; > 1: fusednorm faster)")
        print("\n".join(lines))


def time_per_call(fns: dict, calls: int = 1000, batches: int = 21) -> dict[str, float]:
    """Median µs per call over `batches` batches of `calls` back-to-back calls, the
    candidates taking turns batch by batch."""
    for fn in fns.values():
        for _ in range(calls // 10):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(batches):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            samples[name].append((time.perf_counter() - start) / calls * 1e6)
    return {name: statistics.median(v) for name, v in samples.items()}


def measure_per_call(dtype_name: str, cols: int, device: torch.device, with_ort: bool,
                     calls: int = 1000, batches: int = 21) -> dict[str, float]:
    """Per-call cost at decode size (1 x D), where the binding's overhead is most of it."""
    dtype = DTYPES[dtype_name]
    case = make_case(device, dtype, 1, cols)
    x, w, y = case.x, case.w, case.y
    raw = torch.ops.fusednorm.rms_norm
    raw_out = torch.ops.fusednorm.rms_norm.out
    fns = {
        "torch.add(x, 1)": lambda: torch.add(x, 1),
        "torch.ops.fusednorm.rms_norm": lambda: raw(x, w, EPS),
        "fusednorm.rms_norm": lambda: fusednorm.rms_norm(x, w, EPS),
        "torch.ops.fusednorm.rms_norm.out": lambda: raw_out(x, w, EPS, out=y),
        "fusednorm.rms_norm(out=)": lambda: fusednorm.rms_norm(x, w, EPS, out=y),
    }
    if with_ort and device.type == "cpu" and onnxruntime_version():
        try:
            fns["onnxruntime run_with_iobinding"] = OrtRmsNorm(case, False, torch.get_num_threads())
        except Exception as e:
            print(f"  onnxruntime: {dtype_name} not run: {str(e).splitlines()[0][:160]}",
                  file=sys.stderr)
    us = time_per_call(fns, calls, batches)
    print(f"\nPer call, 1x{cols} {dtype_name} (median of {batches} batches of {calls} calls, µs)")
    for name, t in us.items():
        print(f"  {name:34s} {t:8.2f}")
    add = us["torch.add(x, 1)"]
    print(f"  raw operator / torch.add: {us['torch.ops.fusednorm.rms_norm'] / add:.2f}x "
          f"(target <= 1.3x); Python function - raw operator: "
          f"{us['fusednorm.rms_norm'] - us['torch.ops.fusednorm.rms_norm']:+.2f} µs "
          f"(target <= 1 µs); with out=: "
          f"{us['fusednorm.rms_norm(out=)'] - us['torch.ops.fusednorm.rms_norm.out']:+.2f} µs")
    return us


def write_chart(results: list[Result], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for impl in IMPLS:
        points = sorted((r.cols, r.gbps) for r in results if r.impl == impl)
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=impl)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("D (hidden size)")
    ax.set_ylabel("GB/s (x read + y written + w)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def simd_target() -> str:
    """The Highway target the CPU kernels run (fusednorm-bench prints the same name)."""
    getter = getattr(torch.ops.fusednorm, "cpu_simd_target", None)
    if getter is None:
        return "unknown"
    try:
        return getter()
    except Exception:  # an extension built before the operator existed
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fusednorm.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="auto: CUDA when torch sees a GPU and fusednorm has CUDA kernels")
    parser.add_argument("--dtypes", default="fp32,fp16,bf16")
    parser.add_argument("--shapes", default="1x4096,16384x4096,2048x8192,65536x128",
                        help="comma-separated ROWSxD for the table")
    parser.add_argument("--modes", default="fwd,fused_add,fwdbwd")
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed calls per case (default: 5-200 depending on size)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--no-overhead", dest="overhead", action="store_false",
                        help="skip the per-call measurement at 1 x 4096")
    parser.add_argument("--chart", default="", help="PNG path of a forward sweep over D ('' = none)")
    parser.add_argument("--chart-dtype", default="bf16")
    parser.add_argument("--chart-ds", default="128,512,2048,8192,32768",
                        help="D values of the chart's forward sweep")
    parser.add_argument("--chart-mb", type=float, default=64.0,
                        help="size of x in the chart sweep, MB (rows = size / D)")
    args = parser.parse_args(argv)

    if args.device == "auto":
        device = "cuda" if torch.cuda.is_available() and fusednorm.has_cuda() else "cpu"
    else:
        device = args.device
    if device == "cuda" and not fusednorm.has_cuda():
        parser.error("fusednorm was built without CUDA kernels (FUSEDNORM_CUDA=OFF)")
    if args.threads:
        torch.set_num_threads(args.threads)
    runner = Runner(torch.device(device))

    wanted = [s for s in args.impls.split(",") if s]
    unknown = set(wanted) - set(IMPLS)
    if unknown:
        parser.error(f"unknown --impls {sorted(unknown)}; choose from {IMPLS}")
    compiled = {}
    if "torch_compile" in wanted:
        # Every (dtype, shape, grad mode) is a separate static compilation of the same code
        # object, far more than Dynamo's default limit of 8 before it falls back to eager.
        torch._dynamo.config.recompile_limit = 1024
        torch._dynamo.config.accumulated_recompile_limit = 4096
        compiled["torch_compile"] = torch.compile(stepwise, dynamic=False)
        compiled["torch_compile_fused_add"] = torch.compile(stepwise_fused_add, dynamic=False)
    dtypes = [d for d in args.dtypes.split(",") if d]
    modes = [m for m in args.modes.split(",") if m]
    shapes = [parse_shape(s) for s in args.shapes.split(",") if s]

    if device == "cpu":
        machine = (f"CPU ({simd_target()}), {torch.get_num_threads()} threads "
                   "(torch.get_num_threads)")
        try:  # other work on the machine skews CPU timings: say so
            machine += ", load average %.2f %.2f %.2f" % os.getloadavg()
        except OSError:
            pass
        if os.environ.get("THP_MEM_ALLOC_ENABLE"):
            machine += f", THP_MEM_ALLOC_ENABLE={os.environ['THP_MEM_ALLOC_ENABLE']}"
    else:
        machine = torch.cuda.get_device_name()
    ort = onnxruntime_version() if device == "cpu" and "onnxruntime" in wanted else None
    header = (
        f"fusednorm {fusednorm.__version__} / torch {torch.__version__}"
        f"{f' / onnxruntime {ort}' if ort else ''} on {machine}\n"
        f"median of timed calls, GB/s of minimum traffic, peak extra memory "
        f"({'torch.cuda.max_memory_allocated' if device == 'cuda' else 'torch.profiler allocation events'}), "
        f"err = max|y - fp64| / max|fp64| on 64 rows\n"
    )
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    warnings.filterwarnings("ignore", module="torch.profiler")

    results: list[Result] = []
    for dtype_name in dtypes:
        for rows, cols in shapes:
            run_case(runner, wanted, compiled, dtype_name, rows, cols, modes,
                     auto_repeats(rows, cols, args.repeats), args.warmup, results, log)
    print()
    print_table(results, header)
    print_ratios(results)
    if args.overhead:
        for dtype_name in dtypes:
            measure_per_call(dtype_name, 4096, runner.device, "onnxruntime" in wanted)

    if args.chart:
        sweep: list[Result] = []
        item = torch.empty((), dtype=DTYPES[args.chart_dtype]).element_size()
        for d in (int(v) for v in args.chart_ds.split(",") if v):
            rows = max(1, int(args.chart_mb * 2**20 // (d * item)))
            run_case(runner, wanted, compiled, args.chart_dtype, rows, d, ["fwd"],
                     auto_repeats(rows, d, args.repeats), args.warmup, sweep, log)
        title = f"RMSNorm forward, {args.chart_dtype}, x = {args.chart_mb:g} MB\n{machine}"
        write_chart(sweep, args.chart, title)
        print()
        print_table(sweep, f"chart sweep ({args.chart}): forward, {args.chart_dtype}")
        print(f"\nchart written to {args.chart}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

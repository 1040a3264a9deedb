"""RMSNorm from PyTorch: fusednorm against what a PyTorch user has, on the same tensors.

    python -m fusednorm.bench                    # CUDA when available, else the CPU
    python -m fusednorm.bench --device cpu --dtypes bf16 --shapes 16384x4096 --modes fwd

Implementations:
  stepwise       Hugging Face LlamaRMSNorm's sequence (upcast, pow, mean, rsqrt, multiply,
                 cast, multiply by weight), eager
  torch_rms_norm torch.nn.functional.rms_norm
  torch_compile  torch.compile of the stepwise code (Inductor)
  fusednorm      fusednorm.rms_norm
Modes: fwd (y = f(x, w)) and fwdbwd (forward, then y.backward(dy): dx and dw).

Columns: median wall time of one call in µs over --repeats timed calls (after warm-up;
the implementations take turns call by call; on CUDA with a synchronize around each call); GB/s of the minimum traffic (fwd: read x,
write y, read w; fwdbwd adds read x and dy, write dx and dw), the same byte count for every
implementation; speed-up against stepwise; peak extra memory: the highest amount of memory
allocated during one call beyond what existed before it (outputs, saved activations,
temporaries, gradients). On CUDA that is torch.cuda.max_memory_allocated; on the CPU it is
replayed from the allocation events of torch.profiler(profile_memory=True), which see every
allocation made through PyTorch's allocator (fusednorm's outputs and workspace included). A
chart of GB/s against D for each implementation (forward, one dtype) goes to --chart.
"""

from __future__ import annotations

import argparse
import os
import warnings
import statistics
import sys
import time
from dataclasses import dataclass

import torch

import fusednorm

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
IMPLS = ("stepwise", "torch_rms_norm", "torch_compile", "fusednorm")
EPS = 1e-6


def stepwise(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(input_dtype)


def make_impls(use_compile: bool) -> dict:
    impls = {
        "stepwise": stepwise,
        "torch_rms_norm": lambda x, w, eps: torch.nn.functional.rms_norm(x, (x.shape[-1],), w, eps),
        "fusednorm": fusednorm.rms_norm,
    }
    if use_compile:
        # Every (dtype, shape, grad mode) is a separate static compilation of the same code
        # object, far more than Dynamo's default limit of 8 before it falls back to eager.
        torch._dynamo.config.recompile_limit = 1024
        torch._dynamo.config.accumulated_recompile_limit = 4096
        impls["torch_compile"] = torch.compile(stepwise, dynamic=False)
    return {name: impls[name] for name in IMPLS if name in impls}


@dataclass
class Result:
    dtype: str
    rows: int
    cols: int
    mode: str
    impl: str
    median_us: float
    gbps: float
    peak_extra_bytes: int
    error: float  # normalized max error of y against fp64 on a sample of rows


def parse_shape(text: str) -> tuple[int, int]:
    rows, _, cols = text.lower().partition("x")
    return int(rows), int(cols)


def traffic_bytes(rows: int, cols: int, dtype: torch.dtype, mode: str) -> int:
    item = torch.empty((), dtype=dtype).element_size()
    fwd = 2 * rows * cols * item + cols * item
    if mode == "fwd":
        return fwd
    return fwd + 3 * rows * cols * item + cols * item


class Runner:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def call(self, fn, x, w, dy, mode):
        if mode == "fwd":
            with torch.no_grad():
                return fn(x, w, EPS)
        y = fn(x, w, EPS)
        y.backward(dy)
        return y

    @staticmethod
    def clear(x, w) -> None:
        # Outside the measured window: freeing the previous gradients is not the call's cost.
        x.grad = None
        w.grad = None

    def time_once(self, fn, x, w, dy, mode) -> float:
        self.clear(x, w)
        self.sync()
        start = time.perf_counter()
        y = self.call(fn, x, w, dy, mode)
        self.sync()
        elapsed = time.perf_counter() - start
        del y
        return elapsed

    def peak_extra_bytes(self, fn, x, w, dy, mode) -> int:
        self.clear(x, w)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            y = self.call(fn, x, w, dy, mode)
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
            del y
            return peak
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            y = self.call(fn, x, w, dy, mode)
        del y
        events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
        events.sort(key=lambda e: e.start_ns())
        live = peak = 0
        for e in events:  # nbytes: + allocation, - free
            live += e.nbytes()
            peak = max(peak, live)
        return peak


def normalized_error(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, sample: int = 64) -> float:
    xs = x[:sample].detach().double()
    ref = xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + EPS) * w.detach().double()
    got = y[:sample].detach().double()
    return ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def run_case(runner, impls, dtype_name, rows, cols, modes, repeats, warmup, results, log):
    dtype = DTYPES[dtype_name]
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(rows, cols, generator=gen, dtype=torch.float32).to(runner.device, dtype)
    w = (1 + 0.1 * torch.randn(cols, generator=gen)).to(runner.device, dtype)
    dy = torch.randn(rows, cols, generator=gen, dtype=torch.float32).to(runner.device, dtype)
    for mode in modes:
        x.requires_grad_(mode == "fwdbwd")
        w.requires_grad_(mode == "fwdbwd")
        t0 = time.perf_counter()
        times: dict[str, list[float]] = {name: [] for name in impls}
        for name, fn in impls.items():  # warm-up (and torch.compile's compilation)
            for _ in range(warmup):
                runner.time_once(fn, x, w, dy, mode)
        # Round robin: every implementation sees the same machine conditions, so a burst of
        # other work on the machine cannot favour whichever ran at a quiet moment.
        for _ in range(repeats):
            for name, fn in impls.items():
                times[name].append(runner.time_once(fn, x, w, dy, mode))
        for name, fn in impls.items():
            us = statistics.median(times[name]) * 1e6
            runner.clear(x, w)
            with torch.no_grad() if mode == "fwd" else torch.enable_grad():
                y = fn(x, w, EPS)
            err = normalized_error(y, x, w)
            del y
            peak = runner.peak_extra_bytes(fn, x, w, dy, mode)
            gbps = traffic_bytes(rows, cols, dtype, mode) / (us * 1e-6) / 1e9
            results.append(Result(dtype_name, rows, cols, mode, name, us, gbps, peak, err))
            log(f"  {dtype_name} {rows}x{cols} {mode:6s} {name:15s} {us:12.1f} µs")
        log(f"    ({repeats} rounds, {time.perf_counter() - t0:.1f} s)")
    x.grad = w.grad = None


def auto_repeats(rows: int, cols: int, requested: int | None) -> int:
    if requested:
        return requested
    # Enough calls for a stable median without spending minutes on the big shapes.
    elements = rows * cols
    return max(5, min(50, int(2e8 // max(elements, 1))))


def print_table(results: list[Result], header: str) -> None:
    print(header)
    print("| dtype | rows×D | mode | impl | median µs | GB/s | vs stepwise | peak extra MB | err |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|")
    base = {(r.dtype, r.rows, r.cols, r.mode): r.median_us for r in results if r.impl == "stepwise"}
    for r in results:
        ref = base.get((r.dtype, r.rows, r.cols, r.mode))
        speedup = f"{ref / r.median_us:.2f}x" if ref else "–"
        print(
            f"| {r.dtype} | {r.rows}×{r.cols} | {r.mode} | {r.impl} | {r.median_us:.1f} | "
            f"{r.gbps:.2f} | {speedup} | {r.peak_extra_bytes / 2**20:.1f} | {r.error:.1e} |"
        )


def print_targets(results: list[Result], rows: int, cols: int) -> None:
    """The CPU goal: fusednorm >= 3x torch_rms_norm and >= torch_compile at 16384 x 4096."""
    by = {(r.dtype, r.mode, r.impl): r.median_us for r in results if (r.rows, r.cols) == (rows, cols)}
    lines = []
    for dtype in DTYPES:
        for mode in ("fwd", "fwdbwd"):
            ours = by.get((dtype, mode, "fusednorm"))
            if ours is None:
                continue
            parts = []
            if (t := by.get((dtype, mode, "torch_rms_norm"))) is not None:
                parts.append(f"{t / ours:.2f}x torch_rms_norm ({'ok' if t / ours >= 3 else 'BELOW 3x'})")
            if (c := by.get((dtype, mode, "torch_compile"))) is not None:
                parts.append(f"{c / ours:.2f}x torch_compile ({'ok' if c / ours >= 1 else 'BELOW 1x'})")
            lines.append(f"  {dtype} {mode}: fusednorm is " + ", ".join(parts))
    if lines:
        print(f"\nTarget at {rows}x{cols}: fusednorm >= 3x torch_rms_norm and >= torch_compile")
        print("\n".join(lines))


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fusednorm.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="auto: CUDA when torch sees a GPU and fusednorm has CUDA kernels")
    parser.add_argument("--dtypes", default="fp32,fp16,bf16")
    parser.add_argument("--shapes", default="1x4096,512x4096,16384x4096",
                        help="comma-separated ROWSxD for the table")
    parser.add_argument("--modes", default="fwd,fwdbwd")
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed calls per case (default: 5-50 depending on size)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--chart", default="fusednorm_bench.png", help="PNG path ('' = none)")
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
    impls = {k: v for k, v in make_impls("torch_compile" in wanted).items() if k in wanted}
    dtypes = [d for d in args.dtypes.split(",") if d]
    modes = [m for m in args.modes.split(",") if m]
    shapes = [parse_shape(s) for s in args.shapes.split(",") if s]

    if device == "cpu":
        machine = f"CPU, {torch.get_num_threads()} threads (torch.get_num_threads)"
        try:  # other work on the machine skews CPU timings: say so
            machine += ", load average %.2f %.2f %.2f" % os.getloadavg()
        except OSError:
            pass
    else:
        machine = torch.cuda.get_device_name()
    header = (
        f"fusednorm {fusednorm.__version__} / torch {torch.__version__} on {machine}\n"
        f"median of timed calls, GB/s of minimum traffic, peak extra memory "
        f"({'torch.cuda.max_memory_allocated' if device == 'cuda' else 'torch.profiler allocation events'}), "
        f"err = max|y - fp64| / max|fp64| on 64 rows\n"
    )
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    warnings.filterwarnings("ignore", module="torch.profiler")

    results: list[Result] = []
    for dtype_name in dtypes:
        for rows, cols in shapes:
            run_case(runner, impls, dtype_name, rows, cols, modes,
                     auto_repeats(rows, cols, args.repeats), args.warmup, results, log)
    print()
    print_table(results, header)
    print_targets(results, 16384, 4096)

    if args.chart:
        sweep: list[Result] = []
        item = torch.empty((), dtype=DTYPES[args.chart_dtype]).element_size()
        for d in (int(v) for v in args.chart_ds.split(",") if v):
            rows = max(1, int(args.chart_mb * 2**20 // (d * item)))
            run_case(runner, impls, args.chart_dtype, rows, d, ["fwd"],
                     auto_repeats(rows, d, args.repeats), args.warmup, sweep, log)
        title = f"RMSNorm forward, {args.chart_dtype}, x = {args.chart_mb:g} MB\n{machine}"
        write_chart(sweep, args.chart, title)
        print()
        print_table(sweep, f"chart sweep ({args.chart}): forward, {args.chart_dtype}")
        print(f"\nchart written to {args.chart}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

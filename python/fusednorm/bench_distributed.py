"""Training-side benchmarks: the hidden-sharded (tensor-parallel) RMSNorm against gather ->
norm -> scatter, and the fused-add training step against the unfused composite.

    python -m fusednorm.bench_distributed                  # both tables, default shapes
    python -m fusednorm.bench_distributed --table tp --world 2 --shape 4096x8192
    python -m fusednorm.bench_distributed --table fused_add --shape 16384x4096

Table "tp" (CPU, gloo, --world processes started here, one mesh dimension): x is a
rows x D DTensor sharded over D (Shard(-1)), the weight Shard(0). Two ways to normalize it:
  distributed  fusednorm.rms_norm on the sharded DTensor: per-row partial sums of squares,
               one all-reduce of one fp32 per row, each rank normalizes its slice; the
               backward all-reduces one fp32 per row again
  gather       x.redistribute(Replicate()) (all-gather), fusednorm.rms_norm on the whole
               rows, y.redistribute(Shard(-1)) (a local slice); the backward all-gathers dy
Columns: median wall time per call over --repeats (each rank times its calls between
barriers; the slowest rank's median is reported), the collectives issued per call and the
bytes each rank hands to them (the input tensors of the c10d functional collectives, as
recorded by a dispatch mode; an all-gather's output is world times its input).

Table "fused_add" (one process, torch.get_num_threads() threads): one training step of
``y, s = f(x, residual)`` then backward of (dy, ds):
  fused        fusednorm.fused_add_rms_norm(x, residual, w, inplace=False): one forward
               kernel (after a copy of residual, the functional form's) and one backward
               kernel with the addend
  composite    s = x + residual; y = fusednorm.rms_norm(s, w): autograd adds ds to the
               norm's dx in a separate pass
  torch        s = x + residual; torch.nn.functional.rms_norm(s, (D,), w): eager torch
The implementations take turns call by call; median of --repeats.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

EPS = 1e-6
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _shape(text: str) -> tuple[int, int]:
    rows, cols = text.lower().split("x")
    return int(rows), int(cols)


# ---- tensor-parallel norm ----------------------------------------------------------------


_COLLECTIVES = frozenset(
    {
        "all_reduce",
        "all_reduce_coalesced",
        "all_gather_into_tensor",
        "all_gather_into_tensor_coalesced",
        "reduce_scatter_tensor",
        "reduce_scatter_tensor_coalesced",
        "all_to_all_single",
        "broadcast",
    }
)


class _CollectiveBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Records (collective, bytes of its input tensor) for every c10d functional collective."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "_c10d_functional" and func.__name__.split(".")[0] in _COLLECTIVES:
            t = args[0]
            tensors = t if isinstance(t, (list, tuple)) else [t]
            nbytes = sum(x.numel() * x.element_size() for x in tensors)
            self.calls.append((func.__name__.split(".")[0], nbytes))
        return func(*args, **kwargs)


def _tp_worker(rank, world, port, rows, cols, dtype, repeats, queue):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import fusednorm

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)  # world processes share the machine's cores
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    x_full = torch.randn(rows, cols, generator=g).to(dtype)
    w_full = (1 + 0.1 * torch.randn(cols, generator=g)).to(dtype)
    x = distribute_tensor(x_full, mesh, [Shard(1)]).requires_grad_()
    w = distribute_tensor(w_full, mesh, [Shard(0)]).requires_grad_()
    w_rep = distribute_tensor(w_full, mesh, [Replicate()]).requires_grad_()
    dy = distribute_tensor(torch.randn(rows, cols, generator=g).to(dtype), mesh, [Shard(1)])

    def distributed(mode):
        y = fusednorm.rms_norm(x, w, EPS)
        if mode == "fwdbwd":
            y.backward(dy)
        return y

    def gather(mode):
        y = fusednorm.rms_norm(x.redistribute(mesh, [Replicate()]), w_rep, EPS)
        y = y.redistribute(mesh, [Shard(1)])
        if mode == "fwdbwd":
            y.backward(dy)
        return y

    impls = {"distributed": distributed, "gather": gather}
    # same answer both ways (fp32 tolerance: the distributed sums are reordered)
    a, b = distributed("fwd").full_tensor().float(), gather("fwd").full_tensor().float()
    err = ((a - b).abs().max() / b.abs().max()).item()
    results = {}
    for mode in ("fwd", "fwdbwd"):
        for name, fn in impls.items():
            recorder = _CollectiveBytes()
            with recorder:
                fn(mode)
            results[(mode, name, "calls")] = recorder.calls
        times = {name: [] for name in impls}
        for _ in range(repeats + 1):  # the first round warms up
            for name, fn in impls.items():
                x.grad = w.grad = w_rep.grad = None
                dist.barrier()
                t0 = time.perf_counter()
                fn(mode)
                times[name].append(time.perf_counter() - t0)
        for name in impls:
            results[(mode, name, "median_s")] = statistics.median(times[name][1:])
    results["err"] = err
    queue.put((rank, results))
    dist.barrier()
    dist.destroy_process_group()


def _fmt_bytes(n: int) -> str:
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit} ({n} B)"
    return f"{n} B"


def tp_table(world: int, rows: int, cols: int, dtype_name: str, repeats: int) -> None:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(
            target=_tp_worker,
            args=(r, world, port, rows, cols, DTYPES[dtype_name], repeats, queue),
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    per_rank = dict(queue.get() for _ in procs)
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise RuntimeError(f"bench_distributed: a rank exited with {p.exitcode}")
    from .bench import simd_target

    print(
        f"\nHidden-sharded RMSNorm, {rows}x{cols} {dtype_name}, Shard(-1) over {world} gloo "
        f"processes (CPU {simd_target()}, 1 thread each), median of {repeats}; "
        f"distributed vs gather "
        f"max normalized difference {per_rank[0]['err']:.2g}"
    )
    print("| mode | impl | median ms (slowest rank) | collectives per call | bytes per rank |")
    print("|---|---|---:|---|---:|")
    for mode in ("fwd", "fwdbwd"):
        medians = {}
        for name in ("distributed", "gather"):
            medians[name] = max(per_rank[r][(mode, name, "median_s")] for r in per_rank)
            calls = per_rank[0][(mode, name, "calls")]
            names = ", ".join(f"{op}({_fmt_bytes(n)})" for op, n in calls) or "none"
            total = sum(n for _, n in calls)
            print(f"| {mode} | {name} | {medians[name] * 1e3:.1f} | {names} | {total} |")
        print(
            f"| {mode} | gather / distributed | {medians['gather'] / medians['distributed']:.2f}x "
            "| | |"
        )


# ---- fused add training step -----------------------------------------------------------


def fused_add_table(rows: int, cols: int, dtype_names: list[str], repeats: int) -> None:
    import fusednorm

    from .bench import simd_target

    print(
        f"\nFused add + RMSNorm training step (forward + backward of y and residual_out), "
        f"{rows}x{cols}, CPU {simd_target()}, {torch.get_num_threads()} threads, "
        f"median of {repeats}"
    )
    print("| dtype | impl | median ms | vs composite | max normalized diff vs fused |")
    print("|---|---|---:|---:|---:|")
    for dtype_name in dtype_names:
        dtype = DTYPES[dtype_name]
        g = torch.Generator().manual_seed(0)
        x = torch.randn(rows, cols, generator=g).to(dtype).requires_grad_()
        r = torch.randn(rows, cols, generator=g).to(dtype).requires_grad_()
        w = (1 + 0.1 * torch.randn(cols, generator=g)).to(dtype).requires_grad_()
        dy = torch.randn(rows, cols, generator=g).to(dtype)
        ds = torch.randn(rows, cols, generator=g).to(dtype)

        def fused():
            return fusednorm.fused_add_rms_norm(x, r, w, EPS, inplace=False)

        def composite():
            s = x + r
            return fusednorm.rms_norm(s, w, EPS), s

        def eager():
            s = x + r
            return torch.nn.functional.rms_norm(s, (cols,), w, EPS), s

        impls = {"fused": fused, "composite": composite, "torch": eager}

        def step(fn):
            x.grad = r.grad = w.grad = None
            y, s = fn()
            torch.autograd.backward((y, s), (dy, ds))
            return x.grad

        reference = step(fused).float()
        diffs = {}
        for name, fn in impls.items():
            got = step(fn).float()
            diffs[name] = ((got - reference).abs().max() / reference.abs().max()).item()
        times = {name: [] for name in impls}
        for _ in range(repeats + 1):
            for name, fn in impls.items():
                t0 = time.perf_counter()
                step(fn)
                times[name].append(time.perf_counter() - t0)
        med = {name: statistics.median(t[1:]) for name, t in times.items()}
        for name in impls:
            print(
                f"| {dtype_name} | {name} | {med[name] * 1e3:.1f} | "
                f"{med['composite'] / med[name]:.2f}x | {diffs[name]:.2g} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--table", choices=("tp", "fused_add", "all"), default="all")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--tp-shape", type=_shape, default=(4096, 8192))
    parser.add_argument("--tp-dtype", choices=tuple(DTYPES), default="fp32")
    parser.add_argument("--fused-add-shape", type=_shape, default=(16384, 4096))
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    if args.table in ("tp", "all"):
        tp_table(args.world, *args.tp_shape, args.tp_dtype, args.repeats)
    if args.table in ("fused_add", "all"):
        fused_add_table(*args.fused_add_shape, args.dtypes.split(","), args.repeats)


if __name__ == "__main__":
    main()

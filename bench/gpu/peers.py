"""Peers of fusednorm on the GPU, timed like gpu_bench, merged with its CSV into one table.

Usage: python3 peers.py FUSEDNORM_CSV OUT_CSV [--budget SECONDS]

Times torch eager (F.rms_norm, add + F.rms_norm, F.layer_norm), torch.compile of the stepwise
(HF LlamaRMSNorm-style) reference, Liger-Kernel's RMSNorm / fused add / LayerNorm when
importable, and the fusednorm Python package's ops when importable with CUDA, forward and
(autograd) backward, with triton.testing.do_bench (median, L2 flushed between runs),
on the shapes and dtypes of gpu_bench, plus the same device-to-device copy. Every time is
reported with GB/s and as a percentage of the copy bandwidth measured in this run (the
fusednorm rows against gpu_bench's own copy, measured in the same job).
"""
import csv
import sys
import time

import torch
import torch.nn.functional as F
import triton.testing

SHAPES = [(1, 4096), (512, 4096), (4096, 4096), (16384, 4096), (32768, 8192), (65536, 128),
          (4096, 16384), (1024, 65536), (256, 262144)]
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
EPS = 1e-6


def bench_us(fn):
    return 1000.0 * triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median")


def stepwise_rms_norm(x, w):
    xf = x.float()
    var = xf.pow(2).mean(-1, keepdim=True)
    return w * (xf * torch.rsqrt(var + EPS)).to(x.dtype)


def stepwise_fused_add(x, r, w):
    s = x + r
    return stepwise_rms_norm(s, w), s


def load_optional():
    """Peers that may be missing there: {impl: {op: fn}}. rms_norm takes (x, w),
    fused_add_rms_norm (x, residual, w), layer_norm (x, w, b); each is also timed backward
    where it has one (autograd)."""
    extra = {}
    try:
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        extra["liger"] = {
            "rms_norm": lambda x, w: LigerRMSNormFunction.apply(x, w, EPS, 0.0, "llama"),
            "fused_add_rms_norm": lambda x, r, w: LigerFusedAddRMSNormFunction.apply(x, r, w, EPS),
            "layer_norm": lambda x, w, b: LigerLayerNormFunction.apply(x, w, b, 1e-5),
        }
    except Exception as e:  # noqa: BLE001 - any import failure means "not available"
        print(f"peers: liger_kernel not available ({type(e).__name__})", file=sys.stderr)
    try:
        import fusednorm  # the project's Python package, if built there

        if fusednorm.has_cuda():
            extra["fusednorm_py"] = {
                "rms_norm": lambda x, w: fusednorm.rms_norm(x, w, eps=EPS),
                "fused_add_rms_norm": lambda x, r, w: fusednorm.fused_add_rms_norm(x, r, w, eps=EPS),
                "layer_norm": lambda x, w, b: fusednorm.layer_norm(x, w, b, eps=1e-5),
            }
    except Exception as e:  # noqa: BLE001
        print(f"peers: fusednorm Python package not available ({type(e).__name__})", file=sys.stderr)
    return extra


def main():
    fused_csv, out_csv = sys.argv[1], sys.argv[2]
    budget = float(sys.argv[sys.argv.index("--budget") + 1]) if "--budget" in sys.argv else 150.0
    start = time.time()
    dev = torch.device("cuda")
    rows_out = []

    n = 1 << 29  # 1 GiB of bytes in uint16: the same copy as gpu_bench
    a = torch.empty(n, dtype=torch.int16, device=dev).fill_(1)
    b = torch.empty_like(a)
    copy_us = bench_us(lambda: b.copy_(a))
    copy_gbps = 2 * a.numel() * 2 / copy_us / 1e3
    del a, b
    rows_out.append(dict(impl="copy(torch)", op="copy", dtype="-", rows=1, cols=n * 2, us=copy_us, gbps=copy_gbps))

    # The backward is timed by replaying one graph (retain_graph=True). AOTAutograd's donated
    # buffers free the saved activations after the first backward and then refuse a retained
    # graph (the first H200 run: "compiled with non-empty donated buffers requires
    # create_graph=False and retain_graph=False"); off, the compiled backward is the same code.
    try:
        import torch._functorch.config as functorch_config
        functorch_config.donated_buffer = False
    except (ImportError, AttributeError):
        pass
    compiled_rms = torch.compile(stepwise_rms_norm, dynamic=True)
    compiled_add = torch.compile(stepwise_fused_add, dynamic=True)
    extra = load_optional()

    for dname, dt in DTYPES.items():
        for rows, cols in SHAPES:
            if time.time() - start > budget:
                print(f"peers: time budget {budget:.0f} s spent; stopping at {dname} {rows}x{cols}", file=sys.stderr)
                break
            es = torch.empty((), dtype=dt).element_size()
            io = rows * cols * es
            x = torch.randn(rows, cols, device=dev, dtype=dt)
            r = torch.randn_like(x)
            dy = torch.randn_like(x)
            w = torch.rand(cols, device=dev, dtype=dt) + 0.5
            bias = torch.randn(cols, device=dev, dtype=dt)

            def add(impl, op, us, nbytes):
                rows_out.append(dict(impl=impl, op=op, dtype=dname, rows=rows, cols=cols, us=us, gbps=nbytes / us / 1e3))

            def fwd(impl, fn, op="rms_norm", nbytes=2 * io + cols * es):
                try:
                    add(impl, op, bench_us(fn), nbytes)
                except Exception as e:  # noqa: BLE001 - a peer that fails is reported, not fatal
                    print(f"peers: {impl} {op} {dname} {rows}x{cols} failed: {type(e).__name__}: {e}"[:300], file=sys.stderr)

            def bwd(impl, f, op="rms_norm_backward", nbytes=3 * io + 2 * cols * es, extra_params=()):
                try:
                    xg = x.detach().requires_grad_(True)
                    wg = w.detach().requires_grad_(True)
                    params = (xg, wg) + tuple(p.detach().requires_grad_(True) for p in extra_params)
                    y = f(*params)
                    add(impl, op, bench_us(lambda: torch.autograd.grad(y, params, dy, retain_graph=True)), nbytes)
                except Exception as e:  # noqa: BLE001
                    print(f"peers: {impl} {op} {dname} {rows}x{cols} failed: {type(e).__name__}: {e}"[:300], file=sys.stderr)

            rms_bytes, add_bytes, ln_bytes = 2 * io + cols * es, 4 * io + cols * es, 2 * io + 2 * cols * es
            with torch.no_grad():
                fwd("torch", lambda: F.rms_norm(x, (cols,), w, EPS))
                fwd("torch_compile", lambda: compiled_rms(x, w))
                fwd("torch", lambda: F.rms_norm(r.add_(x), (cols,), w, EPS), "fused_add_rms_norm", add_bytes)
                fwd("torch_compile", lambda: compiled_add(x, r, w), "fused_add_rms_norm", add_bytes)
                fwd("torch", lambda: F.layer_norm(x, (cols,), w, bias, 1e-5), "layer_norm", ln_bytes)
                for name, fns in extra.items():
                    fwd(name, lambda f=fns["rms_norm"]: f(x, w), "rms_norm", rms_bytes)
                    fwd(name, lambda f=fns["fused_add_rms_norm"]: f(x, r, w), "fused_add_rms_norm", add_bytes)
                    fwd(name, lambda f=fns["layer_norm"]: f(x, w, bias), "layer_norm", ln_bytes)
            bwd("torch", lambda xg, wg: F.rms_norm(xg, (cols,), wg, EPS))
            bwd("torch_compile", lambda xg, wg: compiled_rms(xg, wg))
            bwd("torch", lambda xg, wg, bg: F.layer_norm(xg, (cols,), wg, bg, 1e-5), "layer_norm_backward",
                3 * io + 3 * cols * es, (bias,))
            for name, fns in extra.items():
                bwd(name, fns["rms_norm"])
                bwd(name, fns["layer_norm"], "layer_norm_backward", 3 * io + 3 * cols * es, (bias,))
            del x, r, dy, w, bias
            torch.cuda.empty_cache()
        else:
            continue
        break

    # fusednorm's rows, percentages against gpu_bench's copy (same job).
    fused_copy = None
    with open(fused_csv) as f:
        fused_rows = list(csv.DictReader(f))
    for row in fused_rows:
        if row["impl"] == "copy":
            fused_copy = float(row["gbps"])
    for row in rows_out:
        row["pct_copy"] = 100.0 * row["gbps"] / copy_gbps
    for row in fused_rows:
        gbps = float(row["gbps"])
        rows_out.append(dict(impl=row["impl"], op=row["op"], dtype=row["dtype"], rows=int(row["rows"]),
                             cols=int(row["cols"]), us=float(row["us"]), gbps=gbps,
                             pct_copy=100.0 * gbps / fused_copy if fused_copy else float("nan"), plan=row.get("plan", "")))

    with open(out_csv, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["impl", "op", "dtype", "rows", "cols", "us", "gbps", "pct_copy", "plan"])
        writer.writeheader()
        for row in rows_out:
            writer.writerow({k: (f"{v:.3f}" if isinstance(v, float) else v) for k, v in row.items()})

    # One table: op x dtype x shape rows, one column per implementation: "us (pct%)".
    ops = ["rms_norm", "fused_add_rms_norm", "layer_norm", "rms_norm_backward", "layer_norm_backward"]
    impls = []
    for row in rows_out:
        if row["op"] in ops and row["impl"] not in impls:
            impls.append(row["impl"])
    cell = {}
    for row in rows_out:
        cell[(row["op"], row["dtype"], row["rows"], row["cols"], row["impl"])] = row
    print(f"copy bandwidth: gpu_bench {fused_copy or float('nan'):.0f} GB/s, torch {copy_gbps:.0f} GB/s (read + write)")
    for row in fused_rows:
        if row["impl"] == "empty_kernel":
            print(f"empty kernel (events, L2 flushed): {float(row['us']):.2f} us")
    header = ["op", "dtype", "rows x D", "MB"] + impls
    print(" | ".join(header))
    for op in ops:
        for dname in DTYPES:
            for rows, cols in SHAPES:
                key = (op, dname, rows, cols)
                if not any(key + (i,) in cell for i in impls):
                    continue
                es = torch.empty((), dtype=DTYPES[dname]).element_size()
                line = [op, dname, f"{rows}x{cols}", f"{rows * cols * es / 1e6:.1f}"]
                for i in impls:
                    c = cell.get(key + (i,))
                    line.append("-" if c is None else f"{c['us']:.1f} ({c['pct_copy']:.0f}%)")
                print(" | ".join(line))

    # The quantized RMSNorm (issue 9): fusednorm only (no peer here), vLLM's shapes, beside
    # the unquantized op of the same shape. Bytes: x read + q written (+ residual, weight, scales).
    quant = [r for r in fused_rows if "_quant_" in r["op"]]
    if quant:
        print()
        # fusednorm_regcap: the register rows capped at kQuantRegisterCap (gpu_bench.cu).
        print("quantized RMSNorm: impl | op | dtype | rows x D | us | % of copy | plan")
        for row in quant:
            gbps = float(row["gbps"])
            pct = 100.0 * gbps / fused_copy if fused_copy else float("nan")
            print(f"{row['impl']} | {row['op']} | {row['dtype']} | {row['rows']}x{row['cols']} | "
                  f"{float(row['us']):.1f} | {pct:.0f}% | {row.get('plan', '')}")


if __name__ == "__main__":
    main()

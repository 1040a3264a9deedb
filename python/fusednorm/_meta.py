"""Fake (meta) kernels and autograd formulas of the torch.ops.fusednorm operators.

The C++ extension names this module (``set_python_module``) and torch checks that these
registrations come from it. ``import fusednorm`` imports it; a library loaded with
``torch.ops.load_library`` alone runs eagerly but needs ``import fusednorm`` (which then
does not load the library again) for torch.compile, fake tensors and autograd.

Fake kernels mirror the C++ conventions exactly (opcheck compares them): outputs are new
contiguous tensors of x's shape and dtype, per-row statistics are fp32 of shape
``x.shape[:-1]``, absent gradients are empty ``[0]`` tensors of x's dtype. They also repeat
the cheap argument checks, so torch.compile reports a bad call while tracing.

Autograd: rms_norm, rms_norm_fwd, layer_norm and layer_norm_fwd are differentiable, their
backward being the fused backward operators (which are not differentiable themselves: no
double backward). fused_add_rms_norm mutates ``residual`` and has no autograd formula (torch
only accepts formulas for functional operators); its functional form fused_add_rms_norm_fwd
(no input mutated) is differentiable, with a backward that adds the gradient reaching
residual_out inside rms_norm_backward (``dx_addend``). The two-phase operators of the
hidden-sharded norm (``*_partial_sum*``, ``*_from_sum*``) are building blocks without autograd:
fusednorm.distributed composes them, with the all-reduce between, into autograd Functions.
"""

from __future__ import annotations

import torch
from torch.library import register_autograd, register_fake

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _check_x(op: str, x: torch.Tensor, name: str = "x") -> None:
    torch._check(
        x.dtype in _FLOATS,
        lambda: f"fusednorm::{op}: argument '{name}': dtype {x.dtype} is not supported "
        "(expected float32, float16 or bfloat16)",
    )
    torch._check(
        x.dim() >= 1,
        lambda: f"fusednorm::{op}: argument '{name}': must have at least one dimension",
    )
    torch._check(
        x.shape[-1] >= 1,
        lambda: f"fusednorm::{op}: argument '{name}': last dimension D must be >= 1",
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
    return _row_stats(x)


@register_fake("fusednorm::fused_add_partial_sum_squares")
def _fused_add_partial_sum_squares_fake(x, residual):
    _check_x("fused_add_partial_sum_squares", x)
    _check_like_x("fused_add_partial_sum_squares", "residual", residual, x)
    return x.new_empty(x.shape), _row_stats(x)


@register_fake("fusednorm::rms_norm_from_sum_squares")
def _rms_norm_from_sum_squares_fake(x, weight, sum_squares, full_cols, eps=1e-6, weight_offset=0.0):
    _check_x("rms_norm_from_sum_squares", x)
    _check_vector("rms_norm_from_sum_squares", "weight", weight, x)
    return x.new_empty(x.shape), _row_stats(x)


@register_fake("fusednorm::rms_norm_backward_partial_sums")
def _rms_norm_backward_partial_sums_fake(dy, x, weight, rstd, weight_offset=0.0):
    _check_x("rms_norm_backward_partial_sums", x)
    _check_like_x("rms_norm_backward_partial_sums", "dy", dy, x)
    _check_vector("rms_norm_backward_partial_sums", "weight", weight, x)
    return _row_stats(x)


@register_fake("fusednorm::rms_norm_backward_from_sums")
def _rms_norm_backward_from_sums_fake(
    dy, x, weight, rstd, sum_g_xhat, full_cols, weight_offset=0.0, compute_dw=True,
    dx_addend=None,
):
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


@register_fake("fusednorm::layer_norm_backward")
def _layer_norm_backward_fake(
    dy, x, weight, mean, rstd, eps=1e-5, compute_dw=True, compute_db=True
):
    _check_x("layer_norm_backward", x)
    _check_like_x("layer_norm_backward", "dy", dy, x)
    _check_vector("layer_norm_backward", "weight", weight, x)
    dw = weight.new_empty(weight.shape) if weight is not None and compute_dw else _absent(x)
    if compute_db:
        db = (weight if weight is not None else x).new_empty((x.shape[-1],))
    else:
        db = _absent(x)
    return x.new_empty(x.shape), dw, db


# ---- autograd ------------------------------------------------------------------------


def _as(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == like.dtype else t.to(like.dtype)


def _rms_setup(ctx, inputs, output):
    x, weight, eps, weight_offset = inputs
    rstd = output[1] if isinstance(output, tuple) else None
    ctx.eps = eps
    ctx.weight_offset = weight_offset
    ctx.save_for_backward(x, weight, rstd)
    if rstd is not None:
        ctx.mark_non_differentiable(rstd)


def _rms_backward(ctx, dy, *unused_drstd):
    # rstd is an auxiliary output for the backward: it is not differentiable, so its
    # incoming gradient (unused_drstd) is ignored.
    x, weight, rstd = ctx.saved_tensors
    want_dx, want_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    dx, dw = torch.ops.fusednorm.rms_norm_backward(
        _as(dy, x), x, weight, rstd, ctx.eps, ctx.weight_offset, weight is not None and want_dw
    )
    return (dx if want_dx else None), (dw if want_dw else None), None, None


def rms_norm_backward_with_addend(dy, x, weight, rstd, eps, weight_offset, compute_dw, addend):
    """rms_norm_backward with dx_addend; the CUDA backend has no addend yet (it raises), so
    there the addend is added in a second pass."""
    if addend is not None and x.device.type == "cuda":
        dx, dw = torch.ops.fusednorm.rms_norm_backward(
            dy, x, weight, rstd, eps, weight_offset, compute_dw
        )
        return dx + addend, dw
    return torch.ops.fusednorm.rms_norm_backward(
        dy, x, weight, rstd, eps, weight_offset, compute_dw, addend
    )


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
    ds, dw = rms_norm_backward_with_addend(
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
register_autograd("fusednorm::rms_norm", _rms_backward, setup_context=_rms_setup)
register_autograd("fusednorm::rms_norm_fwd", _rms_backward, setup_context=_rms_setup)


def _layer_setup(ctx, inputs, output):
    x, weight, bias, eps = inputs
    mean, rstd = (output[1], output[2]) if isinstance(output, tuple) else (None, None)
    ctx.eps = eps
    ctx.bias_dtype = bias.dtype if bias is not None else None
    ctx.save_for_backward(x, weight, mean, rstd)
    if mean is not None:
        ctx.mark_non_differentiable(mean, rstd)


def _layer_backward(ctx, dy, *unused_dstats):
    x, weight, mean, rstd = ctx.saved_tensors
    want_dx, want_dw, want_db = ctx.needs_input_grad[:3]
    dx, dw, db = torch.ops.fusednorm.layer_norm_backward(
        _as(dy, x), x, weight, mean, rstd, ctx.eps, weight is not None and want_dw, want_db
    )
    if want_db and db.dtype != ctx.bias_dtype:
        db = db.to(ctx.bias_dtype)
    return (dx if want_dx else None), (dw if want_dw else None), (db if want_db else None), None


register_autograd("fusednorm::layer_norm", _layer_backward, setup_context=_layer_setup)
register_autograd("fusednorm::layer_norm_fwd", _layer_backward, setup_context=_layer_setup)

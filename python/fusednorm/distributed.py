"""fusednorm's operators on DTensors (torch.distributed.tensor).

``fusednorm.rms_norm``, ``fused_add_rms_norm`` and ``layer_norm`` come here when an argument
is a DTensor. The result is a DTensor with x's placements; the weight (and bias) is
``Replicate()`` on every mesh dimension, except ``Shard(0)`` on the one where x is
``Shard(-1)``. A weight with other placements is redistributed to those (a local slice for
Replicate -> Shard(0)); a plain tensor weight is taken as replicated.

Per mesh dimension, x's placement decides the computation:

* ``Shard(d)``, d not the last dimension (batch, sequence, context parallel): every row is
  whole on its rank, so the forward and dx are local, with no communication. dw / db are
  sums over the rows of each rank: they come back as ``Partial()`` and DTensor reduces them
  when they are used (e.g. added into a Replicate parameter).
* ``Replicate()``: local; dw / db are the same on every rank (``Replicate()``).
* ``Partial()``: x is first reduced to ``Replicate()`` (a norm needs the sum itself).
* ``Shard(-1)`` (tensor parallel over the hidden dimension): the distributed norm. Each
  rank computes its slice's per-row fp32 sum of squares, one all-reduce of one fp32 per row
  over the mesh dimension that shards the hidden dimension gives the row's total, and each
  rank normalizes its own slice (``rms_norm_partial_sum_squares`` then
  ``rms_norm_from_sum_squares``). The backward all-reduces one fp32 per row, sum(g * x_hat)
  (``rms_norm_backward_partial_sums`` then ``rms_norm_backward_from_sums``), and dw stays
  ``Shard(0)`` like the weight. Activations are never gathered. LayerNorm likewise, with two
  all-reduces of one fp32 per row in the forward (the sums of x, then the squared deviations
  from the row's mean) and one of two fp32 per row in the backward (sum(g), sum(g * x_hat));
  dw and db stay ``Shard(0)``. Where several mesh dimensions shard the hidden dimension
  (e.g. ``(Shard(-1), Shard(-1))``), each all-reduce runs over each of them in turn.

On a mesh of several dimensions each mesh dimension is handled by its own placement above:
e.g. ``(Shard(0), Shard(-1))`` (rows over "dp", hidden over "tp") all-reduces the per-row
sums over "tp" only, and dw is ``(Partial(), Shard(0))``.

The gradient reaching an output is redistributed to x's placements before the backward
(DTensor's own rules: a Partial gradient is reduce-scattered, a Replicate one sliced).

The collectives are functional collectives (``torch.distributed._functional_collectives``),
so ``torch.distributed.tensor.debug.CommDebugMode`` counts them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

__all__ = ["rms_norm", "fused_add_rms_norm", "layer_norm", "is_dtensor"]


def is_dtensor(*tensors) -> bool:
    return any(isinstance(t, DTensor) for t in tensors)


@dataclass(frozen=True)
class _Layout:
    """Where each piece lives for one call: x's placements (Partial resolved), the weight's,
    the weight gradient's, and the mesh dimensions sharding the hidden dimension (empty
    when rows are whole on every rank)."""

    mesh: DeviceMesh
    x: tuple[Placement, ...]
    weight: tuple[Placement, ...]
    grad_weight: tuple[Placement, ...]
    hidden_mesh_dims: tuple[int, ...]
    full_cols: int


def _layout(op: str, x: DTensor) -> _Layout:
    last = x.ndim - 1
    if x.ndim == 0:
        raise RuntimeError(f"fusednorm::{op}: argument 'x': must have at least one dimension")
    xp, wp, dwp = [], [], []
    hidden = []
    for mesh_dim, p in enumerate(x.placements):
        if p.is_shard():
            d = p.dim if p.dim >= 0 else p.dim + x.ndim
            if d == last:
                hidden.append(mesh_dim)
                xp.append(p)
                wp.append(Shard(0))
                dwp.append(Shard(0))
            else:
                xp.append(p)
                wp.append(Replicate())
                dwp.append(Partial())
        elif p.is_replicate():
            xp.append(p)
            wp.append(Replicate())
            dwp.append(Replicate())
        elif p.is_partial():
            xp.append(Replicate())
            wp.append(Replicate())
            dwp.append(Replicate())
        else:
            raise RuntimeError(f"fusednorm::{op}: argument 'x': placement {p} is not supported")
    return _Layout(x.device_mesh, tuple(xp), tuple(wp), tuple(dwp), tuple(hidden), x.shape[-1])


def _as_layout(op: str, name: str, t, layout: _Layout, placements) -> DTensor | None:
    """t (weight or bias: 1-D of length D) as a DTensor on layout's mesh with the given
    placements (differentiably)."""
    if t is None:
        return None
    if t.dim() != 1 or t.shape[0] != layout.full_cols:
        # checked on the global shape: the local slices could match by accident
        raise RuntimeError(
            f"fusednorm::{op}: argument '{name}': shape {tuple(t.shape)} does not match "
            f"D = {layout.full_cols}"
        )
    if not isinstance(t, DTensor):
        # A plain tensor is the whole (replicated) value on every rank.
        t = DTensor.from_local(t, layout.mesh, [Replicate()] * layout.mesh.ndim, run_check=False)
    elif t.device_mesh != layout.mesh:
        raise RuntimeError(
            f"fusednorm::{op}: argument '{name}': is on mesh {t.device_mesh} but x is on "
            f"{layout.mesh}"
        )
    if tuple(t.placements) != tuple(placements):
        t = t.redistribute(layout.mesh, placements)
    return t


def _row_input(op: str, name: str, t, x: DTensor, layout: _Layout) -> DTensor:
    """A row-shaped argument (residual) laid out like x. A plain tensor is taken as x's
    local shard (as torch's parallel styles hand local tensors between modules)."""
    if isinstance(t, DTensor) and t.shape != x.shape:
        raise RuntimeError(
            f"fusednorm::{op}: argument '{name}': shape {tuple(t.shape)} does not match x's "
            f"{tuple(x.shape)}"
        )
    if not isinstance(t, DTensor):
        return DTensor.from_local(
            t, layout.mesh, layout.x, run_check=False, shape=x.shape, stride=x.stride()
        )
    if t.device_mesh != layout.mesh:
        raise RuntimeError(
            f"fusednorm::{op}: argument '{name}': is on mesh {t.device_mesh} but x is on "
            f"{layout.mesh}"
        )
    if tuple(t.placements) != layout.x:
        t = t.redistribute(layout.mesh, layout.x)
    return t


def _contiguous_stride(shape) -> tuple[int, ...]:
    stride, running = [], 1
    for size in reversed(shape):
        stride.append(running)
        running *= max(int(size), 1)
    return tuple(reversed(stride))


def _wrap(local: torch.Tensor, layout: _Layout, placements, shape) -> DTensor:
    return DTensor.from_local(
        local, layout.mesh, placements, run_check=False, shape=shape,
        stride=_contiguous_stride(shape),
    )


def _local(t: DTensor | None) -> torch.Tensor | None:
    return None if t is None else t.to_local()


def _grad_local(grad, layout: _Layout) -> torch.Tensor | None:
    if grad is None:
        return None
    if isinstance(grad, DTensor):
        if tuple(grad.placements) != layout.x:
            grad = grad.redistribute(layout.mesh, layout.x)
        return grad.to_local()
    return grad  # already x's local shard


def _row_sum_all_reduce(partial: torch.Tensor, layout: _Layout) -> torch.Tensor:
    """Sum of the per-row fp32 partials over the mesh dimensions that shard the hidden
    dimension (each one's group in turn; other mesh dimensions hold other rows or the same
    slice): the only communication of the distributed norm."""
    for mesh_dim in layout.hidden_mesh_dims:
        partial = funcol.wait_tensor(funcol.all_reduce(partial, "sum", (layout.mesh, mesh_dim)))
    return partial


def _as_dtype(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == like.dtype else t.to(like.dtype)


# ---- RMSNorm and the fused add -----------------------------------------------------------


def _rms_forward(x, residual, weight, eps, weight_offset, layout):
    """Local forward of (fused add +) RMSNorm; returns (y, s, rstd) with s the normalized
    input (residual_out for the fused add, x otherwise)."""
    ops = torch.ops.fusednorm
    if not layout.hidden_mesh_dims:
        if residual is None:
            y, rstd = ops.rms_norm_fwd(x, weight, eps, weight_offset)
            return y, x, rstd
        return ops.fused_add_rms_norm_fwd(x, residual, weight, eps, weight_offset)
    if residual is None:
        s, partial = x, ops.rms_norm_partial_sum_squares(x)
    else:
        s, partial = ops.fused_add_partial_sum_squares(x, residual)
    total = _row_sum_all_reduce(partial, layout)
    y, rstd = ops.rms_norm_from_sum_squares(s, weight, total, layout.full_cols, eps, weight_offset)
    return y, s, rstd


def _rms_backward(dy, s, weight, rstd, eps, weight_offset, want_dw, addend, layout):
    ops = torch.ops.fusednorm
    compute_dw = weight is not None and want_dw
    if not layout.hidden_mesh_dims:
        return ops.rms_norm_backward(dy, s, weight, rstd, eps, weight_offset, compute_dw, addend)
    partial = ops.rms_norm_backward_partial_sums(dy, s, weight, rstd, weight_offset)
    total = _row_sum_all_reduce(partial, layout)
    return ops.rms_norm_backward_from_sums(
        dy, s, weight, rstd, total, layout.full_cols, weight_offset, compute_dw, addend
    )


class _RmsNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, eps, weight_offset, layout):
        x_local, w_local = x.to_local(), _local(weight)
        r_local = _local(residual)
        y, s, rstd = _rms_forward(x_local, r_local, w_local, eps, weight_offset, layout)
        ctx.layout, ctx.eps, ctx.weight_offset = layout, eps, weight_offset
        ctx.global_shape = x.shape
        ctx.fused_add = residual is not None
        ctx.save_for_backward(s, w_local, rstd)
        y = _wrap(y, layout, layout.x, x.shape)
        if residual is None:
            return y
        return y, _wrap(s, layout, layout.x, x.shape)

    @staticmethod
    def backward(ctx, dy, d_residual_out=None):
        layout = ctx.layout
        s, w_local, rstd = ctx.saved_tensors
        want_x, want_residual, want_dw = ctx.needs_input_grad[:3]
        dy_local = _grad_local(dy, layout)
        if dy_local is None:
            dy_local = torch.zeros_like(s)
        dy_local = _as_dtype(dy_local, s)
        addend = _grad_local(d_residual_out, layout) if ctx.fused_add else None
        if addend is not None:
            addend = _as_dtype(addend, s)
        ds, dw = _rms_backward(
            dy_local, s, w_local, rstd, ctx.eps, ctx.weight_offset, want_dw, addend, layout
        )
        ds = _wrap(ds, layout, layout.x, ctx.global_shape)
        dw = _wrap(dw, layout, layout.grad_weight, (layout.full_cols,)) if want_dw else None
        return (
            ds if want_x else None,
            ds if (ctx.fused_add and want_residual) else None,
            dw,
            None,
            None,
            None,
        )


def rms_norm(x, weight=None, eps: float = 1e-6, weight_offset: float = 0.0):
    """``fusednorm.rms_norm`` for a DTensor x (see the module docstring)."""
    layout, x = _prepare("rms_norm", x)
    w = _as_layout("rms_norm", "weight", weight, layout, layout.weight)
    return _apply(x, None, w, eps, weight_offset, layout)


def fused_add_rms_norm(x, residual, weight=None, eps: float = 1e-6, weight_offset: float = 0.0):
    """Functional ``fusednorm.fused_add_rms_norm(..., inplace=False)`` for DTensors:
    returns ``(y, residual_out)`` laid out like x."""
    layout, x = _prepare("fused_add_rms_norm", x)
    r = _row_input("fused_add_rms_norm", "residual", residual, x, layout)
    w = _as_layout("fused_add_rms_norm", "weight", weight, layout, layout.weight)
    return _apply(x, r, w, eps, weight_offset, layout)


def _prepare(op: str, x) -> tuple[_Layout, DTensor]:
    if not isinstance(x, DTensor):
        raise TypeError(
            f"fusednorm::{op}: argument 'x': is a plain tensor while another argument is a "
            "DTensor; pass x as a DTensor"
        )
    layout = _layout(op, x)
    if tuple(x.placements) != layout.x:
        x = x.redistribute(layout.mesh, layout.x)  # Partial -> Replicate
    return layout, x


def _apply(x, residual, weight, eps, weight_offset, layout):
    return _RmsNorm.apply(x, residual, weight, eps, weight_offset, layout)


# ---- LayerNorm ----------------------------------------------------------------------------


def _layer_forward(x, weight, bias, eps, layout):
    """Local LayerNorm forward; returns (y, mean, rstd). Hidden-sharded: two all-reduces of
    one fp32 per row, the sums of x, then the squared deviations from the row's mean (the
    variance is taken about the whole row's mean, not merged from slice moments, so it has the
    one-call numerics)."""
    ops = torch.ops.fusednorm
    if not layout.hidden_mesh_dims:
        return ops.layer_norm_fwd(x, weight, bias, eps)
    total = _row_sum_all_reduce(ops.layer_norm_partial_sums(x), layout)
    partial = ops.layer_norm_partial_squared_deviations(x, total, layout.full_cols)
    deviations = _row_sum_all_reduce(partial, layout)
    return ops.layer_norm_from_sums(x, weight, bias, total, deviations, layout.full_cols, eps)


def _layer_backward(dy, x, weight, mean, rstd, eps, compute_dw, compute_db, layout):
    """Hidden-sharded: one all-reduce of two fp32 per row, sum(g) and sum(g * x_hat)."""
    ops = torch.ops.fusednorm
    if not layout.hidden_mesh_dims:
        return ops.layer_norm_backward(dy, x, weight, mean, rstd, eps, compute_dw, compute_db)
    sum_g, sum_g_xhat = ops.layer_norm_backward_partial_sums(dy, x, weight, mean, rstd)
    sums = _row_sum_all_reduce(torch.stack((sum_g, sum_g_xhat)), layout)
    return ops.layer_norm_backward_from_sums(
        dy, x, weight, mean, rstd, sums[0], sums[1], layout.full_cols, eps, compute_dw,
        compute_db,
    )


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, layout):
        x_local, w_local, b_local = x.to_local(), _local(weight), _local(bias)
        y, mean, rstd = _layer_forward(x_local, w_local, b_local, eps, layout)
        ctx.layout, ctx.eps, ctx.global_shape = layout, eps, x.shape
        ctx.bias_dtype = None if bias is None else b_local.dtype
        ctx.save_for_backward(x_local, w_local, mean, rstd)
        return _wrap(y, layout, layout.x, x.shape)

    @staticmethod
    def backward(ctx, dy):
        layout = ctx.layout
        x, w, mean, rstd = ctx.saved_tensors
        want_x, want_dw, want_db = ctx.needs_input_grad[:3]
        dy_local = _as_dtype(_grad_local(dy, layout), x)
        dx, dw, db = _layer_backward(
            dy_local, x, w, mean, rstd, ctx.eps, w is not None and want_dw, want_db, layout
        )
        if want_db and db.dtype != ctx.bias_dtype:
            db = db.to(ctx.bias_dtype)
        vec = (layout.full_cols,)
        return (
            _wrap(dx, layout, layout.x, ctx.global_shape) if want_x else None,
            _wrap(dw, layout, layout.grad_weight, vec) if want_dw else None,
            _wrap(db, layout, layout.grad_weight, vec) if want_db else None,
            None,
            None,
        )


def layer_norm(x, weight=None, bias=None, eps: float = 1e-5):
    """``fusednorm.layer_norm`` for a DTensor x (see the module docstring)."""
    layout, x = _prepare("layer_norm", x)
    w = _as_layout("layer_norm", "weight", weight, layout, layout.weight)
    b = _as_layout("layer_norm", "bias", bias, layout, layout.weight)
    return _LayerNorm.apply(x, w, b, eps, layout)

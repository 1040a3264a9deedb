"""The Python API over torch.ops.fusednorm: one function per operator.

Every function normalizes over the last dimension of ``x`` (any shape ``[..., D]``) and
accepts fp32, fp16 and bf16. The weight (and bias) is 1-D of length D, in x's dtype or in
fp32 (fp32 master weights with a bf16 activation need no cast). Arithmetic is fp32 and each
output element is rounded once to x's dtype. float64 is accepted too (rms_norm, the fused
add, layer_norm and their backward), for ``torch.autograd.gradcheck``: every tensor is then
float64 and the arithmetic fp64 (a verification dtype, not a speed path).

Memory layout: an input whose last dimension is contiguous and whose leading dimensions are
evenly spaced rows (any contiguous tensor, a slice ``x[:, :k]``, a row-strided view, ...) is
read in place through its strides. Any other layout (last dimension strided, broadcast
rows) is first copied to a contiguous tensor: that one copy is the only one made. Outputs
are new contiguous tensors, or, with ``out=``, the caller's tensor: it must have x's shape,
dtype and device; any layout the input path reads without a copy is written in place (any
other through one staging copy); ``out=x`` works in place; any other overlap with an input
raises. ``out=`` does not allocate and does not record a gradient (like ``torch``'s own
``out=`` functions it raises when an input requires grad under grad mode).

Errors (wrong dtype, integer tensors, device mismatch, weight of the wrong length) raise
RuntimeError with a message naming the operator and the argument, e.g.
``fusednorm::rms_norm: argument 'weight': size 4095 does not match D = 4096``.
"""

from __future__ import annotations

import torch

__all__ = [
    "rms_norm",
    "fused_add_rms_norm",
    "layer_norm",
    "rms_norm_quant",
    "fused_add_rms_norm_quant",
]

# The operator overloads, looked up once: these functions are on the per-call path of
# decode-sized calls, where each attribute lookup and Python frame shows (measured, see
# python/README.md "Per-call cost").
_rms_norm = torch.ops.fusednorm.rms_norm.default
_rms_norm_out = torch.ops.fusednorm.rms_norm.out
_fused_add_rms_norm = torch.ops.fusednorm.fused_add_rms_norm.default
_fused_add_rms_norm_out = torch.ops.fusednorm.fused_add_rms_norm.out
_layer_norm = torch.ops.fusednorm.layer_norm.default
_layer_norm_out = torch.ops.fusednorm.layer_norm.out


_fused_add_rms_norm_fwd = torch.ops.fusednorm.fused_add_rms_norm_fwd.default
_rms_norm_quant = torch.ops.fusednorm.rms_norm_quant.default
_rms_norm_quant_out = torch.ops.fusednorm.rms_norm_quant.out
_fused_add_rms_norm_quant = torch.ops.fusednorm.fused_add_rms_norm_quant.default
_fused_add_rms_norm_quant_out = torch.ops.fusednorm.fused_add_rms_norm_quant.out


# DTensor arguments go to fusednorm.distributed (a torch built without torch.distributed has
# neither).
try:
    from torch.distributed.tensor import DTensor as _DTensor

    from . import distributed as _dist_module
except ImportError:  # torch without torch.distributed
    _DTensor = ()  # isinstance(t, ()) is False
    _dist_module = None


def _any_dtensor(a, b, c=None) -> bool:
    # Spelled out: a generator with any() cost 0.6 µs per call of fusednorm.rms_norm on
    # 1 x 4096 (+1.0 µs over the raw operator before, +0.35 µs after; min of 31 x 3000 calls).
    return isinstance(a, _DTensor) or isinstance(b, _DTensor) or isinstance(c, _DTensor)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    weight_offset: float = 0.0,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """RMSNorm: ``y = x / sqrt(mean(x**2, -1) + eps) * (weight + weight_offset)``.

    ``weight_offset=1.0`` gives Gemma's ``(1 + w)`` with the sum taken in fp32. Without a
    weight, ``y = x * rstd`` and ``weight_offset`` is ignored.

    Differentiable in ``x`` and ``weight`` (the operator's C++ autograd kernel): when a
    gradient is needed the forward also keeps the per-row fp32 rstd, so the fused backward
    does not recompute it.

    ``out``: write y there instead of a new tensor and return it (no gradient).

    DTensor arguments give a DTensor with x's placements (fusednorm.distributed).
    """
    if out is None:
        if _any_dtensor(x, weight):
            return _dist_module.rms_norm(x, weight, eps, weight_offset)
        return _rms_norm(x, weight, eps, weight_offset)
    _rms_norm_out(x, weight, eps, weight_offset, out=out)
    return out


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    weight_offset: float = 0.0,
    inplace: bool = True,
    *,
    out: torch.Tensor | None = None,
):
    """Residual add then RMSNorm, in one pass over memory: ``s = x + residual`` (rounded to
    residual's dtype), ``y = rms_norm(s, weight, eps, weight_offset)``.

    ``x`` and ``residual`` have the same shape and dtype.

    ``inplace=True`` (the default, for inference): ``residual`` is overwritten with ``s``
    and ``y`` is returned. ``residual`` must not overlap ``x``; if its strides do not allow a
    rows x D view it is updated through a temporary contiguous copy. The in-place operator
    has no autograd formula, so when a gradient is needed this runs the functional form
    below and copies its ``s`` into ``residual`` (recorded by autograd). ``out``: write y
    there instead of a new tensor and return it (no gradient); ``out=x`` works in place.

    ``inplace=False`` (for training): no input is mutated and ``(y, residual_out)`` is
    returned, ``residual_out = s``. Differentiable in x, residual and weight with a fused
    backward: the gradient reaching ``residual_out`` is added to the norm's dx inside the
    backward kernel (one pass), and that one gradient is the gradient of both x and
    residual. DTensor arguments are accepted in this form (fusednorm.distributed).
    """
    if not inplace:
        if out is not None:
            raise TypeError("fusednorm.fused_add_rms_norm: out= needs inplace=True")
        if _any_dtensor(x, residual, weight):
            return _dist_module.fused_add_rms_norm(x, residual, weight, eps, weight_offset)
        y, residual_out, _ = _fused_add_rms_norm_fwd(x, residual, weight, eps, weight_offset)
        return y, residual_out
    if _any_dtensor(x, residual, weight):
        raise TypeError(
            "fusednorm.fused_add_rms_norm: DTensor arguments need inplace=False (the "
            "in-place form cannot rebind a DTensor residual's shards)"
        )
    if out is not None:
        _fused_add_rms_norm_out(x, residual, weight, eps, weight_offset, out=out)
        return out
    if torch.is_grad_enabled() and (
        x.requires_grad or residual.requires_grad or (weight is not None and weight.requires_grad)
    ):
        # The in-place operator has no autograd formula: the functional one (the same checks
        # of shapes and dtypes, the same bits, a fused backward), its sum then copied into
        # residual, which autograd records. The in-place operator's overlap rule still holds.
        if torch._C._overlaps(residual, x):
            raise RuntimeError(
                "fusednorm::fused_add_rms_norm: argument 'residual': overlaps the memory of 'x'"
            )
        y, residual_out, _ = _fused_add_rms_norm_fwd(x, residual, weight, eps, weight_offset)
        residual.copy_(residual_out)
        return y
    return _fused_add_rms_norm(x, residual, weight, eps, weight_offset)


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """LayerNorm over the last dimension: ``(x - mean) * rstd * weight + bias`` with the
    biased variance, like ``torch.nn.functional.layer_norm(x, (D,), weight, bias, eps)``.
    Differentiable in ``x``, ``weight`` and ``bias``.

    ``out``: write y there instead of a new tensor and return it (no gradient). DTensor
    arguments (rows sharded or replicated) give a DTensor with x's placements
    (fusednorm.distributed)."""
    if out is None:
        if _any_dtensor(x, weight, bias):
            return _dist_module.layer_norm(x, weight, bias, eps)
        return _layer_norm(x, weight, bias, eps)
    _layer_norm_out(x, weight, bias, eps, out=out)
    return out


# ---- quantized RMSNorm ------------------------------------------------------------------


def _quant_out_args(op: str, scale, out, dtype):
    """(q, row_scales) for the .out overload from ``out=``: a q tensor (static mode) or a
    ``(q, scale)`` pair (dynamic mode; scale None in static mode), q of the requested dtype."""
    if isinstance(out, torch.Tensor):
        q_out, scale_out = out, None
    else:
        q_out, scale_out = out
    if scale is None and scale_out is None:
        raise TypeError(
            f"fusednorm.{op}: dynamic mode (scale=None) with out= needs out=(q, scale): the "
            "per-token scales are an output too"
        )
    if q_out.dtype != dtype:
        raise TypeError(f"fusednorm.{op}: out's dtype {q_out.dtype} is not dtype={dtype}")
    return q_out, scale_out


def rms_norm_quant(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    dtype: torch.dtype = torch.int8,
    scale: torch.Tensor | None = None,
    scale_ub: torch.Tensor | None = None,
    weight_offset: float = 0.0,
    out=None,
):
    """RMSNorm quantized in the same pass: ``(q, scale)`` with ``q.float() * scale ~=
    rms_norm(x, weight, eps, weight_offset)``. Inference only (no gradient).

    ``y`` is rms_norm's fp32 value (never rounded to x's dtype), and
    ``q = saturate(round_half_even(y * (1 / scale)))`` (the reciprocal is one fp32 division
    per row, then a multiplication per element, on every backend) in ``dtype``:

    * ``torch.int8``: saturated to [-128, 127]; NaN -> 0;
    * ``torch.float8_e4m3fn``: round to nearest even, saturated to +-448; NaN stays NaN.

    ``scale``: a one-element fp32 tensor on x's device: static quantization, returned as
    given. Its value must be finite and above about 2.94e-39 (2^-128: its fp32 reciprocal,
    by which y is multiplied, must be finite): checked on the CPU; on CUDA it is not (reading
    it would synchronize with the device, and a CUDA graph replays it with new values).
    ``scale=None``: dynamic per token: ``scale[r] = max(amax_r / qmax, min_scale)``, fp32 of
    shape ``x.shape[:-1] + (1,)``, with amax_r the largest |y| of the row over its non-NaN
    values (qmax 127 or 448; min_scale FLT_EPSILON or 1 / (448 * 512), vLLM's floors: an
    all-zero row gets min_scale and q = 0). ``scale_ub`` (one-element fp32, dynamic mode
    only) bounds amax_r first, as vLLM's scale_ub does.

    ``out``: write q into the caller's tensor (int8 / float8_e4m3fn, x's shape; any row
    layout): ``out=q`` with a static scale, ``out=(q, scale)`` in dynamic mode (scale fp32
    ``x.shape[:-1] + (1,)``, contiguous); returns ``(q, scale)`` as without out.
    """
    if out is None:
        q, row_scales = _rms_norm_quant(
            x, weight, eps, weight_offset, dtype=dtype, scale=scale, scale_ub=scale_ub
        )
        return q, (row_scales if scale is None else scale)
    q_out, scale_out = _quant_out_args("rms_norm_quant", scale, out, dtype)
    _rms_norm_quant_out(
        x, weight, eps, weight_offset, scale=scale, scale_ub=scale_ub, out=q_out,
        row_scales=scale_out,
    )
    return q_out, (scale_out if scale is None else scale)


def fused_add_rms_norm_quant(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    dtype: torch.dtype = torch.int8,
    scale: torch.Tensor | None = None,
    scale_ub: torch.Tensor | None = None,
    weight_offset: float = 0.0,
    out=None,
):
    """``residual += x`` in place (rounded to residual's dtype, as fused_add_rms_norm), then
    ``rms_norm_quant(residual, ...)``, in one pass over memory; returns ``(q, scale)``.
    Arguments as rms_norm_quant's; residual has x's shape and dtype and must not overlap
    it. Inference only."""
    if out is None:
        q, row_scales = _fused_add_rms_norm_quant(
            x, residual, weight, eps, weight_offset, dtype=dtype, scale=scale, scale_ub=scale_ub
        )
        return q, (row_scales if scale is None else scale)
    q_out, scale_out = _quant_out_args("fused_add_rms_norm_quant", scale, out, dtype)
    _fused_add_rms_norm_quant_out(
        x, residual, weight, eps, weight_offset, scale=scale, scale_ub=scale_ub, out=q_out,
        row_scales=scale_out,
    )
    return q_out, (scale_out if scale is None else scale)

"""Drop-in replacements for torch.nn.RMSNorm and torch.nn.LayerNorm.

They subclass the torch modules, so the constructor arguments, attributes, ``state_dict``
keys (``weight``, ``bias``), ``reset_parameters`` and ``isinstance`` checks are torch's;
only ``forward`` runs fusednorm. fusednorm normalizes over the last dimension only, so
``normalized_shape`` must have one element.
"""

from __future__ import annotations

import torch

from . import functional as F

__all__ = ["RMSNorm", "FusedAddRMSNorm", "LayerNorm"]


def _last_dim_only(cls: str, normalized_shape: tuple[int, ...]) -> None:
    if len(normalized_shape) != 1:
        raise ValueError(
            f"fusednorm.{cls}: normalized_shape must have one element (the last "
            f"dimension D), got {normalized_shape}; fusednorm normalizes over the last "
            "dimension only"
        )


def _check_input(cls: str, x: torch.Tensor, normalized_shape: tuple[int, ...]) -> None:
    if x.dim() == 0 or x.shape[-1] != normalized_shape[0]:
        raise RuntimeError(
            f"fusednorm.{cls}: argument 'x': expected shape [*, {normalized_shape[0]}], "
            f"got {list(x.shape)}"
        )


def _weight_for(x: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor | None:
    # The kernels take a weight in x's dtype or fp32, and a float64 call takes float64 only.
    # Torch's modules accept any float weight; widening it (to fp64 for a float64 input, as
    # torch computes that call, else to fp32) is exact and keeps them interchangeable.
    if w is None or w.dtype == x.dtype:
        return w
    if x.dtype == torch.float64:
        return w.double()
    if w.dtype == torch.float32:
        return w
    return w.float()


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` computed by fusednorm.

    Same constructor (``normalized_shape, eps=None, elementwise_affine=True, device=None,
    dtype=None``) and semantics: ``eps=None`` means ``torch.finfo(x.dtype).eps``, and the
    output has x's dtype.
    """

    def __init__(
        self,
        normalized_shape,
        eps: float | None = None,
        elementwise_affine: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, device, dtype)
        _last_dim_only("RMSNorm", self.normalized_shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_input("RMSNorm", x, self.normalized_shape)
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        return F.rms_norm(x, _weight_for(x, self.weight), eps)


class FusedAddRMSNorm(RMSNorm):
    """Residual add and RMSNorm in one module, for training and inference:
    ``forward(x, residual) -> (y, residual_out)`` with ``residual_out = x + residual`` and
    ``y = rms_norm(residual_out)``. Neither input is mutated; the backward is fused (the
    gradient reaching residual_out is added inside the norm's backward kernel).
    ``residual=None`` (the first layer of a residual stream) gives ``(rms_norm(x), x)``.

    Same constructor, parameters and ``state_dict`` as ``torch.nn.RMSNorm``. Accepts
    DTensors like the functional form.
    """

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        _check_input("FusedAddRMSNorm", x, self.normalized_shape)
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        weight = _weight_for(x, self.weight)
        if residual is None:
            return F.rms_norm(x, weight, eps), x
        return F.fused_add_rms_norm(x, residual, weight, eps, inplace=False)


class LayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` over the last dimension, computed by fusednorm."""

    def __init__(
        self,
        normalized_shape,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device, dtype)
        _last_dim_only("LayerNorm", self.normalized_shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_input("LayerNorm", x, self.normalized_shape)
        return F.layer_norm(x, _weight_for(x, self.weight), _weight_for(x, self.bias), self.eps)

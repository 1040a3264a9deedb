"""fusednorm: fused RMSNorm / LayerNorm as PyTorch operators.

Importing the package loads the C++ extension (``library_path()``), which registers the
operators ``torch.ops.fusednorm.*`` for CPU (and CUDA when built with it); the fake
(meta) kernels used by torch.compile and the autograd formulas are registered from
``fusednorm._meta``.

The extension can also be used without this package, as in the original design::

    torch.ops.load_library(fusednorm.library_path())   # or the path of the built .so
    y = torch.ops.fusednorm.rms_norm(x, gamma, 1e-6)

Operators (all normalize over the last dimension of a ``[..., D]`` tensor)::

    rms_norm(Tensor x, Tensor? weight, float eps=1e-06, float weight_offset=0.) -> Tensor
    rms_norm_fwd(x, weight, eps, weight_offset) -> (Tensor y, Tensor rstd)
    rms_norm_backward(Tensor dy, Tensor x, Tensor? weight, Tensor? rstd, float eps,
                      float weight_offset, bool compute_dw=True) -> (Tensor dx, Tensor dw)
    fused_add_rms_norm(Tensor x, Tensor(a!) residual, Tensor? weight, float eps,
                       float weight_offset) -> Tensor
    layer_norm(Tensor x, Tensor? weight, Tensor? bias, float eps=1e-05) -> Tensor
    layer_norm_fwd(x, weight, bias, eps) -> (Tensor y, Tensor mean, Tensor rstd)
    layer_norm_backward(Tensor dy, Tensor x, Tensor? weight, Tensor? mean, Tensor? rstd,
                        float eps, bool compute_dw=True, bool compute_db=True)
                        -> (Tensor dx, Tensor dw, Tensor db)

Each forward operator has an ``.out`` overload writing into the caller's tensors
(``rms_norm.out(x, weight, eps, weight_offset, *, out)``, ``rms_norm_fwd.out(..., *, y,
rstd)``, ``fused_add_rms_norm.out(..., *, out)``, ``layer_norm.out(..., *, out)``,
``layer_norm_fwd.out(..., *, y, mean, rstd)``); the functions take it as ``out=``.

Quantized RMSNorm (inference; python/README.md "Quantized RMSNorm")::

    rms_norm_quant(Tensor x, Tensor? weight, float eps, float weight_offset, *,
                   ScalarType dtype, Tensor? scale=None, Tensor? scale_ub=None)
                   -> (Tensor q, Tensor scale)
    fused_add_rms_norm_quant(Tensor x, Tensor(a!) residual, ...same...) -> (Tensor q, Tensor scale)

and their ``.out`` overloads (``*, out, row_scales``). ``fusednorm.quant`` is the W8A8 path
(INT8 GEMMs by FBGEMM / oneDNN on the CPU, FP8 E4M3 by ``torch._scaled_mm``) built on
them; ``patch_hf_w8a8`` turns it on for a Llama-class model.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

__version__ = "0.1.0"

_LIBRARY_NAME = "libfusednorm_torch.so"


def library_path() -> str:
    """Path of the compiled extension (``libfusednorm_torch.so``).

    ``$FUSEDNORM_LIBRARY`` overrides it, e.g. to use a library built by plain CMake
    (``cmake -DFUSEDNORM_BUILD_PYTHON=ON``; it lands in ``<build>/python/``).
    """
    override = os.environ.get("FUSEDNORM_LIBRARY")
    if override:
        return override
    for directory in [Path(__file__).parent, *(Path(p) for p in __path__)]:
        candidate = directory / _LIBRARY_NAME
        if candidate.is_file():
            return str(candidate)
    raise ImportError(
        f"fusednorm: {_LIBRARY_NAME} not found next to {__file__}; install the package "
        "with `pip install --no-build-isolation .` (scripts/setup_python.sh) or set "
        "FUSEDNORM_LIBRARY to the built library"
    )


def _operators_registered() -> bool:
    return torch._C._dispatch_has_kernel("fusednorm::rms_norm")


# A library loaded earlier by path (torch.ops.load_library) already registered the
# namespace; loading a second copy would fail with a duplicate TORCH_LIBRARY.
if not _operators_registered():
    torch.ops.load_library(library_path())

from . import _meta  # noqa: E402,F401  (fake kernels; autograd is registered in C++)
from .functional import (  # noqa: E402
    fused_add_rms_norm,
    fused_add_rms_norm_quant,
    layer_norm,
    rms_norm,
    rms_norm_quant,
)
from .hf import patch_hf  # noqa: E402
from .modules import FusedAddRMSNorm, LayerNorm, RMSNorm  # noqa: E402
from .quant import patch_hf_w8a8  # noqa: E402


def has_cuda() -> bool:
    """Whether the loaded extension has CUDA kernels (built with FUSEDNORM_CUDA=ON)."""
    return torch._C._dispatch_has_kernel_for_dispatch_key("fusednorm::rms_norm", "CUDA")


__all__ = [
    "FusedAddRMSNorm",
    "LayerNorm",
    "RMSNorm",
    "fused_add_rms_norm",
    "fused_add_rms_norm_quant",
    "has_cuda",
    "layer_norm",
    "library_path",
    "patch_hf",
    "patch_hf_w8a8",
    "rms_norm",
    "rms_norm_quant",
]

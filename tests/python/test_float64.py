"""float64, the verification dtype: torch.autograd.gradcheck on the operators (CPU here; the
same checks on CUDA where a GPU is visible), the fp64 forward against torch.nn.functional
in fp64, and the errors for mixed dtypes and for the operators that refuse float64."""

from __future__ import annotations

import pytest
import torch
from conftest import requires_cuda

import fusednorm

ops = torch.ops.fusednorm

DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]


def _leaf(shape, device, scale=1.0, shift=0.0):
    return (shift + scale * torch.randn(shape, dtype=torch.float64, device=device)).requires_grad_()


# ---- gradcheck (torch's default tolerances) ------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("weight_kind", ["none", "llama", "gemma"])
def test_gradcheck_rms_norm(device, weight_kind):
    x = _leaf((3, 5, 7), device)
    if weight_kind == "none":
        fn = lambda x: fusednorm.rms_norm(x, None, 1e-6)  # noqa: E731
        assert torch.autograd.gradcheck(fn, (x,))
        return
    offset = 1.0 if weight_kind == "gemma" else 0.0
    w = _leaf((7,), device, 0.3, 0.0 if offset else 1.0)
    fn = lambda x, w: fusednorm.rms_norm(x, w, 1e-6, offset)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, w))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_weight", [True, False])
def test_gradcheck_fused_add_rms_norm_training_form(device, with_weight):
    """Both outputs (y and residual_out) of the functional form, through its fused backward."""
    x, r = _leaf((4, 9), device), _leaf((4, 9), device)
    if with_weight:
        w = _leaf((9,), device, 0.3, 1.0)
        fn = lambda x, r, w: fusednorm.fused_add_rms_norm(x, r, w, 1e-6, inplace=False)  # noqa: E731
        assert torch.autograd.gradcheck(fn, (x, r, w))
    else:
        fn = lambda x, r: fusednorm.fused_add_rms_norm(x, r, None, 1e-6, inplace=False)  # noqa: E731
        assert torch.autograd.gradcheck(fn, (x, r))


@pytest.mark.parametrize("device", DEVICES)
def test_gradcheck_layer_norm(device):
    x = _leaf((2, 3, 11), device, 2.0, 0.5)
    w, b = _leaf((11,), device, 0.3, 1.0), _leaf((11,), device)
    fn = lambda x, w, b: fusednorm.layer_norm(x, w, b, 1e-5)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, w, b))
    assert torch.autograd.gradcheck(lambda x: fusednorm.layer_norm(x, None, None, 1e-5), (x,))


@pytest.mark.parametrize("device", DEVICES)
def test_gradcheck_modules(device):
    norm = fusednorm.RMSNorm(6, eps=1e-6).to(device=device, dtype=torch.float64)
    x = _leaf((2, 6), device)
    assert torch.autograd.gradcheck(norm, (x,))


@pytest.mark.parametrize("device", DEVICES)
def test_modules_take_float64_input_with_fp32_parameters(device):
    # torch.nn.RMSNorm with fp32 parameters accepts a float64 input and computes in fp64 (its
    # LayerNorm refuses the mix on the CPU); the drop-ins widen the parameters (exactly) and
    # compute in fp64, the gradients reaching the fp32 parameters.
    x = torch.randn(3, 10, dtype=torch.float64, device=device)
    w = 1 + 0.3 * torch.arange(10.0, device=device)
    eps = float(torch.tensor(1e-6, dtype=torch.float32))
    rms, layer = fusednorm.RMSNorm(10, eps=eps).to(device), fusednorm.LayerNorm(10).to(device)
    cases = (
        (rms, lambda: torch.nn.functional.rms_norm(x, (10,), w.double(), eps)),
        (layer, lambda: torch.nn.functional.layer_norm(
            x, (10,), w.double(), layer.bias.detach().double(), layer.eps)),
    )
    for module, reference in cases:
        with torch.no_grad():
            module.weight.copy_(w)
        y = module(x)
        assert y.dtype == torch.float64
        torch.testing.assert_close(y, reference(), rtol=1e-12, atol=1e-12)
        y.sum().backward()
        assert module.weight.grad is not None and module.weight.grad.dtype == torch.float32
    theirs = torch.nn.RMSNorm(10, eps=eps).to(device)  # the module ours replaces
    with torch.no_grad():
        theirs.weight.copy_(w)
    torch.testing.assert_close(rms(x), theirs(x), rtol=1e-12, atol=1e-12)
    y, residual_out = fusednorm.FusedAddRMSNorm(10).to(device)(x, x)
    assert y.dtype == residual_out.dtype == torch.float64


# ---- fp64 forward against torch in fp64 ----------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(1, 1), (5, 1), (3, 7), (4, 2, 33), (2, 4099)])
def test_forward_matches_torch_in_fp64(device, shape):
    x = torch.randn(shape, dtype=torch.float64, device=device)
    d = shape[-1]
    w = 1 + 0.3 * torch.randn(d, dtype=torch.float64, device=device)
    b = torch.randn(d, dtype=torch.float64, device=device)
    # eps is an fp32 value in fusednorm's API: pass torch the same number.
    eps = float(torch.tensor(1e-6, dtype=torch.float32))
    torch.testing.assert_close(
        fusednorm.rms_norm(x, w, eps), torch.nn.functional.rms_norm(x, (d,), w, eps),
        rtol=1e-12, atol=1e-12,
    )
    torch.testing.assert_close(
        fusednorm.rms_norm(x, None, eps), torch.nn.functional.rms_norm(x, (d,), None, eps),
        rtol=1e-12, atol=1e-12,
    )
    eps_ln = float(torch.tensor(1e-5, dtype=torch.float32))
    torch.testing.assert_close(
        fusednorm.layer_norm(x, w, b, eps_ln),
        torch.nn.functional.layer_norm(x, (d,), w, b, eps_ln),
        rtol=1e-12, atol=1e-12,
    )


@pytest.mark.parametrize("device", DEVICES)
def test_strided_rows_and_in_place_fused_add(device):
    base = torch.randn(6, 40, dtype=torch.float64, device=device)
    x = base[::2, 3:30]  # strided rows
    residual = torch.randn(3, 27, dtype=torch.float64, device=device)
    w = torch.rand(27, dtype=torch.float64, device=device)
    expected_residual = residual + x
    expected = torch.nn.functional.rms_norm(expected_residual, (27,), w, 1e-6)
    y = fusednorm.fused_add_rms_norm(x, residual, w, 1e-6)  # in place, inference form
    torch.testing.assert_close(residual, expected_residual, rtol=0, atol=0)
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)


# ---- errors -------------------------------------------------------------------------------


def test_mixed_dtypes_are_refused_by_name():
    x = torch.randn(2, 8, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"fusednorm::rms_norm: argument 'weight'.*float64"):
        fusednorm.rms_norm(x, torch.ones(8, dtype=torch.float32))
    with pytest.raises(RuntimeError, match=r"argument 'bias'.*float64"):
        fusednorm.layer_norm(x, torch.ones(8, dtype=torch.float64), torch.zeros(8))
    with pytest.raises(RuntimeError, match=r"argument 'residual'"):
        fusednorm.fused_add_rms_norm(x, torch.randn(2, 8), None, inplace=False)
    with pytest.raises(RuntimeError, match=r"argument 'weight'"):
        fusednorm.rms_norm(torch.randn(2, 8), torch.ones(8, dtype=torch.float64))


def test_phased_and_quantized_operators_refuse_float64():
    x = torch.randn(2, 8, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"rms_norm_partial_sum_squares: argument 'x'.*two-phase"):
        ops.rms_norm_partial_sum_squares(x)
    with pytest.raises(RuntimeError, match=r"layer_norm_partial_sums: argument 'x'.*two-phase"):
        ops.layer_norm_partial_sums(x)
    with pytest.raises(RuntimeError, match=r"rms_norm_quant: argument 'x'.*float64"):
        fusednorm.rms_norm_quant(x, None)

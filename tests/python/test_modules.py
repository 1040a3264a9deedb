"""fusednorm.RMSNorm / LayerNorm as drop-ins for the torch.nn modules."""

from __future__ import annotations

import pytest
import torch
from conftest import DTYPES, TOL, assert_close_normalized

import fusednorm


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("eps", [None, 1e-5])
@pytest.mark.parametrize("affine", [True, False])
def test_rmsnorm_matches_torch(dtype, eps, affine):
    ref = torch.nn.RMSNorm(48, eps=eps, elementwise_affine=affine, dtype=dtype)
    ours = fusednorm.RMSNorm(48, eps=eps, elementwise_affine=affine, dtype=dtype)
    if affine:
        with torch.no_grad():
            ref.weight.normal_()
    assert ours.load_state_dict(ref.state_dict()) is not None  # same keys, strict
    assert list(ours.state_dict()) == list(ref.state_dict())
    assert isinstance(ours, torch.nn.RMSNorm)
    x = torch.randn(2, 9, 48, dtype=dtype)
    xr, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
    yr, yo = ref(xr), ours(xo)
    assert yo.dtype == yr.dtype
    dy = torch.randn_like(yr)
    yr.backward(dy)
    yo.backward(dy)
    tol = 2 * TOL[dtype]
    assert_close_normalized(yo, yr, tol, "y")
    assert_close_normalized(xo.grad, xr.grad, tol, "dx")
    if affine:
        assert_close_normalized(ours.weight.grad, ref.weight.grad, tol, "dw")


def test_rmsnorm_fp32_weight_with_bf16_input():
    # nn.RMSNorm's default fp32 weight used on bf16 activations (mixed precision).
    ref, ours = torch.nn.RMSNorm(32), fusednorm.RMSNorm(32)
    with torch.no_grad():
        ref.weight.normal_()
        ours.weight.copy_(ref.weight)
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    y = ours(x)
    assert y.dtype == ref(x).dtype == torch.bfloat16
    assert_close_normalized(y, ref(x), 2 * TOL[torch.bfloat16], "y")


def test_rmsnorm_constructor_and_errors():
    m = fusednorm.RMSNorm([16], eps=1e-6, device="cpu")
    assert m.normalized_shape == (16,) and m.eps == 1e-6 and m.weight.shape == (16,)
    assert "16" in repr(m)
    with pytest.raises(ValueError, match="normalized_shape"):
        fusednorm.RMSNorm((4, 16))
    with pytest.raises(RuntimeError, match="argument 'x'"):
        m(torch.randn(3, 15))


@pytest.mark.parametrize("bias", [True, False])
def test_layernorm_matches_torch(bias):
    ref = torch.nn.LayerNorm(40, bias=bias)
    ours = fusednorm.LayerNorm(40, bias=bias)
    with torch.no_grad():
        ref.weight.normal_()
        if bias:
            ref.bias.normal_()
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(3, 5, 40)
    xr, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
    yr, yo = ref(xr), ours(xo)
    yr.sum().backward()
    yo.sum().backward()
    assert_close_normalized(yo, yr, 1e-5, "y")
    assert_close_normalized(xo.grad, xr.grad, 1e-5, "dx")
    assert_close_normalized(ours.weight.grad, ref.weight.grad, 1e-5, "dw")
    if bias:
        assert_close_normalized(ours.bias.grad, ref.bias.grad, 1e-5, "db")

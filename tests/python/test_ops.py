"""torch.ops.fusednorm.*: registration (opcheck), results, layouts and bad inputs."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from conftest import DTYPES, TOL, assert_close_normalized, layer_norm_ref, rms_norm_ref

import fusednorm

ops = torch.ops.fusednorm


def _leaf(t: torch.Tensor, grad: bool = True) -> torch.Tensor:
    return t.detach().clone().requires_grad_(grad)


# ---- opcheck: schema, fake tensor, autograd registration, AOT dispatch -----------------


def _rms_samples():
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, 5, 16, dtype=dtype)
        w = torch.randn(16, dtype=dtype)
        yield (_leaf(x), _leaf(w), 1e-6, 0.0)
        yield (_leaf(x), None, 1e-5, 0.0)
        yield (_leaf(x), _leaf(w.float()), 1e-6, 1.0)  # fp32 weight, Gemma offset
        yield (_leaf(x)[:, 1:4, :9], _leaf(w[:9]), 1e-6, 0.0)  # strided view
        yield (x, w, 1e-6, 0.0)  # no grad
    yield (_leaf(torch.randn(7, 1)), _leaf(torch.randn(1)), 1e-6, 0.0)  # D = 1
    yield (_leaf(torch.randn(0, 8)), _leaf(torch.randn(8)), 1e-6, 0.0)  # no rows


@pytest.mark.parametrize("op_name", ["rms_norm", "rms_norm_fwd"])
def test_opcheck_rms_norm(op_name):
    for args in _rms_samples():
        torch.library.opcheck(getattr(ops, op_name).default, args)


def test_opcheck_rms_norm_backward():
    for dtype in DTYPES:
        x = torch.randn(4, 6, 24, dtype=dtype)
        w = torch.randn(24, dtype=dtype)
        dy = torch.randn_like(x)
        _, rstd = ops.rms_norm_fwd(x, w, 1e-6, 0.0)
        torch.library.opcheck(ops.rms_norm_backward.default, (dy, x, w, rstd, 1e-6, 0.0, True))
        torch.library.opcheck(ops.rms_norm_backward.default, (dy, x, w, None, 1e-6, 0.5, False))
        torch.library.opcheck(ops.rms_norm_backward.default, (dy, x, None, rstd, 1e-6, 0.0, True))


def test_opcheck_fused_add_rms_norm():
    for dtype in DTYPES:
        x = torch.randn(4, 33, dtype=dtype)
        residual = torch.randn(4, 33, dtype=dtype)
        w = torch.randn(33, dtype=dtype)
        torch.library.opcheck(ops.fused_add_rms_norm.default, (x, residual, w, 1e-6, 0.0))
        torch.library.opcheck(ops.fused_add_rms_norm.default, (x, residual, None, 1e-6, 0.0))


@pytest.mark.parametrize("op_name", ["layer_norm", "layer_norm_fwd"])
def test_opcheck_layer_norm(op_name):
    for dtype in (torch.float32, torch.float16):
        x = torch.randn(2, 7, 20, dtype=dtype)
        w = torch.randn(20, dtype=dtype)
        b = torch.randn(20, dtype=dtype)
        op = getattr(ops, op_name).default
        torch.library.opcheck(op, (_leaf(x), _leaf(w), _leaf(b), 1e-5))
        torch.library.opcheck(op, (_leaf(x), None, _leaf(b), 1e-5))
        torch.library.opcheck(op, (_leaf(x), _leaf(w), None, 1e-5))
        torch.library.opcheck(op, (_leaf(x)[:, ::2, 3:], _leaf(w[3:].float()), None, 1e-5))


def test_opcheck_layer_norm_backward():
    x = torch.randn(5, 40)
    w = torch.randn(40)
    dy = torch.randn_like(x)
    _, mean, rstd = ops.layer_norm_fwd(x, w, None, 1e-5)
    args = (dy, x, w, mean, rstd, 1e-5, True, True)
    torch.library.opcheck(ops.layer_norm_backward.default, args)
    torch.library.opcheck(ops.layer_norm_backward.default, (dy, x, None, None, None, 1e-5, False, True))


# ---- results against torch and Hugging Face --------------------------------------------

SHAPES = [(1, 1), (7, 1), (3, 5), (4, 17), (2, 3, 64), (33, 127), (8, 4096), (2, 20000)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_rms_norm_forward_backward(shape, dtype):
    D = shape[-1]
    x = torch.randn(shape, dtype=dtype) * 3
    w = torch.randn(D, dtype=dtype)
    dy = torch.randn(shape, dtype=dtype)

    xa, wa = _leaf(x), _leaf(w)
    y = fusednorm.rms_norm(xa, wa, 1e-6)
    assert y.dtype == dtype and y.shape == x.shape
    y.backward(dy)

    xr, wr = _leaf(x.double()), _leaf(w.double())
    rms_norm_ref(xr, wr, 1e-6).backward(dy.double())
    tol = TOL[dtype]
    assert_close_normalized(y, rms_norm_ref(x, w, 1e-6), tol, "y vs fp64")
    assert_close_normalized(xa.grad, xr.grad, tol, "dx vs fp64")
    assert_close_normalized(wa.grad, wr.grad, tol, "dw vs fp64")

    # torch.nn.functional.rms_norm in the same dtype
    xt, wt = _leaf(x), _leaf(w)
    yt = F.rms_norm(xt, (D,), wt, 1e-6)
    yt.backward(dy)
    assert_close_normalized(y, yt, 2 * tol, "y vs F.rms_norm")
    assert_close_normalized(xa.grad, xt.grad, 2 * tol, "dx vs F.rms_norm")
    assert_close_normalized(wa.grad, wt.grad, 2 * tol, "dw vs F.rms_norm")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_matches_llama_rmsnorm(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    D = 96
    hf = LlamaRMSNorm(D, eps=1e-5).to(dtype)
    with torch.no_grad():
        hf.weight.normal_()
    x = torch.randn(3, 11, D, dtype=dtype)
    dy = torch.randn_like(x)

    xh = _leaf(x)
    yh = hf(xh)
    yh.backward(dy)
    wa, xa = _leaf(hf.weight.detach()), _leaf(x)
    y = fusednorm.rms_norm(xa, wa, 1e-5)
    y.backward(dy)
    tol = 2 * TOL[dtype]
    assert_close_normalized(y, yh, tol, "y")
    assert_close_normalized(xa.grad, xh.grad, tol, "dx")
    assert_close_normalized(wa.grad, hf.weight.grad, tol, "dw")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_variants(dtype):
    x = torch.randn(6, 50, dtype=dtype)
    w = torch.randn(50, dtype=dtype)
    tol = TOL[dtype]
    # no weight, weight_offset ignored
    assert_close_normalized(fusednorm.rms_norm(x, None, 1e-6, 3.0), rms_norm_ref(x), tol, "no w")
    # Gemma: (1 + w)
    assert_close_normalized(
        fusednorm.rms_norm(x, w, 1e-6, 1.0), rms_norm_ref(x, w, 1e-6, 1.0), tol, "offset"
    )
    # fp32 weight with a low-precision x: output keeps x's dtype
    y = fusednorm.rms_norm(x, w.float(), 1e-6)
    assert y.dtype == dtype
    assert_close_normalized(y, rms_norm_ref(x, w.float()), tol, "fp32 weight")
    # rms_norm_fwd returns fp32 rstd per row
    y2, rstd = ops.rms_norm_fwd(x, w, 1e-6, 0.0)
    assert rstd.dtype == torch.float32 and rstd.shape == (6,)
    expect = torch.rsqrt(x.double().pow(2).mean(-1) + 1e-6)
    assert_close_normalized(rstd, expect, 1e-6, "rstd")
    assert torch.equal(y2, ops.rms_norm(x, w, 1e-6, 0.0))


def test_backward_op_without_rstd_recomputes():
    x = torch.randn(9, 70)
    w = torch.randn(70)
    dy = torch.randn_like(x)
    _, rstd = ops.rms_norm_fwd(x, w, 1e-6, 0.0)
    dx1, dw1 = ops.rms_norm_backward(dy, x, w, rstd, 1e-6, 0.0, True)
    dx2, dw2 = ops.rms_norm_backward(dy, x, w, None, 1e-6, 0.0, True)
    torch.testing.assert_close(dx1, dx2)
    torch.testing.assert_close(dw1, dw2)
    _, dw3 = ops.rms_norm_backward(dy, x, w, rstd, 1e-6, 0.0, False)
    assert dw3.shape == (0,)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_add_rms_norm(dtype):
    x = torch.randn(5, 3, 130, dtype=dtype)
    residual = torch.randn(5, 3, 130, dtype=dtype)
    w = torch.randn(130, dtype=dtype)
    expected_residual = x + residual  # rounded to dtype, like the kernel
    expected_y = F.rms_norm(expected_residual, (130,), w, 1e-6)
    r = residual.clone()
    y = fusednorm.fused_add_rms_norm(x, r, w, 1e-6)
    torch.testing.assert_close(r, expected_residual, rtol=0, atol=0)
    assert_close_normalized(y, expected_y, 2 * TOL[dtype], "y")
    assert_close_normalized(y, rms_norm_ref(expected_residual, w), TOL[dtype], "y vs fp64")


def test_fused_add_rms_norm_strided_residual_is_updated_in_place():
    base = torch.randn(6, 40)
    residual = base.t()[:, ::2]  # last dimension not contiguous: staged through a copy
    x = torch.randn(residual.shape)
    expected = residual + x
    y = fusednorm.fused_add_rms_norm(x, residual, None, 1e-6)
    torch.testing.assert_close(residual, expected, rtol=0, atol=0)
    torch.testing.assert_close(base.t()[:, ::2], expected, rtol=0, atol=0)
    assert_close_normalized(y, rms_norm_ref(expected), TOL[torch.float32], "y")


def test_fused_add_rms_norm_with_grad_checks_its_arguments():
    # The gradient path (the functional operator, then a copy into residual) refuses what the
    # in-place operator refuses, instead of broadcasting, promoting or aliasing.
    w = _leaf(torch.ones(64))
    cases = {
        "broadcast x": (torch.randn(1, 64), torch.randn(4, 64), "'residual'"),
        "dtype": (torch.randn(4, 64), torch.randn(4, 64, dtype=torch.bfloat16), "'residual'"),
    }
    for name, (x, residual, argument) in cases.items():
        with pytest.raises(RuntimeError, match=argument):
            fusednorm.fused_add_rms_norm(x, residual, w, 1e-6)
    x = torch.randn(4, 64)
    with pytest.raises(RuntimeError, match="overlaps the memory of 'x'"):
        fusednorm.fused_add_rms_norm(x, x, w, 1e-6)


def test_double_backward_raises_instead_of_giving_zeros():
    # The backward operators have no derivative: differentiating through them must fail
    # loudly (the autograd fallback used to give second derivatives of 0).
    c = torch.randn(8, dtype=torch.float64)
    for norm in (
        lambda t: fusednorm.rms_norm(t, None, 1e-6),
        lambda t: fusednorm.layer_norm(t, None, None, 1e-5),
        lambda t: fusednorm.fused_add_rms_norm(t, torch.zeros_like(t), None, 1e-6, inplace=False)[0],
    ):
        x = _leaf(torch.randn(3, 8, dtype=torch.float64))
        (g,) = torch.autograd.grad(((norm(x) * c) ** 3).sum(), x, create_graph=True)
        assert g.requires_grad
        with pytest.raises(RuntimeError, match="has no derivative"):
            torch.autograd.grad((g * c.flip(0)).sum(), x)
    # create_graph alone (first derivatives only) still works and gives the usual gradient.
    x = _leaf(torch.randn(3, 8, dtype=torch.float64))
    (g,) = torch.autograd.grad(fusednorm.rms_norm(x, None, 1e-6).pow(2).sum(), x, create_graph=True)
    xr = _leaf(x.detach())
    (gr,) = torch.autograd.grad(F.rms_norm(xr, (8,), None, 1e-6).pow(2).sum(), xr)
    torch.testing.assert_close(g.detach(), gr, rtol=1e-10, atol=1e-10)


def test_forward_mode_ad_is_refused():
    # No forward-mode formula: a tangent must be refused, never dropped (jacfwd used to give
    # an all-zero Jacobian).
    import torch.autograd.forward_ad as fwAD
    import torch.func

    x = torch.randn(3, 8, dtype=torch.float64)
    w = torch.randn(8, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="forward-mode"):
        torch.func.jacfwd(lambda t: fusednorm.rms_norm(t, w))(x)
    with pytest.raises(RuntimeError, match="forward-mode"):
        torch.func.jacfwd(lambda t: fusednorm.layer_norm(t, w))(x)
    with fwAD.dual_level():
        dual = fwAD.make_dual(x, torch.ones_like(x))
        with pytest.raises(RuntimeError, match="forward-mode"):
            fusednorm.rms_norm(dual, w)
        with pytest.raises(RuntimeError, match="forward-mode"):
            torch.ops.fusednorm.rms_norm_backward(dual, x, w, None, 1e-6, 0.0, True)


def test_fused_add_rms_norm_with_grad_falls_back_to_composite():
    x = _leaf(torch.randn(4, 16))
    w = _leaf(torch.randn(16))
    residual = torch.randn(4, 16)
    r = residual.clone()
    y = fusednorm.fused_add_rms_norm(x, r, w, 1e-6)
    y.sum().backward()
    torch.testing.assert_close(r, residual + x.detach())
    xr, wr = _leaf(x.detach()), _leaf(w.detach())
    F.rms_norm(residual + xr, (16,), wr, 1e-6).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad, wr.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1), (4, 17), (2, 3, 64), (3, 5000)], ids=str)
def test_layer_norm_forward_backward(shape, dtype):
    D = shape[-1]
    x = torch.randn(shape, dtype=dtype) + 0.5
    w = torch.randn(D, dtype=dtype)
    b = torch.randn(D, dtype=dtype)
    dy = torch.randn(shape, dtype=dtype)
    xa, wa, ba = _leaf(x), _leaf(w), _leaf(b)
    y = fusednorm.layer_norm(xa, wa, ba, 1e-5)
    y.backward(dy)
    xr, wr, br = _leaf(x.double()), _leaf(w.double()), _leaf(b.double())
    layer_norm_ref(xr, wr, br).backward(dy.double())
    tol = TOL[dtype]
    assert_close_normalized(y, layer_norm_ref(x, w, b), tol, "y")
    assert_close_normalized(xa.grad, xr.grad, tol, "dx")
    assert_close_normalized(wa.grad, wr.grad, tol, "dw")
    assert_close_normalized(ba.grad, br.grad, tol, "db")
    assert_close_normalized(y, F.layer_norm(x, (D,), w, b, 1e-5), 2 * tol, "y vs F.layer_norm")


def test_layer_norm_bias_only_gradient_dtype():
    x = _leaf(torch.randn(3, 8, dtype=torch.bfloat16))
    b = _leaf(torch.randn(8))  # fp32 bias, no weight
    fusednorm.layer_norm(x, None, b).sum().backward()
    assert b.grad.dtype == torch.float32
    torch.testing.assert_close(b.grad, torch.full((8,), 3.0))


# ---- layouts: strided views are read in place, others copied once ----------------------


def _copies_made(fn) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    names = [e.name for e in prof.events()]
    return names.count("aten::clone")  # Tensor.contiguous() of a non-contiguous tensor


VIEWS = {
    "contiguous": lambda t: t,
    "row slice": lambda t: t[:, :, :48],  # row stride 64 > D = 48
    "every other row": lambda t: t.reshape(-1, 64)[::2],
    "transposed leading dims": lambda t: t[:, :1].transpose(0, 1),
    "column slice of 2-D": lambda t: t.reshape(-1, 64)[3:9, 5:40],
}


@pytest.mark.parametrize("view", VIEWS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_strided_views_without_copy(view, dtype):
    base = torch.randn(6, 4, 64, dtype=dtype)
    x = VIEWS[view](base)
    w = torch.randn(x.shape[-1], dtype=dtype)
    assert _copies_made(lambda: ops.rms_norm(x, w, 1e-6, 0.0)) == 0
    y = ops.rms_norm(x, w, 1e-6, 0.0)
    assert y.is_contiguous()
    assert_close_normalized(y, rms_norm_ref(x, w), TOL[dtype], view)
    dy = torch.randn_like(x)
    dx, dw = ops.rms_norm_backward(dy, x, w, None, 1e-6, 0.0, True)
    xr, wr = _leaf(x.double()), _leaf(w.double())
    rms_norm_ref(xr, wr).backward(dy.double())
    assert_close_normalized(dx, xr.grad, TOL[dtype], view + " dx")
    assert_close_normalized(dw, wr.grad, TOL[dtype], view + " dw")


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(64, 6).t(),  # last dimension strided
        lambda: torch.randn(1, 32).expand(5, 32),  # broadcast rows (stride 0)
        lambda: torch.randn(4, 6, 32).transpose(0, 1)[:, :3],  # rows not evenly spaced
    ],
    ids=["last-dim-strided", "broadcast", "uneven-rows"],
)
def test_other_layouts_are_copied_once(make):
    x = make()
    assert _copies_made(lambda: ops.rms_norm(x, None, 1e-6, 0.0)) == 1
    assert_close_normalized(ops.rms_norm(x, None, 1e-6, 0.0), rms_norm_ref(x), 2e-5, "y")


def test_expanded_grad_from_sum():
    # .sum().backward() hands the backward a broadcast dy (stride 0): copied, still correct.
    x = _leaf(torch.randn(3, 4, 32))
    w = _leaf(torch.randn(32))
    fusednorm.rms_norm(x, w).sum().backward()
    xr, wr = _leaf(x.detach()), _leaf(w.detach())
    F.rms_norm(xr, (32,), wr, 1e-6).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad, wr.grad, rtol=1e-5, atol=1e-5)


def test_gradcheck_fp32():
    # The core has no fp64, so torch.autograd.gradcheck's fp64 finite differences are out;
    # this is its fp32 counterpart with a tolerance for fp32 finite differences.
    x = _leaf(torch.randn(3, 10))
    w = _leaf(torch.randn(10))
    assert torch.autograd.gradcheck(
        lambda a, b: fusednorm.rms_norm(a, b, 1e-6, 0.5), (x, w), eps=1e-2, atol=2e-2, rtol=2e-2
    )
    b = _leaf(torch.randn(10))
    assert torch.autograd.gradcheck(
        lambda a, c, d: fusednorm.layer_norm(a, c, d), (x, w, b), eps=1e-2, atol=2e-2, rtol=2e-2
    )


def test_thread_count_follows_torch():
    x = torch.randn(64, 4096)
    w = torch.randn(4096)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        y1 = ops.rms_norm(x, w, 1e-6, 0.0)
        _, dw1 = ops.rms_norm_backward(x, x, w, None, 1e-6, 0.0, True)
        torch.set_num_threads(max(2, old))
        y2 = ops.rms_norm(x, w, 1e-6, 0.0)
        _, dw2 = ops.rms_norm_backward(x, x, w, None, 1e-6, 0.0, True)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(y1, y2) and torch.equal(dw1, dw2)  # bit-identical for any count


# ---- bad inputs raise RuntimeError naming the argument ---------------------------------

BAD_CALLS = {
    "int x": (lambda: ops.rms_norm(torch.ones(2, 4, dtype=torch.int64), None, 1e-6, 0.0), "'x'"),
    "complex x": (lambda: ops.rms_norm(torch.ones(2, 4, dtype=torch.complex128), None, 1e-6, 0.0), "'x'"),
    "fp64 x, fp32 weight": (
        lambda: ops.rms_norm(torch.ones(2, 4, dtype=torch.float64), torch.ones(4), 1e-6, 0.0),
        "'weight'",
    ),
    "bool x": (lambda: ops.layer_norm(torch.ones(2, 4, dtype=torch.bool), None, None, 1e-5), "'x'"),
    "scalar x": (lambda: ops.rms_norm(torch.tensor(1.0), None, 1e-6, 0.0), "'x'"),
    "D = 0": (lambda: ops.rms_norm(torch.ones(3, 0), None, 1e-6, 0.0), "'x'"),
    "weight length": (lambda: ops.rms_norm(torch.ones(2, 4), torch.ones(5), 1e-6, 0.0), "'weight'"),
    "weight 2-D": (lambda: ops.rms_norm(torch.ones(2, 4), torch.ones(1, 4), 1e-6, 0.0), "'weight'"),
    "weight int": (
        lambda: ops.rms_norm(torch.ones(2, 4), torch.ones(4, dtype=torch.int32), 1e-6, 0.0),
        "'weight'",
    ),
    "weight dtype": (
        lambda: ops.rms_norm(
            torch.ones(2, 4, dtype=torch.float16), torch.ones(4, dtype=torch.bfloat16), 1e-6, 0.0
        ),
        "'weight'",
    ),
    "weight on meta": (
        lambda: ops.rms_norm(torch.ones(2, 4), torch.ones(4, device="meta"), 1e-6, 0.0),
        "weight",
    ),
    "negative eps": (lambda: ops.rms_norm(torch.ones(2, 4), None, -1.0, 0.0), "'eps'"),
    "nan eps": (lambda: ops.layer_norm(torch.ones(2, 4), None, None, float("nan")), "'eps'"),
    "inf offset": (lambda: ops.rms_norm(torch.ones(2, 4), torch.ones(4), 1e-6, float("inf")), "'weight_offset'"),
    "residual shape": (
        lambda: ops.fused_add_rms_norm(torch.ones(2, 4), torch.ones(3, 4), None, 1e-6, 0.0),
        "'residual'",
    ),
    "residual dtype": (
        lambda: ops.fused_add_rms_norm(
            torch.ones(2, 4), torch.ones(2, 4, dtype=torch.float16), None, 1e-6, 0.0
        ),
        "'residual'",
    ),
    "residual aliases x": (
        lambda: (lambda t: ops.fused_add_rms_norm(t, t, None, 1e-6, 0.0))(torch.ones(2, 4)),
        "'residual'",
    ),
    "dy shape": (
        lambda: ops.rms_norm_backward(torch.ones(2, 5), torch.ones(2, 4), None, None, 1e-6, 0.0, True),
        "'dy'",
    ),
    "rstd dtype": (
        lambda: ops.rms_norm_backward(
            torch.ones(2, 4), torch.ones(2, 4), None, torch.ones(2, dtype=torch.float16), 1e-6, 0.0, True
        ),
        "'rstd'",
    ),
    "rstd length": (
        lambda: ops.rms_norm_backward(torch.ones(2, 4), torch.ones(2, 4), None, torch.ones(3), 1e-6, 0.0, True),
        "'rstd'",
    ),
    "mean without rstd": (
        lambda: ops.layer_norm_backward(
            torch.ones(2, 4), torch.ones(2, 4), None, torch.ones(2), None, 1e-5, True, True
        ),
        "'rstd'",
    ),
    "bias length": (
        lambda: ops.layer_norm(torch.ones(2, 4), None, torch.ones(3), 1e-5),
        "'bias'",
    ),
    "sparse x": (lambda: ops.rms_norm(torch.eye(4).to_sparse(), None, 1e-6, 0.0), ""),
    # An empty tensor has no address: it must not pass for "no weight" / "no bias".
    "empty weight": (lambda: ops.rms_norm(torch.ones(2, 4), torch.ones(0), 1e-6, 0.0), "'weight'"),
    "empty layer_norm weight": (
        lambda: ops.layer_norm(torch.ones(2, 4), torch.ones(0), None, 1e-5),
        "'weight'",
    ),
    "empty bias": (lambda: ops.layer_norm(torch.ones(2, 4), None, torch.ones(0), 1e-5), "'bias'"),
    "empty quant weight": (
        lambda: ops.rms_norm_quant(torch.ones(2, 4), torch.ones(0), dtype=torch.int8),
        "'weight'",
    ),
}


@pytest.mark.parametrize("case", BAD_CALLS, ids=str)
def test_bad_inputs_raise(case):
    call, argument = BAD_CALLS[case]
    with pytest.raises(RuntimeError) as info:
        call()
    assert argument in str(info.value)


def test_bad_inputs_through_python_api():
    with pytest.raises(RuntimeError, match="argument 'weight'"):
        fusednorm.rms_norm(torch.randn(2, 8, requires_grad=True), torch.randn(7))
    with pytest.raises(RuntimeError, match="argument 'x'"):
        fusednorm.layer_norm(torch.arange(8).reshape(2, 4))


# ---- the original flow: the .so alone ---------------------------------------------------


def test_load_library_flow_in_fresh_interpreter():
    script = textwrap.dedent(
        f"""
        import sys, torch
        torch.ops.load_library({fusednorm.library_path()!r})
        assert "fusednorm" not in sys.modules
        x = torch.randn(4, 64); gamma = torch.randn(64)
        y = torch.ops.fusednorm.rms_norm(x, gamma, 1e-6)
        ref = torch.nn.functional.rms_norm(x, (64,), gamma, 1e-6)
        torch.testing.assert_close(y, ref)
        # Fake kernels and autograd come with the Python package; importing it after the
        # library was loaded by path must not register the operators a second time.
        import fusednorm
        assert fusednorm.library_path() == {fusednorm.library_path()!r}
        from torch._subclasses.fake_tensor import FakeTensorMode
        with FakeTensorMode() as mode:
            fy = torch.ops.fusednorm.rms_norm(mode.from_tensor(x), mode.from_tensor(gamma), 1e-6)
        assert fy.shape == x.shape
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]

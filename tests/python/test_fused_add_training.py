"""The functional fused add (inplace=False) with its fused backward, the backward's dx
addend, the two-phase (hidden-sharded) operators on one process, and FusedAddRMSNorm."""

from __future__ import annotations

import pytest
import torch
from conftest import DTYPES, TOL, assert_close_normalized, rms_norm_ref

import fusednorm

ops = torch.ops.fusednorm


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_()


def _inputs(shape, dtype, weight_dtype=None):
    x = torch.randn(shape, dtype=dtype)
    r = torch.randn(shape, dtype=dtype)
    w = (1 + 0.3 * torch.randn(shape[-1])).to(weight_dtype or dtype)
    return x, r, w


# ---- registration ---------------------------------------------------------------------


def test_opcheck_fused_add_rms_norm_fwd():
    for dtype in DTYPES:
        x, r, w = _inputs((4, 3, 33), dtype)
        torch.library.opcheck(ops.fused_add_rms_norm_fwd.default, (_leaf(x), _leaf(r), _leaf(w), 1e-6, 0.0))
        torch.library.opcheck(ops.fused_add_rms_norm_fwd.default, (_leaf(x), r, None, 1e-5, 0.0))
        torch.library.opcheck(
            ops.fused_add_rms_norm_fwd.default, (_leaf(x), _leaf(r), _leaf(w.float()), 1e-6, 1.0)
        )
        torch.library.opcheck(ops.fused_add_rms_norm_fwd.default, (x[:, 1:, :20], r[:, 1:, :20], w[:20], 1e-6, 0.0))


def test_opcheck_backward_with_addend_and_two_phase_ops():
    for dtype in DTYPES:
        x, r, w = _inputs((4, 6, 24), dtype)
        dy, addend = torch.randn_like(x), torch.randn_like(x)
        _, rstd = ops.rms_norm_fwd(x, w, 1e-6, 0.0)
        torch.library.opcheck(ops.rms_norm_backward.default, (dy, x, w, rstd, 1e-6, 0.0, True, addend))
        torch.library.opcheck(ops.rms_norm_backward.default, (dy, x, None, None, 1e-6, 0.0, False, addend))
        sums = ops.rms_norm_partial_sum_squares(x)
        torch.library.opcheck(ops.rms_norm_partial_sum_squares.default, (x,))
        torch.library.opcheck(ops.fused_add_partial_sum_squares.default, (x, r))
        torch.library.opcheck(ops.rms_norm_from_sum_squares.default, (x, w, sums, 48, 1e-6, 0.0))
        torch.library.opcheck(ops.rms_norm_from_sum_squares.default, (x, None, sums, 24, 1e-6, 0.0))
        torch.library.opcheck(ops.rms_norm_backward_partial_sums.default, (dy, x, w, rstd, 0.0))
        g = ops.rms_norm_backward_partial_sums(dy, x, w, rstd, 0.0)
        torch.library.opcheck(
            ops.rms_norm_backward_from_sums.default, (dy, x, w, rstd, g, 24, 0.0, True, addend)
        )
        torch.library.opcheck(
            ops.rms_norm_backward_from_sums.default, (dy, x, None, rstd, g, 24, 0.0, False, None)
        )


def _layer_norm_phases(x, w, b, eps, slices):
    """LayerNorm of x by its phase operators over column slices (the sums added here, as
    fusednorm.distributed adds them across ranks); returns y and (dx, dw, db) for dy."""
    D = x.shape[-1]
    parts = [slice(i * D // slices, (i + 1) * D // slices) for i in range(slices)]
    total = sum(ops.layer_norm_partial_sums(x[..., c].contiguous()) for c in parts)
    deviations = sum(
        ops.layer_norm_partial_squared_deviations(x[..., c].contiguous(), total, D) for c in parts
    )
    outs = [
        ops.layer_norm_from_sums(x[..., c].contiguous(), w[c], b[c], total, deviations, D, eps)
        for c in parts
    ]
    y = torch.cat([o[0] for o in outs], dim=-1)
    return y, outs[0][1], outs[0][2], parts


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_layer_norm_phases(dtype):
    x, _, w = _inputs((3, 5, 40), dtype)
    b = (0.3 * torch.randn(40)).to(dtype)
    dy = torch.randn_like(x)
    y_ref, mean_ref, rstd_ref = ops.layer_norm_fwd(x, w, b, 1e-5)
    dx_ref, dw_ref, db_ref = ops.layer_norm_backward(dy, x, w, mean_ref, rstd_ref, 1e-5, True, True)
    # One slice: the one-call bits (the same sums in the same order).
    y, mean, rstd, _ = _layer_norm_phases(x, w, b, 1e-5, 1)
    assert torch.equal(y, y_ref) and torch.equal(mean, mean_ref) and torch.equal(rstd, rstd_ref)
    # Two slices: sums split in two, so fp32 tolerance; the backward from the whole row's sums.
    y, mean, rstd, parts = _layer_norm_phases(x, w, b, 1e-5, 2)
    assert_close_normalized(y, y_ref, TOL[dtype])
    sums = [ops.layer_norm_backward_partial_sums(dy[..., c], x[..., c], w[c], mean, rstd) for c in parts]
    sum_g, sum_g_xhat = sum(s[0] for s in sums), sum(s[1] for s in sums)
    grads = [
        ops.layer_norm_backward_from_sums(
            dy[..., c].contiguous(), x[..., c].contiguous(), w[c], mean, rstd, sum_g, sum_g_xhat,
            40, 1e-5, True, True,
        )
        for c in parts
    ]
    assert_close_normalized(torch.cat([g[0] for g in grads], -1), dx_ref, TOL[dtype])
    assert_close_normalized(torch.cat([g[1] for g in grads]), dw_ref, TOL[dtype])
    assert_close_normalized(torch.cat([g[2] for g in grads]), db_ref, TOL[dtype])
    torch.library.opcheck(ops.layer_norm_partial_sums.default, (x,))
    total = ops.layer_norm_partial_sums(x)
    torch.library.opcheck(ops.layer_norm_partial_squared_deviations.default, (x, total, 40))
    dev = ops.layer_norm_partial_squared_deviations(x, total, 40)
    torch.library.opcheck(ops.layer_norm_from_sums.default, (x, w, b, total, dev, 40, 1e-5))
    torch.library.opcheck(ops.layer_norm_from_sums.default, (x, None, None, total, dev, 40, 1e-5))
    torch.library.opcheck(ops.layer_norm_backward_partial_sums.default, (dy, x, w, mean_ref, rstd_ref))
    torch.library.opcheck(
        ops.layer_norm_backward_from_sums.default,
        (dy, x, w, mean_ref, rstd_ref, sum_g, sum_g_xhat, 40, 1e-5, True, False),
    )
    with pytest.raises(RuntimeError, match="layer_norm_from_sums.*'row_sum'"):
        ops.layer_norm_from_sums(x, w, b, total[:2], dev, 40, 1e-5)


# ---- the functional fused add -----------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_functional_forward_matches_in_place_and_mutates_nothing(dtype):
    x, r, w = _inputs((5, 3, 130), dtype)
    x0, r0 = x.clone(), r.clone()
    y, residual_out = fusednorm.fused_add_rms_norm(x, r, w, 1e-6, inplace=False)
    assert torch.equal(x, x0) and torch.equal(r, r0)
    r_inplace = r.clone()
    y_inplace = fusednorm.fused_add_rms_norm(x, r_inplace, w, 1e-6)
    assert torch.equal(y, y_inplace) and torch.equal(residual_out, r_inplace)
    assert torch.equal(residual_out, x + r)  # one rounding to dtype, as the unfused add


@pytest.mark.parametrize("weight", ["same", "fp32", "none"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_backward_matches_autograd_of_unfused_composite(dtype, weight):
    """Gradients of (y, residual_out) against autograd of ``s = x + r; rms_norm(s)`` (the
    unfused composite, torch ops + fusednorm's rms_norm) and of the fp64 definition. The
    fused backward adds d(residual_out) in fp32 and rounds once, the composite rounds the
    norm's dx first: equal in fp32 to a few ulps, within the dtype's rounding otherwise."""
    shape = (6, 5, 96)
    x, r, w = _inputs(shape, dtype, torch.float32 if weight == "fp32" else None)
    w = None if weight == "none" else w
    dy, dres = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)

    def grads(fn, *inputs):
        leaves = [_leaf(t) if t is not None else None for t in inputs]
        y, residual_out = fn(*leaves)
        torch.autograd.backward((y, residual_out), (dy.to(y.dtype), dres.to(y.dtype)))
        return [y.detach(), residual_out.detach()] + [t.grad if t is not None else None for t in leaves]

    fused = grads(lambda a, b, c: fusednorm.fused_add_rms_norm(a, b, c, 1e-6, inplace=False), x, r, w)

    def composite(a, b, c):
        s = a + b
        return fusednorm.rms_norm(s, c, 1e-6), s

    unfused = grads(composite, x, r, w)

    def definition(a, b, c):
        s = a + b
        return rms_norm_ref(s, c, 1e-6), s

    fp64 = grads(
        definition, x.double(), r.double(), None if w is None else w.double()
    )
    names = ["y", "residual_out", "dx", "dresidual", "dw"]
    for name, got, comp, ref in zip(names, fused, unfused, fp64):
        if got is None:
            assert comp is None
            continue
        assert got.dtype == comp.dtype, name
        assert_close_normalized(got, comp, 2 * TOL[dtype], f"{name} vs composite")
        if name != "y" and name != "residual_out":
            assert_close_normalized(got, ref, 2 * TOL[dtype], f"{name} vs fp64")
    assert torch.equal(fused[2], fused[3])  # one gradient serves x and residual


def test_backward_addend_is_added_once_in_fp32():
    # the addend path against the plain backward plus the addend, in fp32 and exactly where
    # the addend is zero
    x, _, w = _inputs((8, 40), torch.float32)
    dy = torch.randn_like(x)
    _, rstd = ops.rms_norm_fwd(x, w, 1e-6, 0.0)
    dx, dw = ops.rms_norm_backward(dy, x, w, rstd, 1e-6, 0.0, True)
    dx0, dw0 = ops.rms_norm_backward(dy, x, w, rstd, 1e-6, 0.0, True, torch.zeros_like(x))
    assert torch.equal(dx0, dx) and torch.equal(dw0, dw)
    addend = torch.randn_like(x)
    dxa, dwa = ops.rms_norm_backward(dy, x, w, rstd, 1e-6, 0.0, True, addend)
    torch.testing.assert_close(dxa, dx + addend, rtol=1e-6, atol=1e-6)
    assert torch.equal(dwa, dw)
    with pytest.raises(RuntimeError, match="rms_norm_backward.*dx_addend"):
        ops.rms_norm_backward(dy, x, w, rstd, 1e-6, 0.0, True, addend[:, :20])
    with pytest.raises(RuntimeError, match="rms_norm_backward.*dx_addend"):
        ops.rms_norm_backward(dy, x, w, rstd, 1e-6, 0.0, True, addend.double())


def test_functional_bad_inputs():
    x, r, w = _inputs((4, 16), torch.float32)
    with pytest.raises(RuntimeError, match="fused_add_rms_norm_fwd.*'residual'"):
        fusednorm.fused_add_rms_norm(x, r[:, :8], w, inplace=False)
    with pytest.raises(RuntimeError, match="fused_add_rms_norm_fwd.*'residual'"):
        fusednorm.fused_add_rms_norm(x, r.half(), w, inplace=False)
    with pytest.raises(RuntimeError, match="fused_add_rms_norm.*'weight'"):
        fusednorm.fused_add_rms_norm(x, r, w[:8], inplace=False)


def test_compile_fused_add_training_step():
    torch._dynamo.reset()

    def step(x, residual, w):
        y, residual_out = fusednorm.fused_add_rms_norm(x, residual, w, 1e-6, inplace=False)
        return (y * residual_out).sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    x, r, w = _inputs((3, 7, 32), torch.float32)
    eager_leaves = [_leaf(t) for t in (x, r, w)]
    compiled_leaves = [_leaf(t) for t in (x, r, w)]
    step(*eager_leaves).backward()
    compiled(*compiled_leaves).backward()
    for e, c in zip(eager_leaves, compiled_leaves):
        torch.testing.assert_close(c.grad, e.grad)


# ---- two phases on one process ------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_two_phases_on_one_slice_equal_one_call(dtype):
    """With the whole row on one process (full_cols == cols), phase 1 then phase 2 give the
    one-call operators' bits (the C++ API's promise on the CPU)."""
    x, r, w = _inputs((9, 77), dtype)
    dy, addend = torch.randn_like(x), torch.randn_like(x)
    y, rstd = ops.rms_norm_fwd(x, w, 1e-6, 0.0)
    y2, rstd2 = ops.rms_norm_from_sum_squares(x, w, ops.rms_norm_partial_sum_squares(x), 77, 1e-6, 0.0)
    assert torch.equal(y2, y) and torch.equal(rstd2, rstd)
    s, sums = ops.fused_add_partial_sum_squares(x, r)
    y_fused, s_fused, _ = ops.fused_add_rms_norm_fwd(x, r, w, 1e-6, 0.0)
    assert torch.equal(s, s_fused)
    assert torch.equal(ops.rms_norm_from_sum_squares(s, w, sums, 77, 1e-6, 0.0)[0], y_fused)
    dx, dw = ops.rms_norm_backward(dy, x, w, rstd, 1e-6, 0.0, True, addend)
    g = ops.rms_norm_backward_partial_sums(dy, x, w, rstd, 0.0)
    dx2, dw2 = ops.rms_norm_backward_from_sums(dy, x, w, rstd, g, 77, 0.0, True, addend)
    assert torch.equal(dx2, dx) and torch.equal(dw2, dw)


def test_two_phases_over_column_slices_match_the_whole_row():
    """The distributed norm by hand: slices of the columns, partial sums added, each slice
    normalized; against the one-call result (fp32 tolerance: the sums are reordered)."""
    x, _, w = _inputs((5, 96), torch.float32)
    dy = torch.randn_like(x)
    y, rstd = ops.rms_norm_fwd(x, w, 1e-6, 0.0)
    dx, dw = ops.rms_norm_backward(dy, x, w, rstd, 1e-6, 0.0, True)
    cuts = [(0, 40), (40, 41), (41, 96)]  # uneven, one slice a single column
    total = sum(ops.rms_norm_partial_sum_squares(x[:, a:b]) for a, b in cuts)
    parts = [ops.rms_norm_from_sum_squares(x[:, a:b], w[a:b], total, 96, 1e-6, 0.0) for a, b in cuts]
    torch.testing.assert_close(torch.cat([p[0] for p in parts], 1), y, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(parts[0][1], rstd, rtol=2e-6, atol=0)
    g = sum(ops.rms_norm_backward_partial_sums(dy[:, a:b], x[:, a:b], w[a:b], rstd, 0.0) for a, b in cuts)
    grads = [
        ops.rms_norm_backward_from_sums(dy[:, a:b], x[:, a:b], w[a:b], rstd, g, 96, 0.0, True, None)
        for a, b in cuts
    ]
    torch.testing.assert_close(torch.cat([d for d, _ in grads], 1), dx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat([d for _, d in grads]), dw, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="rms_norm_from_sum_squares.*'sum_squares'"):
        ops.rms_norm_from_sum_squares(x, w, total[:3], 96, 1e-6, 0.0)
    with pytest.raises(RuntimeError, match="rms_norm_backward_from_sums.*'sum_g_xhat'"):
        ops.rms_norm_backward_from_sums(dy, x, w, rstd, g.double(), 96, 0.0, True, None)


# ---- module -------------------------------------------------------------------------------


def test_fused_add_module():
    m = fusednorm.FusedAddRMSNorm(48, eps=1e-6)
    assert isinstance(m, torch.nn.RMSNorm)
    with torch.no_grad():
        m.weight.normal_()
    x, r = torch.randn(2, 3, 48), torch.randn(2, 3, 48)
    y, residual_out = m(x, r)
    assert torch.equal(residual_out, x + r)
    # the fused kernel sums the squares in its own order: fp32 rounding apart
    torch.testing.assert_close(y, fusednorm.rms_norm(x + r, m.weight, 1e-6))
    y0, passthrough = m(x)
    assert passthrough is x and torch.equal(y0, fusednorm.rms_norm(x, m.weight, 1e-6))
    (y * residual_out).sum().backward()
    assert m.weight.grad is not None and m.weight.grad.shape == (48,)

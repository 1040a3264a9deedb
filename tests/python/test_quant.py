"""Quantized RMSNorm from PyTorch (fusednorm.rms_norm_quant / fused_add_rms_norm_quant):
every mode x quantized dtype x weight variant x input dtype against a float64 reference,
saturation, zero rows, NaN rows, scale_ub, strides, out=, bad input, opcheck, torch.compile.

The reference follows the contract (include/fusednorm/fusednorm.h, "Quantized RMSNorm"):
y in fp64; dynamic scale = max(min(amax(|y|), scale_ub) / qmax, min_scale);
q = saturate(round_half_even(y / scale)). The kernels compute y in fp32 and multiply by a
fp32 reciprocal, so q may differ from the reference by one step, and only where y / scale
lies within rounding distance of the midpoint between two steps: that is what is allowed.
"""

from __future__ import annotations

import pytest
import torch
from conftest import DTYPES, rms_norm_ref

import fusednorm

ops = torch.ops.fusednorm
QDTYPES = [torch.int8, torch.float8_e4m3fn]
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
MIN_SCALE = {torch.int8: torch.finfo(torch.float32).eps, torch.float8_e4m3fn: 1.0 / (448 * 512)}
# Relative distance from a rounding midpoint within which fp32 arithmetic may land on
# either side (a few fp32 ulps of y, of the rstd and of the reciprocal).
MIDPOINT_TOL = 1e-5


def quantize_ref(v: torch.Tensor, qdtype) -> torch.Tensor:
    """fp64 v (already divided by the scale) -> the quantized values as fp64 (NaN for FP8 NaN)."""
    if qdtype == torch.int8:
        return torch.nan_to_num(v, nan=0.0).clamp(-128, 127).round()
    # E4M3FN: saturate first (torch's own cast does not), then round to nearest even.
    return v.clamp(-448, 448).to(torch.float8_e4m3fn).double()


def quant_ref(x, weight, eps, weight_offset, qdtype, scale=None, scale_ub=None):
    """(expected q as fp64, scale fp64 [..., 1], v = y / scale fp64)."""
    y = rms_norm_ref(x, weight, eps, weight_offset)
    if scale is not None:
        s = torch.full((*x.shape[:-1], 1), float(scale.item()), dtype=torch.float64)
    else:
        amax = torch.nan_to_num(y.abs(), nan=0.0).amax(-1, keepdim=True)
        if scale_ub is not None:
            amax = amax.clamp_max(float(scale_ub.item()))
        s = (amax / QMAX[qdtype]).clamp_min(MIN_SCALE[qdtype])
    v = y / s
    return quantize_ref(v, qdtype), s, v


def assert_quant_matches(q, scale, x, weight, eps, weight_offset, scale_in=None, scale_ub=None):
    expected, s_ref, v = quant_ref(x, weight, eps, weight_offset, q.dtype, scale_in, scale_ub)
    if scale_in is None:
        assert scale.dtype == torch.float32 and scale.shape == (*x.shape[:-1], 1)
        torch.testing.assert_close(scale.double(), s_ref, rtol=MIDPOINT_TOL, atol=0)
    else:
        assert scale is scale_in
    got = q.double()
    same = (got == expected) | (got.isnan() & expected.isnan())
    midpoint = (got + expected) / 2
    near_midpoint = (v - midpoint).abs() <= MIDPOINT_TOL * v.abs()
    bad = ~same & ~near_midpoint
    assert not bad.any(), (
        f"{int(bad.sum())} of {q.numel()} elements differ from the reference by more than "
        f"rounding near a midpoint; first: got {got[bad][:4].tolist()}, "
        f"expected {expected[bad][:4].tolist()}, v {v[bad][:4].tolist()}"
    )


def _weight(kind, d, dtype):
    if kind == "none":
        return None, 0.0
    w = torch.randn(d, dtype=dtype) * 0.5 + (0.0 if kind == "gemma" else 1.0)
    return w, (1.0 if kind == "gemma" else 0.0)


MODES = ["static", "dynamic", "dynamic_ub"]


def _scales(mode, qdtype):
    if mode == "static":
        # y ~ N(0, 1): a static scale that maps |y| = 4 to qmax, so the tails saturate.
        return torch.tensor([4.0 / QMAX[qdtype]]), None
    if mode == "dynamic_ub":
        return None, torch.tensor([1.5])  # below most rows' amax: bounds them
    return None, None


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("qdtype", QDTYPES, ids=str)
@pytest.mark.parametrize("wkind", ["none", "llama", "gemma"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fused_add", [False, True], ids=["norm", "fused_add"])
def test_matches_reference(mode, qdtype, wkind, dtype, fused_add):
    d = 67  # odd: a SIMD tail on every target
    x = torch.randn(3, 5, d).to(dtype)
    w, offset = _weight(wkind, d, dtype)
    scale, scale_ub = _scales(mode, qdtype)
    if fused_add:
        residual = torch.randn(3, 5, d).to(dtype)
        expected_sum = (x.float() + residual.float()).to(dtype)
        q, s = fusednorm.fused_add_rms_norm_quant(
            x, residual, w, 1e-6, dtype=qdtype, scale=scale, scale_ub=scale_ub,
            weight_offset=offset,
        )
        assert torch.equal(residual, expected_sum)
        normed = residual
    else:
        q, s = fusednorm.rms_norm_quant(
            x, w, 1e-6, dtype=qdtype, scale=scale, scale_ub=scale_ub, weight_offset=offset
        )
        normed = x
    assert q.dtype == qdtype and q.shape == x.shape and q.is_contiguous()
    assert_quant_matches(q, s, normed, w, 1e-6, offset, scale, scale_ub)


@pytest.mark.parametrize("qdtype", QDTYPES, ids=str)
def test_saturation_at_qmax(qdtype):
    x = torch.randn(4, 256) * 3
    tiny_scale = torch.tensor([1e-3])  # every |y| > 0.448 saturates
    q, _ = fusednorm.rms_norm_quant(x, dtype=qdtype, scale=tiny_scale)
    y = rms_norm_ref(x)
    big = y.abs() > 0.5
    qf = q.double()
    if qdtype == torch.int8:
        assert torch.equal(qf[big & (y > 0)], torch.full_like(qf[big & (y > 0)], 127.0))
        assert torch.equal(qf[big & (y < 0)], torch.full_like(qf[big & (y < 0)], -128.0))
    else:
        assert torch.equal(qf[big].abs(), torch.full_like(qf[big], 448.0))
    # dynamic: the row's largest |y| lands exactly on qmax
    q, s = fusednorm.rms_norm_quant(x, dtype=qdtype)
    row_max = q.double().abs().amax(-1)
    assert torch.equal(row_max, torch.full((4,), QMAX[qdtype], dtype=torch.float64))


@pytest.mark.parametrize("qdtype", QDTYPES, ids=str)
@pytest.mark.parametrize("magnitude", [1e-30, 1e15])
def test_tiny_and_huge_inputs(qdtype, magnitude):
    # tiny: y ~ x / sqrt(eps) is far below min_scale, so q = 0 at the floor scale. huge: as
    # large as the fp32 sum of squares allows (rms_norm's sum of x^2 overflows near 1e18).
    x = torch.randn(4, 128) * magnitude
    w = torch.randn(128)
    q, s = fusednorm.rms_norm_quant(x, w, 1e-6, dtype=qdtype)
    assert_quant_matches(q, s, x, w, 1e-6, 0.0)
    if magnitude < 1:
        assert (q.double() == 0).all()


@pytest.mark.parametrize("qdtype", QDTYPES, ids=str)
def test_zero_row(qdtype):
    x = torch.randn(3, 64)
    x[1] = 0
    q, s = fusednorm.rms_norm_quant(x, torch.randn(64), dtype=qdtype)
    assert s[1].item() == pytest.approx(MIN_SCALE[qdtype], rel=0)
    assert torch.equal(q[1].double(), torch.zeros(64, dtype=torch.float64))
    assert (q[0].double() != 0).any() and (q[2].double() != 0).any()


@pytest.mark.parametrize("qdtype", QDTYPES, ids=str)
def test_no_rows_is_a_no_op_in_both_modes(qdtype):
    # Zero rows give empty outputs, as every other operator does (the dynamic mode's empty
    # scale tensor has no address, which once read as "no scale given").
    for shape in [(0, 64), (2, 0, 64)]:
        x = torch.randn(shape)
        q, s = fusednorm.rms_norm_quant(x, dtype=qdtype)
        assert q.shape == shape and q.dtype == qdtype and s.shape == shape[:-1] + (1,)
        q, s = fusednorm.rms_norm_quant(x, dtype=qdtype, scale=torch.tensor([0.5]))
        assert q.shape == shape
        residual = torch.randn(shape)
        q, s = fusednorm.fused_add_rms_norm_quant(x, residual, dtype=qdtype)
        assert q.shape == shape and s.shape == shape[:-1] + (1,)
        out = (torch.empty(shape, dtype=qdtype), torch.empty(shape[:-1] + (1,)))
        assert fusednorm.rms_norm_quant(x, dtype=qdtype, out=out)[0] is out[0]


@pytest.mark.parametrize("qdtype", QDTYPES, ids=str)
@pytest.mark.parametrize("mode", ["static", "dynamic"])
def test_nan_stays_in_its_row(qdtype, mode):
    x = torch.randn(3, 64)
    x[1, 5] = float("nan")
    scale = torch.tensor([0.05]) if mode == "static" else None
    q, s = fusednorm.rms_norm_quant(x, dtype=qdtype, scale=scale)
    # The NaN's row: rstd is NaN, so every y of the row is NaN: int8 -> 0, FP8 -> NaN.
    if qdtype == torch.int8:
        assert torch.equal(q[1].double(), torch.zeros(64, dtype=torch.float64))
    else:
        assert q[1].double().isnan().all()
    if mode == "dynamic":  # amax over non-NaN values: none, so 0 -> min_scale
        assert s[1].item() == pytest.approx(MIN_SCALE[qdtype], rel=0)
    rows = torch.tensor([0, 2])
    assert_quant_matches(
        q[rows], s if scale is not None else s[rows], x[rows], None, 1e-6, 0.0, scale
    )


def test_scale_ub_bounds_the_scale():
    x = torch.randn(6, 128) * 10
    ub = torch.tensor([2.0])
    q, s = fusednorm.rms_norm_quant(x, dtype=torch.int8, scale_ub=ub)
    assert (s <= 2.0 / 127 * (1 + 1e-6)).all()
    assert_quant_matches(q, s, x, None, 1e-6, 0.0, None, ub)


@pytest.mark.parametrize("qdtype", QDTYPES, ids=str)
def test_strided_input_and_out(qdtype):
    big = torch.randn(6, 100)
    x = big[::2, 10:74]  # row stride 200, a column slice
    w = torch.randn(64)
    q_big = torch.zeros(3, 96, dtype=qdtype)
    q_out = q_big[:, 16:80]  # row-strided out: written in place
    s_out = torch.empty(3, 1)
    q, s = fusednorm.rms_norm_quant(x, w, dtype=qdtype, out=(q_out, s_out))
    assert q is q_out and s is s_out
    assert q_big[:, :16].double().eq(0).all() and q_big[:, 80:].double().eq(0).all()
    assert_quant_matches(q_out, s_out, x, w, 1e-6, 0.0)
    q_alloc, s_alloc = fusednorm.rms_norm_quant(x, w, dtype=qdtype)
    assert torch.equal(q_alloc.view(torch.uint8), q_out.contiguous().view(torch.uint8))
    assert torch.equal(s_alloc, s_out)
    # a layout that is no row view: staged, then copied
    q_t = torch.empty(64, 3, dtype=qdtype).t()
    fusednorm.rms_norm_quant(x, w, dtype=qdtype, out=(q_t, torch.empty(3, 1)))
    assert torch.equal(q_t.contiguous().view(torch.uint8), q_alloc.view(torch.uint8))


def test_out_forms_match_allocating():
    x, w = torch.randn(4, 32), torch.randn(32)
    residual = torch.randn(4, 32)
    for qdtype in QDTYPES:
        scale = torch.tensor([0.02])
        q, _ = fusednorm.rms_norm_quant(x, w, dtype=qdtype, scale=scale)
        q_out = torch.empty(4, 32, dtype=qdtype)
        q2, s2 = fusednorm.rms_norm_quant(x, w, dtype=qdtype, scale=scale, out=q_out)
        assert q2 is q_out and s2 is scale
        assert torch.equal(q.view(torch.uint8), q_out.view(torch.uint8))
        r1, r2 = residual.clone(), residual.clone()
        q, s = fusednorm.fused_add_rms_norm_quant(x, r1, w, dtype=qdtype)
        q_out, s_out = torch.empty(4, 32, dtype=qdtype), torch.empty(4, 1)
        fusednorm.fused_add_rms_norm_quant(x, r2, w, dtype=qdtype, out=(q_out, s_out))
        assert torch.equal(r1, r2)
        assert torch.equal(q.view(torch.uint8), q_out.view(torch.uint8)) and torch.equal(s, s_out)


# ---- bad input: errors naming the argument ----------------------------------------------


def _raises(match, fn):
    with pytest.raises((RuntimeError, TypeError, ValueError), match=match):
        fn()


def test_bad_input_errors():
    x, w = torch.randn(4, 32), torch.randn(32)
    f = fusednorm.rms_norm_quant
    _raises("argument 'dtype'.*Half", lambda: f(x, w, dtype=torch.float16))
    _raises("argument 'x'.*Char", lambda: f(x.to(torch.int8), w))
    _raises("argument 'scale'.*one element", lambda: f(x, w, scale=torch.ones(2)))
    _raises("argument 'scale'.*float32", lambda: f(x, w, scale=torch.ones(1, dtype=torch.float64)))
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        _raises("argument 'scale'.*finite and > 0", lambda: f(x, w, scale=torch.tensor([bad])))
    _raises("argument 'scale'.*1 / scale is finite", lambda: f(x, w, scale=torch.tensor([1e-39])))
    one = torch.ones(1)
    _raises("argument 'scale_ub'.*static", lambda: f(x, w, scale=one, scale_ub=one))
    _raises("argument 'scale_ub'.*finite", lambda: f(x, w, scale_ub=torch.tensor([-1.0])))
    _raises("argument 'scale_ub'.*one element", lambda: f(x, w, scale_ub=torch.ones(3)))
    _raises("argument 'weight'", lambda: f(x, torch.randn(31)))
    q8, q8_narrow = torch.empty(4, 32, dtype=torch.int8), torch.empty(4, 31, dtype=torch.int8)
    row_scales = torch.empty(4, 1)
    _raises(
        "argument 'out'.*dtype",
        lambda: ops.rms_norm_quant.out(x, w, out=torch.empty(4, 32), row_scales=row_scales),
    )
    _raises("argument 'out'.*shape", lambda: f(x, w, scale=one, out=q8_narrow))
    _raises("argument 'row_scales'.*shape", lambda: f(x, w, out=(q8, torch.empty(4))))
    _raises("argument 'row_scales'.*required", lambda: ops.rms_norm_quant.out(x, w, out=q8))
    _raises("argument 'row_scales'.*static", lambda: f(x, w, scale=one, out=(q8, row_scales)))
    _raises("out=\\(q, scale\\)", lambda: f(x, w, out=q8))
    g = fusednorm.fused_add_rms_norm_quant
    _raises("argument 'residual'", lambda: g(x, torch.randn(4, 31), w))
    _raises("argument 'residual'", lambda: g(x, x.half(), w))
    _raises("argument 'residual'.*overlaps", lambda: g(x, x, w))


# ---- registration: opcheck and torch.compile ------------------------------------------------


def _quant_samples():
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, 5, 16, dtype=dtype)
        w = torch.randn(16, dtype=dtype)
        for qdtype in QDTYPES:
            yield x, w, qdtype, torch.tensor([0.05]), None
            yield x, None, qdtype, None, None
            yield x[:, 1:4, :9], w[:9], qdtype, None, torch.tensor([1.0])


def test_opcheck():
    for x, w, qdtype, scale, ub in _quant_samples():
        kw = {"dtype": qdtype, "scale": scale, "scale_ub": ub}
        torch.library.opcheck(ops.rms_norm_quant.default, (x, w, 1e-6, 0.5), kw)
        residual = torch.randn(x.shape, dtype=x.dtype)
        torch.library.opcheck(ops.fused_add_rms_norm_quant.default, (x, residual, w, 1e-6, 0.0), kw)
        out = torch.empty(x.shape, dtype=qdtype)
        row_scales = None if scale is not None else torch.empty(*x.shape[:-1], 1)
        kw_out = {"scale": scale, "scale_ub": ub, "out": out, "row_scales": row_scales}
        # torch's schema check compares a mutated tensor before/after with allclose, which
        # has no FP8 kernel on the CPU: for an FP8 out it is left out (the int8 samples check
        # the same schemas' mutations).
        utils = (
            ("test_schema", "test_autograd_registration", "test_faketensor",
             "test_aot_dispatch_dynamic")
            if qdtype == torch.int8
            else ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
        )
        torch.library.opcheck(ops.rms_norm_quant.out, (x, w, 1e-6, 0.0), kw_out, test_utils=utils)
        torch.library.opcheck(
            ops.fused_add_rms_norm_quant.out, (x, residual, w, 1e-6, 0.0), kw_out,
            test_utils=utils,
        )


def test_compile_fullgraph():
    torch._dynamo.reset()

    def step(x, residual, w, scale):
        q1, s1 = fusednorm.fused_add_rms_norm_quant(x, residual, w, dtype=torch.int8)
        q2, _ = fusednorm.rms_norm_quant(residual, w, dtype=torch.float8_e4m3fn, scale=scale)
        return q1.float() * s1, q2.float() * scale

    compiled = torch.compile(step, fullgraph=True, dynamic=True, backend="aot_eager")
    w, scale = torch.randn(32), torch.tensor([0.01])
    for rows in (3, 5):
        x, residual = torch.randn(rows, 32), torch.randn(rows, 32)
        r1, r2 = residual.clone(), residual.clone()
        expected = step(x, r1, w, scale)
        got = compiled(x, r2, w, scale)
        torch.testing.assert_close(got, expected)
        torch.testing.assert_close(r2, r1)  # the in-place residual update survives

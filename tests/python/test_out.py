"""The out= forms: torch.ops.fusednorm.<op>.out and the Python functions' `out=` keyword.

Registration (opcheck), results identical to the allocating operators, every layout the
input path reads without a copy written in place, in-place (out=x), no allocation, bad
out tensors named in the error, and torch.compile.
"""

from __future__ import annotations

import pytest
import torch
from conftest import DTYPES

import fusednorm

ops = torch.ops.fusednorm


def _randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


# ---- opcheck: schema (mutation of exactly the out arguments), fake tensor, AOT dispatch ----


def _out_samples():
    for dtype in (torch.float32, torch.bfloat16):
        x = _randn(3, 5, 16, dtype=dtype)
        w = _randn(16, dtype=dtype)
        yield x, w, torch.empty_like(x)
        yield x, None, torch.empty_like(x)
        yield x, w.float(), torch.empty_like(x)  # fp32 weight
        yield x[:, 1:4, :9], w[:9], torch.empty(3, 3, 12, dtype=dtype)[..., :9]  # strided
        yield x, w, torch.empty(5, 3, 16, dtype=dtype).transpose(0, 1)  # staged out
    yield _randn(0, 8), _randn(8), _randn(0, 8)  # no rows


def test_opcheck_rms_norm_out():
    for x, w, out in _out_samples():
        torch.library.opcheck(ops.rms_norm.out, (x, w, 1e-6, 0.5), {"out": out})


def test_opcheck_rms_norm_fwd_out():
    for x, w, y in _out_samples():
        rstd = torch.empty(x.shape[:-1])
        torch.library.opcheck(ops.rms_norm_fwd.out, (x, w, 1e-6, 0.0), {"y": y, "rstd": rstd})


def test_opcheck_fused_add_rms_norm_out():
    for x, w, out in _out_samples():
        residual = torch.randn_like(x)
        torch.library.opcheck(ops.fused_add_rms_norm.out, (x, residual, w, 1e-6, 0.0), {"out": out})


def test_opcheck_layer_norm_out():
    for x, w, out in _out_samples():
        b = None if w is None else torch.randn_like(w)
        torch.library.opcheck(ops.layer_norm.out, (x, w, b, 1e-5), {"out": out})
        mean, rstd = torch.empty(x.shape[:-1]), torch.empty(x.shape[:-1])
        torch.library.opcheck(
            ops.layer_norm_fwd.out, (x, w, b, 1e-5), {"y": out, "mean": mean, "rstd": rstd}
        )


# ---- results: the same bits as the allocating operator --------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_out_matches_allocating_ops(dtype):
    x = _randn(4, 3, 200, dtype=dtype)
    w = _randn(200, dtype=dtype)
    b = _randn(200, dtype=dtype)
    out = torch.empty_like(x)
    assert ops.rms_norm(x, w, 1e-6, 1.0, out=out) is None  # .out returns nothing
    assert torch.equal(out, ops.rms_norm(x, w, 1e-6, 1.0))
    ops.layer_norm(x, w, b, 1e-5, out=out)
    assert torch.equal(out, ops.layer_norm(x, w, b, 1e-5))

    y, rstd = torch.empty_like(x), torch.empty(4, 3)
    ops.rms_norm_fwd.out(x, w, 1e-6, 0.0, y=y, rstd=rstd)
    expected = ops.rms_norm_fwd(x, w, 1e-6, 0.0)
    assert torch.equal(y, expected[0]) and torch.equal(rstd, expected[1])
    mean = torch.empty(4, 3)
    ops.layer_norm_fwd.out(x, w, b, 1e-5, y=y, mean=mean, rstd=rstd)
    for got_t, want in zip((y, mean, rstd), ops.layer_norm_fwd(x, w, b, 1e-5)):
        assert torch.equal(got_t, want)

    residual = _randn(4, 3, 200, dtype=dtype)
    r_out, r_ref = residual.clone(), residual.clone()
    ops.fused_add_rms_norm(x, r_out, w, 1e-6, 0.0, out=out)
    assert torch.equal(out, ops.fused_add_rms_norm(x, r_ref, w, 1e-6, 0.0))
    assert torch.equal(r_out, r_ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_python_functions_take_out(dtype):
    x = _randn(6, 96, dtype=dtype)
    w = _randn(96, dtype=dtype)
    out = torch.empty_like(x)
    assert fusednorm.rms_norm(x, w, 1e-6, out=out) is out
    assert torch.equal(out, fusednorm.rms_norm(x, w, 1e-6))
    assert fusednorm.layer_norm(x, w, None, 1e-5, out=out) is out
    assert torch.equal(out, fusednorm.layer_norm(x, w, None, 1e-5))
    residual = _randn(6, 96, dtype=dtype)
    r1, r2 = residual.clone(), residual.clone()
    assert fusednorm.fused_add_rms_norm(x, r1, w, 1e-6, out=out) is out
    assert torch.equal(out, fusednorm.fused_add_rms_norm(x, r2, w, 1e-6))
    assert torch.equal(r1, r2)


def test_out_refuses_inputs_that_need_grad():
    x = _randn(2, 8).requires_grad_()
    with pytest.raises(RuntimeError, match=r"fusednorm::rms_norm.out: argument 'x': requires grad"):
        fusednorm.rms_norm(x, None, out=torch.empty(2, 8))
    w = torch.ones(8, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"fusednorm::layer_norm.out: argument 'weight'"):
        ops.layer_norm(torch.ones(2, 8), w, None, 1e-5, out=torch.empty(2, 8))
    with torch.no_grad():
        out = torch.empty(2, 8)
        assert fusednorm.rms_norm(x, None, out=out) is out


# ---- layouts: written in place, nothing outside the view touched ------------------------

OUT_VIEWS = {
    "row slice": lambda t: t[:, :, :48],  # row stride 64 > D = 48
    "every other row": lambda t: t.reshape(-1, 64)[::2][:12, :48].reshape(3, 4, 48),
    "transposed leading dims": lambda t: t.transpose(0, 1)[:, :, 8:56].transpose(0, 1),
}


@pytest.mark.parametrize("view", OUT_VIEWS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_row_strided_out_is_written_in_place(view, dtype):
    base = torch.full((3, 8, 64) if view == "every other row" else (3, 4, 64), float("nan"),
                      dtype=dtype)
    out = OUT_VIEWS[view](base)
    assert out.shape == (3, 4, 48) and out.stride(-1) == 1
    x = _randn(3, 4, 48, dtype=dtype)
    w = _randn(48, dtype=dtype)
    assert _allocations(lambda: ops.rms_norm(x, w, 1e-6, 0.0, out=out)) == 0
    assert torch.equal(out, ops.rms_norm(x, w, 1e-6, 0.0))
    touched = torch.zeros_like(base, dtype=torch.bool)
    OUT_VIEWS[view](touched).fill_(True)
    assert base[~touched].isnan().all()  # the NaN sentinels around the view are left alone


def test_other_out_layouts_are_staged_and_correct():
    x = _randn(5, 32)
    for out in (torch.empty(32, 5).t(), torch.empty(4, 5, 32).transpose(0, 1)[:, :3]):
        xs = _randn(*out.shape)
        ops.rms_norm(xs, None, 1e-6, 0.0, out=out)
        assert torch.equal(out, ops.rms_norm(xs, None, 1e-6, 0.0))
    del x


def _allocations(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, acc_events=True) as prof:
        fn()
    events = prof.profiler.kineto_results.events()
    return sum(1 for e in events if e.name() == "[memory]" and e.nbytes() > 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_out_allocates_nothing(dtype):
    x = _randn(16, 256, dtype=dtype)
    w = _randn(256, dtype=dtype)
    out = torch.empty_like(x)
    residual = torch.randn_like(x)
    assert _allocations(lambda: fusednorm.rms_norm(x, w, 1e-6, out=out)) == 0
    assert _allocations(lambda: fusednorm.layer_norm(x, w, w, 1e-5, out=out)) == 0
    assert _allocations(lambda: fusednorm.fused_add_rms_norm(x, residual, w, 1e-6, out=out)) == 0
    assert _allocations(lambda: fusednorm.rms_norm(x, w, 1e-6)) == 1  # the output itself


# ---- in place: out=x ------------------------------------------------------------------


def test_sibling_column_slices_are_not_overlaps():
    # A fused buffer's column slices (q | k | v style): x, residual and out in disjoint
    # columns of one tensor share no byte and are accepted; one shared column is refused.
    buf = torch.randn(6, 3, 192)
    x, r, y = buf[..., :64], buf[..., 64:128], buf[..., 128:]
    expected_sum = x + r
    expected = ops.rms_norm(x.clone(), None, 1e-6, 0.0)
    assert fusednorm.rms_norm(x, None, 1e-6, out=y) is y
    assert torch.equal(y, expected)
    y_fused = fusednorm.fused_add_rms_norm(x, r, None, 1e-6)
    assert torch.equal(r, expected_sum)
    assert torch.equal(y_fused, ops.rms_norm(expected_sum, None, 1e-6, 0.0))
    fusednorm.fused_add_rms_norm(x, r, None, 1e-6, out=y)
    with pytest.raises(RuntimeError, match="argument 'out'"):
        fusednorm.rms_norm(x, None, 1e-6, out=buf[..., 63:127])
    with pytest.raises(RuntimeError, match="argument 'residual'"):
        fusednorm.fused_add_rms_norm(x, buf[..., 63:127], None, 1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_out_is_x_in_place(dtype):
    base = _randn(4, 2, 72, dtype=dtype)
    # contiguous, a row slice (read and written through its strides), and a layout that is
    # both read through a copy and written through a staging copy
    for make in (lambda t: t, lambda t: t[..., 4:68], lambda t: t.transpose(1, 2)):
        t = make(base.clone())
        w = _randn(t.shape[-1], dtype=dtype)
        expected = ops.rms_norm(t.clone(), w, 1e-6, 0.0)
        assert fusednorm.rms_norm(t, w, 1e-6, out=t) is t
        assert torch.equal(t, expected)

    t = base.clone()
    expected = ops.layer_norm(t.clone(), None, None, 1e-5)
    fusednorm.layer_norm(t, out=t)
    assert torch.equal(t, expected)

    t = base.clone()
    residual = torch.randn_like(t)
    r_ref = residual.clone()
    expected = ops.fused_add_rms_norm(t.clone(), r_ref, None, 1e-6, 0.0)
    fusednorm.fused_add_rms_norm(t, residual, None, out=t)
    assert torch.equal(t, expected) and torch.equal(residual, r_ref)


# ---- bad out tensors: RuntimeError naming the operator and the argument -----------------


def _x():
    return torch.ones(2, 4)


BAD_OUT = {
    "shape": (lambda: ops.rms_norm(_x(), None, 1e-6, 0.0, out=torch.empty(2, 5)), "rms_norm.out", "'out'"),
    "rows": (lambda: ops.layer_norm(_x(), None, None, 1e-5, out=torch.empty(3, 4)), "layer_norm.out", "'out'"),
    "dtype": (
        lambda: ops.rms_norm(_x(), None, 1e-6, 0.0, out=torch.empty(2, 4, dtype=torch.float16)),
        "rms_norm.out", "'out'",
    ),
    "device": (
        lambda: ops.rms_norm(_x(), None, 1e-6, 0.0, out=torch.empty(2, 4, device="meta")),
        "", "out",
    ),
    "expanded": (
        lambda: ops.rms_norm(_x(), None, 1e-6, 0.0, out=torch.empty(1, 4).expand(2, 4)),
        "rms_norm.out", "'out'",
    ),
    "overlaps x": (
        lambda: (lambda b: ops.rms_norm(b[:2], None, 1e-6, 0.0, out=b[1:]))(torch.ones(3, 4)),
        "rms_norm.out", "'out'",
    ),
    "overlaps weight": (
        lambda: (lambda b: ops.rms_norm(_x(), b[1], 1e-6, 0.0, out=b))(torch.ones(2, 4)),
        "rms_norm.out", "'out'",
    ),
    "is residual": (
        lambda: (lambda r: ops.fused_add_rms_norm(_x(), r, None, 1e-6, 0.0, out=r))(torch.ones(2, 4)),
        "fused_add_rms_norm.out", "'out'",
    ),
    "overlaps bias": (
        lambda: (lambda b: ops.layer_norm(_x(), None, b[0], 1e-5, out=b))(torch.ones(2, 4)),
        "layer_norm.out", "'out'",
    ),
    "rstd shape": (
        lambda: ops.rms_norm_fwd.out(_x(), None, 1e-6, 0.0, y=torch.empty(2, 4), rstd=torch.empty(3)),
        "rms_norm_fwd.out", "'rstd'",
    ),
    "rstd dtype": (
        lambda: ops.rms_norm_fwd.out(
            _x(), None, 1e-6, 0.0, y=torch.empty(2, 4), rstd=torch.empty(2, dtype=torch.float16)
        ),
        "rms_norm_fwd.out", "'rstd'",
    ),
    "mean strided": (
        lambda: ops.layer_norm_fwd.out(
            _x(), None, None, 1e-5, y=torch.empty(2, 4), mean=torch.empty(4)[::2], rstd=torch.empty(2)
        ),
        "layer_norm_fwd.out", "'mean'",
    ),
    "y shape": (
        lambda: ops.layer_norm_fwd.out(
            _x(), None, None, 1e-5, y=torch.empty(4, 2), mean=torch.empty(2), rstd=torch.empty(2)
        ),
        "layer_norm_fwd.out", "'y'",
    ),
}


@pytest.mark.parametrize("case", BAD_OUT, ids=str)
def test_bad_out_raises_naming_it(case):
    call, op, argument = BAD_OUT[case]
    with pytest.raises(RuntimeError) as info:
        call()
    message = str(info.value)
    assert argument in message and f"fusednorm::{op}" in message, message


def test_bad_out_raises_while_tracing():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        x = mode.from_tensor(_x())
        with pytest.raises(RuntimeError, match=r"fusednorm::rms_norm.out: argument 'out'"):
            ops.rms_norm(x, None, 1e-6, 0.0, out=mode.from_tensor(torch.empty(2, 5)))


# ---- torch.compile ----------------------------------------------------------------------


def test_compile_out_forms():
    torch._dynamo.reset()

    def step(x, residual, w, y, h):
        fusednorm.fused_add_rms_norm(x, residual, w, 1e-6, out=h)
        fusednorm.rms_norm(h, w, 1e-6, out=y)
        fusednorm.layer_norm(y, out=y)  # in place
        return y.sum()

    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    x, residual, w = _randn(3, 64), _randn(3, 64), _randn(64)
    buffers = [torch.empty(3, 64) for _ in range(4)]
    r1, r2 = residual.clone(), residual.clone()
    with torch.no_grad():
        expected = step(x, r1, w, buffers[0], buffers[1])
        got = compiled(x, r2, w, buffers[2], buffers[3])
    torch.testing.assert_close(got, expected)
    assert torch.equal(r1, r2)
    assert torch.equal(buffers[2], buffers[0]) and torch.equal(buffers[3], buffers[1])

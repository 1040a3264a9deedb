"""CUDA kernels through torch (skipped, with the reason shown by `pytest -rs`, when torch
sees no GPU or fusednorm was built with FUSEDNORM_CUDA=OFF)."""

from __future__ import annotations

import pytest
import torch
from conftest import DTYPES, TOL, assert_close_normalized, requires_cuda

import fusednorm

pytestmark = requires_cuda
ops = torch.ops.fusednorm


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1), (3, 17), (2, 5, 4096), (4, 65536)], ids=str)
def test_cuda_matches_cpu(shape, dtype):
    x = torch.randn(shape, dtype=dtype)
    w = torch.randn(shape[-1], dtype=dtype)
    dy = torch.randn(shape, dtype=dtype)
    results = {}
    for device in ("cpu", "cuda"):
        xd = x.to(device).requires_grad_()
        wd = w.to(device).requires_grad_()
        y = fusednorm.rms_norm(xd, wd, 1e-6)
        y.backward(dy.to(device))
        results[device] = (y, xd.grad, wd.grad)
    for name, got, expected in zip(("y", "dx", "dw"), results["cuda"], results["cpu"]):
        assert got.device.type == "cuda"
        assert_close_normalized(got, expected, TOL[dtype], name)


def test_cuda_opcheck():
    x = torch.randn(3, 5, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    torch.library.opcheck(ops.rms_norm.default, (x, w, 1e-6, 0.0))
    torch.library.opcheck(ops.rms_norm_fwd.default, (x, w, 1e-6, 1.0))
    torch.library.opcheck(ops.layer_norm_fwd.default, (x, w, None, 1e-5))
    xd, wd = x.detach(), w.detach()
    _, rstd = ops.rms_norm_fwd(xd, wd, 1e-6, 0.0)
    torch.library.opcheck(ops.rms_norm_backward.default, (xd, xd, wd, rstd, 1e-6, 0.0, True))
    residual = torch.randn_like(xd)
    torch.library.opcheck(ops.fused_add_rms_norm.default, (xd, residual, wd, 1e-6, 0.0))


def test_cuda_fused_add_and_layer_norm():
    x = torch.randn(64, 1024, device="cuda", dtype=torch.float16)
    residual = torch.randn_like(x)
    w = torch.randn(1024, device="cuda", dtype=torch.float16)
    expected_residual = x + residual
    r = residual.clone()
    y = fusednorm.fused_add_rms_norm(x, r, w, 1e-6)
    torch.testing.assert_close(r, expected_residual, rtol=0, atol=0)
    assert_close_normalized(y, torch.nn.functional.rms_norm(expected_residual.float(), (1024,), w.float(), 1e-6), TOL[torch.float16], "y")
    b = torch.randn(1024, device="cuda", dtype=torch.float16)
    assert_close_normalized(
        fusednorm.layer_norm(x, w, b),
        torch.nn.functional.layer_norm(x.float(), (1024,), w.float(), b.float()),
        TOL[torch.float16],
        "layer_norm",
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_layer_norm_phases_match_cpu(dtype):
    """The LayerNorm phase operators on CUDA tensors (the two-phase kernels) against the same
    operators on the CPU, over two column slices, forward and backward."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(3, 5, 40, generator=g) + 1).to(dtype)
    w = (1 + 0.3 * torch.randn(40, generator=g)).to(dtype)
    b = (0.3 * torch.randn(40, generator=g)).to(dtype)
    dy = torch.randn(3, 5, 40, generator=g).to(dtype)
    parts = [slice(0, 17), slice(17, 40)]
    results = {}
    for device in ("cpu", "cuda"):
        xd, wd, bd, dyd = (t.to(device) for t in (x, w, b, dy))
        cols = [xd[..., c].contiguous() for c in parts]
        total = sum(ops.layer_norm_partial_sums(xc) for xc in cols)
        dev = sum(ops.layer_norm_partial_squared_deviations(xc, total, 40) for xc in cols)
        outs = [
            ops.layer_norm_from_sums(xc, wd[c], bd[c], total, dev, 40, 1e-5)
            for xc, c in zip(cols, parts)
        ]
        mean, rstd = outs[0][1], outs[0][2]
        sums = [
            ops.layer_norm_backward_partial_sums(dyd[..., c], xc, wd[c], mean, rstd)
            for xc, c in zip(cols, parts)
        ]
        sum_g, sum_g_xhat = sum(s[0] for s in sums), sum(s[1] for s in sums)
        grads = [
            ops.layer_norm_backward_from_sums(
                dyd[..., c].contiguous(), xc, wd[c], mean, rstd, sum_g, sum_g_xhat, 40, 1e-5,
                True, True,
            )
            for xc, c in zip(cols, parts)
        ]
        results[device] = (
            torch.cat([o[0] for o in outs], -1), mean, rstd,
            torch.cat([gr[0] for gr in grads], -1),
            torch.cat([gr[1] for gr in grads]),
            torch.cat([gr[2] for gr in grads]),
        )
    names = ("y", "mean", "rstd", "dx", "dw", "db")
    for name, got, expected in zip(names, results["cuda"], results["cpu"]):
        assert got.device.type == "cuda", name
        assert_close_normalized(got, expected, TOL[dtype], name)


def test_cuda_runs_on_current_stream_and_strided_view():
    base = torch.randn(32, 3000, device="cuda")
    x = base[:, :2048]  # row stride 3000
    w = torch.randn(2048, device="cuda")
    expected = torch.nn.functional.rms_norm(x, (2048,), w, 1e-6)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        y = fusednorm.rms_norm(x, w, 1e-6)
    stream.synchronize()
    assert_close_normalized(y, expected, TOL[torch.float32], "y")


def test_cuda_device_mismatch_raises():
    with pytest.raises(RuntimeError, match="weight"):
        ops.rms_norm(torch.randn(2, 8, device="cuda"), torch.randn(8), 1e-6, 0.0)
    with pytest.raises(RuntimeError):
        ops.rms_norm(torch.randn(2, 8), torch.randn(8, device="cuda"), 1e-6, 0.0)


def test_cuda_compile():
    torch._dynamo.reset()
    model = fusednorm.RMSNorm(512, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(8, 512, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(model, fullgraph=True)
    torch.testing.assert_close(compiled(x), model(x))

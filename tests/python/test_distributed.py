"""fusednorm under torch.distributed: DTensor placements on 2 and 3 gloo processes against
the single-process result.

What is compared, and how exactly (the reason is the order of the fp32 sums):
- rows sharded (Shard(d), d not last) and Replicate: y and dx are computed row by row by the
  same kernel as the single-process call, so they are bit-identical; dw / db are sums over
  rows split across ranks (local sums, then DTensor's all-reduce): fp32 tolerance.
- hidden sharded (Shard(-1)): the row's sums (of squares, of x and of squared deviations,
  and the backward's sum(g), sum(g * x_hat)) are sums of per-rank partials, so y, dx, dw and
  db agree to fp32 tolerance.
Every process builds the same full tensors from one seed and computes the single-process
reference itself.
"""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_on_ranks

import fusednorm

dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import (  # noqa: E402
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
)
from torch.distributed.tensor.debug import CommDebugMode  # noqa: E402

# Normalized error allowed where the sums are reordered: a few fp32 roundings; in bf16 the
# outputs (and each rank's partial dw) are rounded to bf16, so a reordered fp32 value can
# land one bf16 step away.
TOL = {torch.float32: 5e-6, torch.bfloat16: 1e-2}
funcol_ops = torch.ops.c10d_functional  # the keys CommDebugMode counts under


def _normalized_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a, e = actual.detach().double(), expected.detach().double()
    return ((a - e).abs().max() / e.abs().max().clamp_min(1e-2)).item()


def _check(actual, expected, exact: bool, what: str) -> None:
    if isinstance(actual, DTensor):
        actual = actual.full_tensor()
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    if exact:
        assert torch.equal(actual, expected), f"{what}: not bit-identical " \
            f"(normalized error {_normalized_error(actual, expected):.3g})"
    else:
        err = _normalized_error(actual, expected)
        tol = TOL[expected.dtype]
        assert err <= tol, f"{what}: normalized error {err:.3g} > {tol:.3g}"


def _leaf(t: torch.Tensor, mesh, placements) -> DTensor:
    return distribute_tensor(t.detach(), mesh, placements).requires_grad_()


def _placements_to_test(ndim: int):
    # rows sharded on each leading dimension, replicated, hidden sharded
    return [Shard(d) for d in range(ndim - 1)] + [Replicate(), Shard(ndim - 1)]


def _ops(op: str):
    """(reference single-process function, distributed call) for op; both take
    (x, residual, weight, bias) and return the tuple of outputs."""
    if op == "rms_norm":
        return (lambda x, r, w, b: (fusednorm.rms_norm(x, w, 1e-6),),) * 2
    if op == "fused_add":
        def fused_add(x, r, w, b):
            return fusednorm.fused_add_rms_norm(x, r, w, 1e-6, inplace=False)
        return fused_add, fused_add
    if op == "layer_norm":
        return (lambda x, r, w, b: (fusednorm.layer_norm(x, w, b, 1e-5),),) * 2
    raise ValueError(op)


def _case_inputs(shape, dtype, seed: int):
    """x, residual, weight, bias and two output gradients of one placement test case."""
    g = torch.Generator().manual_seed(seed)
    D = shape[-1]
    x = torch.randn(shape, generator=g).to(dtype)
    r = torch.randn(shape, generator=g).to(dtype)
    w = (1 + 0.3 * torch.randn(D, generator=g)).to(dtype)
    b = (0.3 * torch.randn(D, generator=g)).to(dtype)
    dys = [torch.randn(shape, generator=g).to(dtype) for _ in range(2)]
    return x, r, w, b, dys


def _single_process(reference, x, r, w, b, dys) -> dict:
    """The single-process outputs and gradients that every placement is checked against."""
    xs, rs, ws, bs = (t.clone().requires_grad_() for t in (x, r, w, b))
    outs = reference(xs, rs, ws, bs)
    torch.autograd.backward(outs, dys[: len(outs)])
    return dict(out=[o.detach() for o in outs], dx=xs.grad, dr=rs.grad, dw=ws.grad, db=bs.grad)


def _placement_cases(rank: int, world: int, shape, dtype) -> None:
    mesh = init_device_mesh("cpu", (world,))
    x, r, w, b, dys = _case_inputs(shape, dtype, 1234)

    for op in ("rms_norm", "fused_add", "layer_norm"):
        reference, call = _ops(op)
        expected = _single_process(reference, x, r, w, b, dys)

        for p in _placements_to_test(len(shape)):
            hidden = p.is_shard() and p.dim == len(shape) - 1
            vec = [Shard(0)] if hidden else [Replicate()]
            xd, rd, wd, bd = _leaf(x, mesh, [p]), _leaf(r, mesh, [p]), _leaf(w, mesh, vec), _leaf(b, mesh, vec)
            with CommDebugMode() as forward_comms:
                outs_d = call(xd, rd, wd, bd)
            for o in outs_d:
                assert isinstance(o, DTensor) and tuple(o.placements) == (p,), f"{op} {p}: {o}"
            dys_d = [distribute_tensor(dy, mesh, [p]) for dy in dys[: len(outs_d)]]
            inputs = [xd, rd, wd, bd] if op == "fused_add" else [xd, wd, bd]
            inputs = [t for t in inputs if t is not None]
            # autograd.grad, not backward: accumulating the one gradient that x and residual
            # share into two leaves' .grad clones it through new_empty_strided, which
            # DTensor gathers for uneven shards (torch's accumulation, not the operator)
            with CommDebugMode() as backward_comms:
                grads = torch.autograd.grad(outs_d, inputs, dys_d, allow_unused=True)
            grad = dict(zip([id(t) for t in inputs], grads))
            dx_d, dw_d = grad[id(xd)], grad[id(wd)]
            dr_d = grad.get(id(rd))
            db_d = grad.get(id(bd))
            what = f"{op} {dtype} {p} world {world}"
            forward_counts = forward_comms.get_comm_counts()
            backward_counts = backward_comms.get_comm_counts()
            if hidden:
                # all-reduces of per-row fp32 sums only, nothing gathered: RMSNorm one each
                # way; LayerNorm two in the forward (sum of x, then of squared deviations
                # from the row's mean) and one in the backward (sum(g), sum(g * x_hat) stacked)
                forward_reduces = 2 if op == "layer_norm" else 1
                assert forward_counts == {funcol_ops.all_reduce: forward_reduces}, \
                    f"{what}: {forward_counts}"
                assert backward_counts == {funcol_ops.all_reduce: 1}, f"{what}: {backward_counts}"
            else:
                assert forward_comms.get_total_counts() == 0, f"{what}: {forward_counts}"
                assert backward_comms.get_total_counts() == 0, f"{what}: {backward_counts}"
            # weight gradients: Partial over sharded rows, sharded like the weight when the
            # hidden dimension is, else replicated
            expected_dw = Shard(0) if hidden else (Replicate() if p.is_replicate() else Partial())
            assert tuple(dw_d.placements) == (expected_dw,), f"{what}: dw {dw_d.placements}"

            exact = not hidden
            for i, o in enumerate(outs_d):
                _check(o, expected["out"][i], exact, f"{what}: output {i}")
            _check(dx_d, expected["dx"], exact, f"{what}: dx")
            if op == "fused_add":
                _check(dr_d, expected["dr"], exact, f"{what}: dresidual")
            # dw/db are reduced across ranks in another order than one process sums its rows
            dw_exact = p.is_replicate()
            _check(dw_d, expected["dw"], dw_exact, f"{what}: dw")
            if op == "layer_norm":
                _check(db_d, expected["db"], dw_exact, f"{what}: db")


def _bad_arguments(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    x = distribute_tensor(torch.randn(4, 6), mesh, [Shard(1)])
    with pytest.raises(RuntimeError, match="fusednorm::rms_norm.*'weight'"):
        fusednorm.rms_norm(x, distribute_tensor(torch.randn(5), mesh, [Replicate()]))
    with pytest.raises(TypeError, match="inplace=False"):
        fusednorm.fused_add_rms_norm(x, x.clone())
    # a Partial x is reduced first (a norm needs the sum), then normalized locally
    parts = torch.randn(4, 6, generator=torch.Generator().manual_seed(5))  # same on every rank
    xp = DTensor.from_local(parts * (rank + 1), mesh, [Partial()])
    full = parts * sum(range(1, world + 1))
    torch.testing.assert_close(fusednorm.rms_norm(xp).full_tensor(), fusednorm.rms_norm(full))
    # a plain weight is the replicated value
    g = torch.Generator().manual_seed(6)
    xr = distribute_tensor(torch.randn(4, 6, generator=g), mesh, [Shard(0)])
    w = torch.randn(6, generator=g)
    assert torch.equal(
        fusednorm.rms_norm(xr, w).full_tensor(), fusednorm.rms_norm(xr.full_tensor(), w)
    )


@pytest.mark.parametrize("world", [2, 3])
def test_placements_match_single_process(world):
    # 3 ranks: shards of uneven size on every dimension (7 rows, 5 positions, 10 columns)
    shape = (3, 5, 10) if world == 3 else (4, 6, 64)
    run_on_ranks(_placement_body, world, shape)


def _placement_body(rank, world, shape):
    for dtype in (torch.float32, torch.bfloat16):
        _placement_cases(rank, world, shape, dtype)
    _bad_arguments(rank, world)

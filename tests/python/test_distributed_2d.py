"""fusednorm on a 2 x 2 device mesh (4 gloo processes): DTensor placements that combine
row sharding, replication and hidden sharding over two mesh dimensions, against the
single-process result; and a tiny Llama trained with FSDP2 over one mesh dimension and
tensor + sequence parallel over the other.

The rule under test: every mesh dimension is handled by its own placement. A mesh dimension
sharding the hidden (last) dimension all-reduces the per-row fp32 sums over its own group
only; one sharding rows (or replicating) needs no communication in either direction, and
dw / db come back Partial() (rows sharded) or Replicate() over it. So the collectives
counted per call are the 1-D counts times the number of mesh dimensions sharding the hidden
dimension, and none otherwise.

Exactness as in test_distributed.py: with whole rows on every rank y and dx are bit-identical
to one process; with the hidden dimension sharded, and for dw / db reduced across ranks,
fp32 tolerance (normalized error).
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
from test_distributed import _case_inputs, _check, _ops, _single_process  # noqa: E402

MESH = (2, 2)
WORLD = MESH[0] * MESH[1]
funcol_ops = torch.ops.c10d_functional  # the keys CommDebugMode counts under

# x is (batch, sequence, hidden): dims 0 and 1 are rows, 2 is the hidden dimension.
H = Shard(2)
PLACEMENTS = [
    (Shard(0), H),  # rows over the first mesh dimension, hidden over the second
    (H, Shard(1)),  # hidden over the first, rows over the second
    (Shard(0), Replicate()),
    (Replicate(), Shard(1)),
    (Shard(0), Shard(1)),
    (Shard(1), Shard(1)),  # both mesh dimensions split the sequence
    (Replicate(), H),
    (H, H),  # the hidden dimension split over both: an all-reduce over each
]


def _placement_cases(mesh, shape, dtype) -> None:
    x, r, w, b, dys = _case_inputs(shape, dtype, 4321)

    for op in ("rms_norm", "fused_add", "layer_norm"):
        reference, call = _ops(op)
        expected = _single_process(reference, x, r, w, b, dys)

        for p in PLACEMENTS:
            hidden_dims = sum(1 for q in p if q == H)
            vec = [Shard(0) if q == H else Replicate() for q in p]
            xd, rd = (distribute_tensor(t, mesh, p).requires_grad_() for t in (x, r))
            wd, bd = (distribute_tensor(t, mesh, vec).requires_grad_() for t in (w, b))
            what = f"{op} {dtype} {p}"
            with CommDebugMode() as forward_comms:
                outs_d = call(xd, rd, wd, bd)
            for o in outs_d:
                assert isinstance(o, DTensor), f"{what}: {o}"
                assert tuple(o.placements) == p, f"{what}: {o.placements}"
            dys_d = [distribute_tensor(dy, mesh, p) for dy in dys[: len(outs_d)]]
            inputs = [xd, rd, wd, bd] if op == "fused_add" else [xd, wd, bd]
            with CommDebugMode() as backward_comms:
                grads = torch.autograd.grad(outs_d, inputs, dys_d, allow_unused=True)
            grad = dict(zip([id(t) for t in inputs], grads))

            # per-row sums all-reduced over each mesh dimension sharding the hidden
            # dimension (RMSNorm one per direction, LayerNorm two forward, one backward);
            # nothing else, and nothing gathered
            forward_reduces = hidden_dims * (2 if op == "layer_norm" else 1)
            forward_counts = forward_comms.get_comm_counts()
            backward_counts = backward_comms.get_comm_counts()
            if hidden_dims:
                assert forward_counts == {funcol_ops.all_reduce: forward_reduces}, \
                    f"{what}: {forward_counts}"
                assert backward_counts == {funcol_ops.all_reduce: hidden_dims}, \
                    f"{what}: {backward_counts}"
            else:
                assert forward_comms.get_total_counts() == 0, f"{what}: {forward_counts}"
                assert backward_comms.get_total_counts() == 0, f"{what}: {backward_counts}"

            expected_dw = tuple(
                Shard(0) if q == H else Replicate() if q.is_replicate() else Partial() for q in p
            )
            dw_d = grad[id(wd)]
            assert tuple(dw_d.placements) == expected_dw, f"{what}: dw {dw_d.placements}"

            exact = hidden_dims == 0
            for i, o in enumerate(outs_d):
                _check(o, expected["out"][i], exact, f"{what}: output {i}")
            _check(grad[id(xd)], expected["dx"], exact, f"{what}: dx")
            if op == "fused_add":
                _check(grad[id(rd)], expected["dr"], exact, f"{what}: dresidual")
            _check(dw_d, expected["dw"], False, f"{what}: dw")
            if op == "layer_norm":
                db_d = grad[id(bd)]
                assert tuple(db_d.placements) == expected_dw, f"{what}: db {db_d.placements}"
                _check(db_d, expected["db"], False, f"{what}: db")


def _placement_body(rank, world):
    mesh = init_device_mesh("cpu", MESH, mesh_dim_names=("dp", "tp"))
    # D = 10: the hidden dimension split over both mesh dimensions is uneven (5 -> 3 + 2)
    for dtype in (torch.float32, torch.bfloat16):
        _placement_cases(mesh, (4, 6, 10), dtype)


def test_2d_mesh_placements_match_single_process():
    run_on_ranks(_placement_body, WORLD)


# ---- A tiny Llama: FSDP2 over "dp", tensor + sequence parallel over "tp" -------------------


def _hsdp_tp_body(rank, world):
    from test_distributed_llama import _batches, _models, _tensor_and_sequence_parallel, _train
    from torch.distributed.fsdp import fully_shard

    model, reference = _models()
    mesh = init_device_mesh("cpu", MESH, mesh_dim_names=("dp", "tp"))
    tp, dp = mesh["tp"], mesh["dp"]
    seq = _tensor_and_sequence_parallel(model, tp)
    for layer in model.model.layers:
        fully_shard(layer, mesh=dp)
    fully_shard(model, mesh=dp)
    seen = []
    norm = model.model.layers[0].post_attention_layernorm
    norm.register_forward_hook(
        lambda mod, args, kwargs, out: seen.append((args[0], kwargs["residual"], *out)),
        with_kwargs=True,
    )
    # each "dp" group trains on its slice of the batch (the "tp" ranks of a group on the
    # same slice); FSDP2 averages the gradients over "dp": the whole batch's mean loss
    per_group = 2
    d = dp.get_local_rank()
    _train(
        model, reference, lambda ids: ids[d * per_group : (d + 1) * per_group],
        _batches(per_group * MESH[0]), "FSDP2(dp)+TP/SP(tp)",
    )
    # the fused norm sees DTensors sharded on the sequence over "tp"
    assert len(seen) > 0
    assert all(
        isinstance(t, DTensor) and tuple(t.placements) == (seq,) and t.device_mesh == tp
        for t in seen[0]
    ), seen[0]


def test_tiny_llama_fsdp2_and_tp_on_a_2d_mesh_trains_like_single_process():
    pytest.importorskip("transformers")
    run_on_ranks(_hsdp_tp_body, WORLD)

"""A tiny Llama (transformers, built here, nothing downloaded) patched by fusednorm.patch_hf
(fused residual add included) and trained for a few steps on 2 gloo processes, with FSDP2
(fully_shard) and with tensor parallel + sequence parallel (parallelize_module, the norms
under SequenceParallel): the losses and gradients match the single-process run of the
unpatched transformers model on the same data.

Tolerance: normalized error 1e-5 (fp32): the sharded runs sum gradients and matmul
partials in another order, and fusednorm multiplies by the weight in fp32 where
transformers first rounds (the same dtype here, fp32).
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import TINY_HF_CONFIG, tiny_llama
from dist_harness import run_on_ranks

transformers = pytest.importorskip("transformers")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

TOL = 1e-5
STEPS = 3
def _models():
    """(model patched by fusednorm, unpatched reference), same weights."""
    import fusednorm

    torch.manual_seed(0)
    model = tiny_llama()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
    reference = copy.deepcopy(model)
    fusednorm.patch_hf(model)
    layer = model.model.layers[0]
    assert type(layer).__name__ == "FusedAddLlamaDecoderLayer", type(layer)
    assert type(layer.post_attention_layernorm).__name__ == "HFFusedAddRMSNorm"
    return model, reference


def _batches(batch: int, seq: int = 8):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, TINY_HF_CONFIG["vocab_size"], (batch, seq), generator=g) for _ in range(STEPS)]


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _err(actual, expected) -> float:
    a, e = _full(actual).detach().double(), expected.detach().double()
    return ((a - e).abs().max() / e.abs().max().clamp_min(1e-2)).item()


def _compare_grads(model, reference, what):
    ref = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{what}: no gradient for {name}"
        err = _err(p.grad, ref[name].grad)
        assert err <= TOL, f"{what}: grad {name}: normalized error {err:.3g}"


def _train(model, reference, inputs_of, batches, what):
    opt = torch.optim.SGD(model.parameters(), lr=0.5, foreach=False)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5, foreach=False)
    for step, ids in enumerate(batches):
        local = inputs_of(ids)
        loss = model(input_ids=local, labels=local).loss
        loss.backward()
        ref_loss = reference(input_ids=ids, labels=ids).loss
        ref_loss.backward()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        mean_loss /= dist.get_world_size()
        assert abs(mean_loss.item() - ref_loss.item()) <= TOL * abs(ref_loss.item()), (
            f"{what} step {step}: loss {mean_loss.item()} vs {ref_loss.item()}"
        )
        _compare_grads(model, reference, f"{what} step {step}")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()


def _fsdp2_body(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model, reference = _models()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    per_rank = 2
    # each rank trains on its slice of the batch; FSDP2 averages the gradients, which is
    # the gradient of the whole batch's mean loss (equal token counts per rank)
    _train(
        model, reference, lambda ids: ids[rank * per_rank : (rank + 1) * per_rank],
        _batches(per_rank * world), "FSDP2",
    )


def _tensor_and_sequence_parallel(model, mesh):
    """Llama's TP + SP plan over the 1-D mesh: the norms get SequenceParallel, the linears
    column / row parallel; returns the sequence placement of the residual stream."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    # The residual stream stays a DTensor sharded on the sequence (use_local_output=False),
    # so transformers sees the global shape (masks, positions).
    seq = Shard(1)
    layer_plan = {
        "input_layernorm": SequenceParallel(),
        "self_attn.q_proj": ColwiseParallel(input_layouts=seq),
        "self_attn.k_proj": ColwiseParallel(input_layouts=seq),
        "self_attn.v_proj": ColwiseParallel(input_layouts=seq),
        "self_attn.o_proj": RowwiseParallel(output_layouts=seq, use_local_output=False),
        "post_attention_layernorm": SequenceParallel(),
        "mlp.gate_proj": ColwiseParallel(input_layouts=seq),
        "mlp.up_proj": ColwiseParallel(input_layouts=seq),
        "mlp.down_proj": RowwiseParallel(output_layouts=seq, use_local_output=False),
    }
    for layer in model.model.layers:
        parallelize_module(layer, mesh, layer_plan)
    parallelize_module(
        model,
        mesh,
        {
            "model.embed_tokens": RowwiseParallel(
                input_layouts=Replicate(), output_layouts=seq, use_local_output=False
            ),
            "model.norm": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Replicate()),
        },
    )
    return seq


def _tp_sp_body(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    model, reference = _models()
    mesh = init_device_mesh("cpu", (world,))
    seq = _tensor_and_sequence_parallel(model, mesh)
    # the fused norm receives and returns DTensors sharded on the sequence
    seen = []
    norm = model.model.layers[0].post_attention_layernorm
    norm.register_forward_hook(
        lambda mod, args, kwargs, out: seen.append((args[0], kwargs["residual"], *out)),
        with_kwargs=True,
    )
    # tensor parallel: every rank sees the whole batch
    _train(model, reference, lambda ids: ids, _batches(2), "TP+SP")
    from torch.distributed.tensor import DTensor

    assert len(seen) == STEPS
    assert all(isinstance(t, DTensor) and tuple(t.placements) == (seq,) for t in seen[0]), seen[0]


@pytest.mark.parametrize("body", [_fsdp2_body, _tp_sp_body], ids=["fsdp2", "tp_sp"])
def test_tiny_llama_trains_like_single_process(body):
    run_on_ranks(body, 2)

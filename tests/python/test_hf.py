"""patch_hf on small randomly initialised transformers models (nothing downloaded)."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import TOL, assert_close_normalized

import fusednorm
from fusednorm.hf import HFRMSNorm

transformers = pytest.importorskip("transformers")

SMALL = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
)


def _llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL))


def _gemma():
    return transformers.GemmaForCausalLM(transformers.GemmaConfig(**SMALL))


def _qwen3():
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SMALL))


def _gemma3():
    config = transformers.Gemma3TextConfig(**SMALL, sliding_window=16)
    return transformers.Gemma3ForCausalLM(config)


MODELS = {
    "llama": (_llama, "LlamaRMSNorm", 2 * 2 + 1),
    "gemma": (_gemma, "GemmaRMSNorm", 2 * 2 + 1),
    "qwen3": (_qwen3, "Qwen3RMSNorm", 2 * 4 + 1),  # + q_norm / k_norm over head_dim
    "gemma3": (_gemma3, "Gemma3RMSNorm", 2 * 6 + 1),  # 4 norms per layer + q/k norms
}


def _randomize_norms(model):
    # Gemma zero-initialises its norm weights, which would hide a wrong (1 + w).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.5)


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), out.loss.detach(), grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("arch", MODELS, ids=str)
def test_patch_hf_same_logits_and_gradients(arch, dtype):
    make, norm_class, count = MODELS[arch]
    torch.manual_seed(0)
    model = make().to(dtype)
    _randomize_norms(model)
    reference = copy.deepcopy(model)
    ids = torch.randint(0, SMALL["vocab_size"], (2, 12))

    weights_before = {n: p for n, p in model.named_parameters()}
    replaced = fusednorm.patch_hf(model)
    assert len(replaced) == count and all(cls == norm_class for _, cls in replaced)
    # same Parameter objects, same state_dict
    assert {n: p for n, p in model.named_parameters()} == weights_before
    assert model.state_dict().keys() == reference.state_dict().keys()
    assert not any(type(m).__name__ == norm_class for m in model.modules())

    logits_ref, loss_ref, grads_ref = _loss_and_grads(reference, ids)
    logits, loss, grads = _loss_and_grads(model, ids)
    # Llama rounds the normalized value before the weight multiply, fusednorm once after
    # it: one bf16 rounding apart per norm (measured ~7e-3 on logits and gradients; Gemma's
    # cast order is fusednorm's, and matches bit for bit).
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert_close_normalized(logits, logits_ref, tol, "logits")
    assert abs(loss.item() - loss_ref.item()) <= tol * max(1.0, abs(loss_ref.item()))
    assert grads.keys() == grads_ref.keys()
    for name in grads_ref:
        assert_close_normalized(grads[name], grads_ref[name], tol, f"grad {name}")


def test_patch_hf_module_details():
    model = _gemma()
    replaced = fusednorm.patch_hf(model)
    norm = model.get_submodule(replaced[0][0])
    assert isinstance(norm, HFRMSNorm) and norm.weight_offset == 1.0
    assert norm.eps == norm.variance_epsilon == model.config.rms_norm_eps
    assert "GemmaRMSNorm" in repr(norm)
    assert fusednorm.patch_hf(model) == []  # idempotent

    llama = _llama()
    fusednorm.patch_hf(llama)
    norm = llama.model.norm
    assert norm.weight_offset == 0.0 and norm.variance_epsilon == llama.config.rms_norm_eps


def test_patch_hf_generic_rmsnorm_is_probed():
    class MyRMSNorm(torch.nn.Module):  # an unknown class following the Gemma convention
        def __init__(self, d):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(d))
            self.eps = 1e-6

        def forward(self, x):
            h = x.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
            return (h * (1.0 + self.weight.float())).type_as(x)

    class OddRMSNorm(MyRMSNorm):  # computes something else: must be left alone
        def forward(self, x):
            return x * 2

    model = torch.nn.Sequential(MyRMSNorm(8), OddRMSNorm(8))
    x = torch.randn(3, 8)
    expected = model[0](x)
    assert fusednorm.patch_hf(model) == [("0", "MyRMSNorm")]
    assert model[0].weight_offset == 1.0 and type(model[1]).__name__ == "OddRMSNorm"
    torch.testing.assert_close(model[0](x), expected)
    assert fusednorm.patch_hf(torch.nn.Sequential(MyRMSNorm(8)), include_generic=False) == []


def test_patch_hf_llama_fp32_weight_bf16_input_keeps_promotion():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hf = LlamaRMSNorm(32)
    with torch.no_grad():
        hf.weight.normal_()
    model = torch.nn.Sequential(hf)
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    expected = hf(x)
    fusednorm.patch_hf(model)
    y = model(x)
    assert y.dtype == expected.dtype == torch.float32
    assert_close_normalized(y, expected, 2 * TOL[torch.bfloat16], "y")


FUSED_LAYERS = {"llama": True, "gemma": True, "qwen3": True, "gemma3": False}


class _OpCounter(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("arch", MODELS, ids=str)
def test_patch_hf_fuses_the_residual_add(arch):
    make, _, _ = MODELS[arch]
    model = make()
    fusednorm.patch_hf(model)
    layers = model.model.layers
    fused = FUSED_LAYERS[arch]
    assert all(type(layer).__name__.startswith("FusedAdd") == fused for layer in layers)
    ids = torch.randint(0, SMALL["vocab_size"], (2, 6))
    with _OpCounter() as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    fused_calls = counter.counts.get("fusednorm.fused_add_rms_norm_fwd", 0)
    assert fused_calls == (len(layers) if fused else 0), counter.counts
    # the fused backward: rms_norm_backward with the addend, once per fused layer and once
    # per plain norm
    assert counter.counts.get("fusednorm.rms_norm_backward", 0) > 0
    # unfused on request
    plain = make()
    fusednorm.patch_hf(plain, fuse_add=False)
    assert not any(type(layer).__name__.startswith("FusedAdd") for layer in plain.model.layers)
    # deepcopy keeps the fused layers working
    twin = copy.deepcopy(model)
    torch.testing.assert_close(twin(input_ids=ids).logits, model(input_ids=ids).logits)

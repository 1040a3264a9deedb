"""patch_hf on small randomly initialised transformers models (nothing downloaded)."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import TINY_HF_CONFIG, TOL, assert_close_normalized, tiny_llama

import fusednorm
from fusednorm.hf import HFRMSNorm

transformers = pytest.importorskip("transformers")


def _gemma():
    return transformers.GemmaForCausalLM(transformers.GemmaConfig(**TINY_HF_CONFIG))


def _qwen3():
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**TINY_HF_CONFIG))


def _gemma3():
    config = transformers.Gemma3TextConfig(**TINY_HF_CONFIG, sliding_window=16)
    return transformers.Gemma3ForCausalLM(config)


MODELS = {
    "llama": (tiny_llama, "LlamaRMSNorm", 2 * 2 + 1),
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


def _patch_and_check_structure(model, arch):
    _, norm_class, count = MODELS[arch]
    weights_before = {n: p for n, p in model.named_parameters()}
    keys_before = model.state_dict().keys()
    replaced = fusednorm.patch_hf(model)
    assert len(replaced) == count and all(cls == norm_class for _, cls in replaced)
    # same Parameter objects, same state_dict
    assert {n: p for n, p in model.named_parameters()} == weights_before
    assert model.state_dict().keys() == keys_before
    assert not any(type(m).__name__ == norm_class for m in model.modules())


def _ids():
    return torch.randint(0, TINY_HF_CONFIG["vocab_size"], (2, 12))


@pytest.mark.parametrize("arch", MODELS, ids=str)
def test_patch_hf_fp32_same_logits_and_gradients(arch):
    torch.manual_seed(0)
    model = MODELS[arch][0]()
    _randomize_norms(model)
    reference = copy.deepcopy(model)
    ids = _ids()
    _patch_and_check_structure(model, arch)
    logits_ref, loss_ref, grads_ref = _loss_and_grads(reference, ids)
    logits, loss, grads = _loss_and_grads(model, ids)
    tol = 1e-5  # fp32 both ways: a few fp32 roundings apart
    assert_close_normalized(logits, logits_ref, tol, "logits")
    assert abs(loss.item() - loss_ref.item()) <= tol * max(1.0, abs(loss_ref.item()))
    assert grads.keys() == grads_ref.keys()
    for name in grads_ref:
        assert_close_normalized(grads[name], grads_ref[name], tol, f"grad {name}")


def _relative_error(actual: torch.Tensor, truth: torch.Tensor) -> float:
    """||actual - truth|| / ||truth|| (Frobenius): an average over every element, much less
    sensitive to one unlucky rounding than the max error."""
    a, t = actual.double(), truth.double()
    return ((a - t).norm() / t.norm().clamp_min(1e-300)).item()


def _errors(run, truth) -> dict[str, float]:
    logits, _, grads = run
    t_logits, _, t_grads = truth
    assert grads.keys() == t_grads.keys()
    return {
        "logits": _relative_error(logits, t_logits),
        # every parameter's gradient counts equally, whatever its scale
        "gradients": sum(_relative_error(grads[n], t_grads[n]) for n in t_grads) / len(t_grads),
    }


# Patching must not make a bf16 model measurably less accurate than transformers' own bf16
# path, both measured against an fp64 run of the same weights (the truth; transformers
# computes the rotary tables in fp32 even then). The two bf16 paths round at different
# places (Llama/Qwen: HF rounds the normalized value to bf16, then the product with the
# weight; fusednorm rounds once, after the weight. Gemma: the same order, bit-identical),
# so each is one draw of bf16 rounding error through the whole model, and the errors
# fluctuate around the same size; the SIMD target (AVX2 or AVX-512 reduction order) moves
# them too. Measured on AVX2 over seeds 0-19 x the 4 architectures (the patched / unpatched
# ratio of these errors): median 0.95 (logits) and 0.94 (gradients) for Llama and Qwen3,
# 1.000 for the Gemmas, worst 1.03 (logits) and 1.04 (gradients). ACCURACY_MARGIN = 1.10
# is about twice that worst spread: a systematic loss of accuracy in the patched path moves
# the ratio of every draw, not one draw in 80. The loss is one
# scalar computed from the logits, one sample of their error, so it is only checked to be
# near the truth (measured relative error <= 2e-4 for both paths).
ACCURACY_MARGIN = 1.10


@pytest.mark.parametrize("arch", MODELS, ids=str)
def test_patch_hf_bf16_not_less_accurate_than_transformers(arch):
    torch.manual_seed(0)
    master = MODELS[arch][0]()
    _randomize_norms(master)
    ids = _ids()
    truth = _loss_and_grads(copy.deepcopy(master).double(), ids)
    unpatched = copy.deepcopy(master).to(torch.bfloat16)
    patched = copy.deepcopy(master).to(torch.bfloat16)
    _patch_and_check_structure(patched, arch)

    hf_run = _loss_and_grads(unpatched, ids)
    our_run = _loss_and_grads(patched, ids)
    hf, ours = _errors(hf_run, truth), _errors(our_run, truth)
    for what in hf:
        assert ours[what] <= ACCURACY_MARGIN * hf[what], (
            f"{arch} bf16 {what}: error vs fp64 {ours[what]:.3g} patched, {hf[what]:.3g} "
            f"with transformers' RMSNorm (margin {ACCURACY_MARGIN}x)"
        )
    truth_loss = truth[1].item()
    for name, run in (("patched", our_run), ("transformers", hf_run)):
        assert abs(run[1].item() - truth_loss) <= 1e-3 * abs(truth_loss), (name, run[1], truth_loss)


def test_patch_hf_module_details():
    model = _gemma()
    replaced = fusednorm.patch_hf(model)
    norm = model.get_submodule(replaced[0][0])
    assert isinstance(norm, HFRMSNorm) and norm.weight_offset == 1.0
    assert norm.eps == norm.variance_epsilon == model.config.rms_norm_eps
    assert "GemmaRMSNorm" in repr(norm)
    assert fusednorm.patch_hf(model) == []  # idempotent

    llama = tiny_llama()
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
    ids = torch.randint(0, TINY_HF_CONFIG["vocab_size"], (2, 6))
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

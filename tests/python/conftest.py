"""Shared helpers for the fusednorm PyTorch tests.

Results are compared with fp64 math (the stepwise definition evaluated in float64) using an
error normalized by the largest magnitude of the expected tensor, as ggml's backend tests
do: elementwise relative error is meaningless for gradients, whose entries cancel.
"""

from __future__ import annotations

import pytest
import torch

import fusednorm  # noqa: F401  (loads the extension)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# Tolerance on max|actual - expected| / max|expected|: a few units of the dtype's rounding
# (the kernels round once; torch's and HF's stepwise code rounds intermediate values).
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}

# The tiny decoder configuration every Hugging Face test builds (no download): two layers,
# hidden 64, grouped-query attention; shared so that the single-process, distributed and
# quantized tests run the same model.
TINY_HF_CONFIG = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
)


def tiny_llama():
    """A randomly initialised LlamaForCausalLM of TINY_HF_CONFIG (needs transformers)."""
    import transformers

    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_HF_CONFIG))


requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or not fusednorm.has_cuda(),
    reason=(
        "no CUDA device visible to torch"
        if not torch.cuda.is_available()
        else "fusednorm was built without its CUDA backend (FUSEDNORM_CUDA=OFF)"
    ),
)


def assert_close_normalized(
    actual: torch.Tensor, expected: torch.Tensor, tol: float, what="", floor: float = 1e-2
):
    """max|actual - expected| <= tol * max(max|expected|, floor); the floor covers tensors
    that are mathematically ~0 (dx of a D = 1 row)."""
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    a = actual.detach().double().cpu()
    e = expected.detach().double().cpu()
    assert torch.isfinite(a).all(), f"{what}: non-finite values"
    scale = max(e.abs().max().item(), floor) if e.numel() else 1.0
    err = (a - e).abs().max().item() / scale if e.numel() else 0.0
    assert err <= tol, f"{what}: normalized error {err:.3g} > {tol:.3g}"


def rms_norm_ref(x, weight=None, eps=1e-6, weight_offset=0.0):
    """fp64 stepwise RMSNorm (the definition)."""
    xd = x.double()
    y = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * (weight.double() + weight_offset)
    return y


def layer_norm_ref(x, weight=None, bias=None, eps=1e-5):
    xd = x.double()
    y = torch.nn.functional.layer_norm(
        xd, (x.shape[-1],), None if weight is None else weight.double(),
        None if bias is None else bias.double(), eps,
    )
    return y


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)

"""W8A8 inference on the CPU: INT8 weights (per output channel), INT8 activations (per token),
an INT8 GEMM by oneDNN, and the quantized RMSNorm feeding it.

The pieces:

* ``quantize_weight(w)``: symmetric per-output-channel INT8, done once when a linear is
  converted. ``w_scale[n] = amax(|w[n, :]|) / qmax_w``.
* ``quantize_per_token(x)``: the plain dynamic per-token quantize for activations that no
  norm precedes (the inputs of o_proj and down_proj): ``scale[r] = max(amax_r(|x|) / 127,
  FLT_EPSILON)`` and ``q = clamp(round_half_even(x * (1 / scale)), -128, 127)``, the same
  formula ``rms_norm_quant`` applies to the normalized row (reciprocal multiplied, vLLM's
  floor), in four torch elementwise/reduction passes.
* ``W8A8Linear``: the GEMM on ``(q, token_scale)``, by FBGEMM for few tokens (decode) and
  oneDNN for many (prefill), both inside torch; each computes ``acc[m, n] * w_scale[n]`` in
  fp32 (activation scale 1, so the per-channel dequantization is its output scaling); the
  per-token scale is applied once afterwards, in one in-place multiply (both take a
  per-tensor activation scale only), fused with the bias add when there is one. Both want
  the activation as uint8 with zero point 128: oneDNN (``torch.ops.onednn.qlinear_*``, the
  int8 path of inductor's x86 quantization) gets ``q XOR 0x80`` (= q + 128), one byte
  pass; FBGEMM (``quantized.linear_with_input_q_dq_qweight_dq_output_fp32``) gets ``q`` as
  fp32 and quantizes it with scale 1 and zero point 128 itself, which is exact.
* ``QuantizedRMSNorm`` + ``patch_hf_w8a8``: a Hugging Face Llama-class decoder's
  ``input_layernorm`` and ``post_attention_layernorm`` become norms that quantize once
  (``fusednorm.rms_norm_quant``, dynamic per token) and hand a ``QuantizedActivation`` to
  the linears that read them (q/k/v, gate/up); o_proj and down_proj quantize their input
  with ``quantize_per_token``.

Why these libraries and why 7-bit weights on this CPU: see python/README.md "W8A8". On CPUs
without VNNI (AVX2, AVX-512 without VNNI) oneDNN and FBGEMM multiply u8 x s8 with
``vpmaddubsw``, which adds two products in saturating int16: 255 * 127 * 2 overflows, and
the GEMM is silently wrong (measured: 18 % relative error on random int8 data). Weights in [-64, 63]
keep every pair sum in range (255 * 64 * 2 = 32640), so there the weights are quantized
with ``qmax_w = 63``; with VNNI (``vpdpbusd`` accumulates in int32) ``qmax_w = 127``.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch import nn

from . import functional as F
from . import hf

__all__ = [
    "QuantizedActivation",
    "QuantizedRMSNorm",
    "W8A8Linear",
    "patch_hf_w8a8",
    "quantize_per_token",
    "quantize_weight",
    "weight_qmax",
]

_INT8_MIN_SCALE = torch.finfo(torch.float32).eps  # rms_norm_quant's int8 floor (vLLM's)


@contextlib.contextmanager
def quantized_engine(name: str):
    """``torch.backends.quantized.engine = name`` for the duration of the block (a packing
    call picks its library from the global engine; the packed weight keeps it)."""
    previous = torch.backends.quantized.engine
    torch.backends.quantized.engine = name
    try:
        yield
    finally:
        torch.backends.quantized.engine = previous


def weight_qmax() -> int:
    """Largest weight magnitude the int8 GEMM can take without int16 saturation on this CPU:
    127 with VNNI, 63 without (see the module docstring)."""
    return 127 if torch.cpu._is_vnni_supported() else 63


def quantize_weight(w: torch.Tensor, qmax: int | None = None):
    """Symmetric per-output-channel INT8 of a ``[N, K]`` weight: ``(w_q int8 [N, K],
    w_scale fp32 [N])`` with ``w ~= w_q * w_scale[:, None]``."""
    qmax = weight_qmax() if qmax is None else qmax
    w = w.detach().float()
    scale = (w.abs().amax(dim=1) / qmax).clamp_min(_INT8_MIN_SCALE)
    w_q = torch.round(w / scale[:, None]).clamp_(-qmax, qmax).to(torch.int8)
    return w_q, scale


def quantize_per_token(x: torch.Tensor):
    """Dynamic per-token INT8 of ``x [..., K]`` (the formula of rms_norm_quant without the
    norm): ``(q int8 [..., K], scale fp32 [..., 1])``, ``q * scale ~= x``. Unlike
    rms_norm_quant, a NaN in a row gives that row a NaN scale (torch's amax propagates it)."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / 127.0).clamp_min_(_INT8_MIN_SCALE)
    q = torch.round(xf * scale.reciprocal()).clamp_(-128, 127).to(torch.int8)
    return q, scale


@dataclasses.dataclass(frozen=True)
class QuantizedActivation:
    """An activation quantized per token: ``q [..., K]`` (int8) and ``scale [..., 1]`` (fp32),
    ``q * scale`` dequantizes. What QuantizedRMSNorm returns and W8A8Linear reads; it is not
    a tensor, so code that would do float math on it fails loudly instead of silently
    promoting int8. ``shape`` is there for the attention's ``hidden_states.shape[:-1]``."""

    q: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scale


# Largest token count (GEMM rows M) that W8A8Linear's "auto" gives to FBGEMM; oneDNN above.
# Measured (python/README.md "Which GEMM, measured"; 4096 x 4096, four weight sets cycled,
# AVX2): FBGEMM is 4-8x faster than oneDNN at M = 1..16 and even at M = 64; oneDNN ~1.1-1.2x
# faster at M = 512.
FBGEMM_MAX_TOKENS = 64
_GEMMS = ("auto", "fbgemm", "onednn")


class W8A8Linear(nn.Module):
    """``y = x @ W.T + b`` with W in INT8 per output channel and x in INT8 per token.

    ``forward`` takes a ``QuantizedActivation`` (from QuantizedRMSNorm: quantized once for
    every linear reading it) or a float tensor (quantized here with quantize_per_token).
    The output has ``out_dtype`` (the original linear's dtype by default).

    ``gemm`` picks the INT8 GEMM library (both inside torch, both exact on the int8
    operands): ``"fbgemm"``, ``"onednn"``, or ``"auto"`` (default): FBGEMM for at most
    ``FBGEMM_MAX_TOKENS`` rows (decode), oneDNN above (prefill). ``"auto"`` keeps the
    weight packed for both, 2 bytes per weight in all (half of bf16); a single library
    keeps 1 byte."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, out_dtype=None,
        gemm: str = "auto",
    ):
        super().__init__()
        if gemm not in _GEMMS:
            raise ValueError(
                f"fusednorm.quant.W8A8Linear: gemm must be one of {_GEMMS}, got {gemm!r}"
            )
        has_fbgemm = "fbgemm" in torch.backends.quantized.supported_engines
        if gemm == "fbgemm" and not has_fbgemm:
            raise ValueError(
                "fusednorm.quant.W8A8Linear: gemm='fbgemm' but this torch has no FBGEMM"
            )
        self.out_features, self.in_features = weight.shape
        self.out_dtype = out_dtype or weight.dtype
        self.gemm = gemm if gemm != "auto" or has_fbgemm else "onednn"
        w_q, w_scale = quantize_weight(weight)
        self.register_buffer("weight_scale", w_scale)
        zero_points = torch.zeros(self.out_features, dtype=torch.int64)
        self.register_buffer("_w_zero_point", zero_points)
        # Each library's packed (blocked) layout of the int8 weight, made once.
        self._fbgemm_weight = None
        if gemm in ("auto", "fbgemm"):
            with quantized_engine("fbgemm"):
                self._fbgemm_weight = torch.ops.quantized.linear_prepack(
                    torch._make_per_channel_quantized_tensor(
                        w_q, w_scale.double(), zero_points, 0
                    ),
                    None,
                )
        self.register_buffer(
            "_onednn_weight",
            torch.ops.onednn.qlinear_prepack(w_q, None) if gemm in ("auto", "onednn") else None,
        )
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    @classmethod
    def from_linear(cls, linear: nn.Linear, gemm: str = "auto") -> W8A8Linear:
        return cls(linear.weight, linear.bias, linear.weight.dtype, gemm)

    def _int8_gemm(self, q: torch.Tensor) -> torch.Tensor:
        """``acc[m, n] * weight_scale[n]`` in fp32 for the int8 ``q [M, K]``."""
        use_fbgemm = self.gemm == "fbgemm" or (
            self.gemm == "auto" and q.shape[0] <= FBGEMM_MAX_TOKENS
        )
        if use_fbgemm:
            # FBGEMM's one linear with an fp32 output takes an fp32 activation and quantizes
            # it per tensor inside: with scale 1 and zero point 128 the integer-valued q
            # becomes exactly q + 128 (uint8). The per-token scale is applied after.
            return torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
                q.float(), 1.0, 128, self._fbgemm_weight
            )
        # int8 -> uint8 with zero point 128: two's complement q XOR 0x80 is q + 128.
        q_u8 = q.view(torch.uint8).bitwise_xor(0x80)
        return torch.ops.onednn.qlinear_pointwise(
            q_u8, 1.0, 128, self._onednn_weight, self.weight_scale, self._w_zero_point,
            None, 1.0, 0, torch.float32, "none", [], "",
        )

    def forward(self, x) -> torch.Tensor:
        if isinstance(x, QuantizedActivation):
            act = x
        else:
            act = QuantizedActivation(*quantize_per_token(x))
        y = self._int8_gemm(act.q.reshape(-1, self.in_features))
        token_scale = act.scale.reshape(-1, 1)
        if self.bias is None:
            y.mul_(token_scale)
        else:
            y = torch.addcmul(self.bias, y, token_scale)
        y = y.view(*act.q.shape[:-1], self.out_features)
        return y if self.out_dtype == torch.float32 else y.to(self.out_dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, out_dtype={self.out_dtype}, gemm={self.gemm}"
        )


class QuantizedRMSNorm(nn.Module):
    """RMSNorm whose output is INT8 per token (``fusednorm.rms_norm_quant``, dynamic
    scale): returns a ``QuantizedActivation`` that every W8A8Linear reading it shares, so
    the activation is normalized and quantized once for all of them.

    ``forward(x, residual=r)`` (the fused-add decoder forward of fusednorm.hf, which
    patch_hf_w8a8 installs) returns ``(quantized norm of x + r, x + r)`` in one
    ``fused_add_rms_norm_quant`` call. That operator adds in place into its ``residual``
    argument; it is given ``x`` there (the attention output, dead after the call) and ``r``
    as its ``x``, so the caller's residual (the layer's input, which transformers may keep
    in its collected hidden states) is left intact, and the returned sum is ``x``'s buffer.
    The swap changes no bit: an IEEE addition is commutative."""

    takes_residual = True  # fusednorm.hf._fuse_adds keeps this norm as it is

    def __init__(self, weight: torch.Tensor | None, eps: float, weight_offset: float = 0.0):
        super().__init__()
        self.weight = None if weight is None else nn.Parameter(weight.detach(), requires_grad=False)
        self.eps = float(eps)
        self.weight_offset = float(weight_offset)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            q, scale = F.rms_norm_quant(
                x, self.weight, self.eps, dtype=torch.int8, weight_offset=self.weight_offset
            )
            return QuantizedActivation(q, scale)
        q, scale = F.fused_add_rms_norm_quant(
            residual, x, self.weight, self.eps, dtype=torch.int8, weight_offset=self.weight_offset
        )
        return QuantizedActivation(q, scale), x

    def extra_repr(self) -> str:
        return f"eps={self.eps}, weight_offset={self.weight_offset}"


# Decoder-layer shape this patch knows (Llama, Mistral, Qwen2, Qwen3 in transformers 5.x):
# norm -> the linears that read its output.
_NORM_CONSUMERS = {
    "input_layernorm": ("self_attn", ("q_proj", "k_proj", "v_proj")),
    "post_attention_layernorm": ("mlp", ("gate_proj", "up_proj")),
}
_UNNORMED_LINEARS = (("self_attn", "o_proj"), ("mlp", "down_proj"))
_LLAMA_STYLE = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})


def patch_hf_w8a8(model: nn.Module, fuse_add: bool = True, gemm: str = "auto") -> list[str]:
    """Make a Hugging Face Llama-class model W8A8 in place (inference only): in every
    decoder layer, input_layernorm and post_attention_layernorm become QuantizedRMSNorm and
    q/k/v/o and gate/up/down become W8A8Linear. Embeddings, the final norm and lm_head stay
    as they are. Returns the names of the decoder layers converted. ``gemm``: the
    W8A8Linear's GEMM library ("auto", "fbgemm", "onednn"; see W8A8Linear).

    With ``fuse_add``, the layers fusednorm.patch_hf would fuse (``hf.FUSED_ADD_DECODER_
    LAYERS``) also take the residual add before post_attention_layernorm into it (one
    ``fused_add_rms_norm_quant`` call: the same sum; a per-token scale may differ from the
    unfused one by one fp32 ulp, see python/README.md); the layer's class becomes
    ``FusedAdd<Class>``, see fusednorm.hf).

    Llama-style norms only (``weight * normalized`` without offset); the norms' outputs are
    fed to nothing but the listed linears in these layers' forwards, which is what makes it
    correct to hand them a QuantizedActivation."""
    converted = []
    for name, layer in model.named_modules():
        if not all(hasattr(layer, n) for n in _NORM_CONSUMERS):
            continue
        for norm_name, (block_name, linear_names) in _NORM_CONSUMERS.items():
            norm = getattr(layer, norm_name)
            if type(norm).__name__ not in _LLAMA_STYLE:
                raise TypeError(
                    f"fusednorm.patch_hf_w8a8: {name}.{norm_name} is a {type(norm).__name__}; "
                    f"only {sorted(_LLAMA_STYLE)} are supported"
                )
            eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))
            setattr(layer, norm_name, QuantizedRMSNorm(norm.weight, eps))
            block = getattr(layer, block_name)
            for linear_name in linear_names:
                linear = W8A8Linear.from_linear(getattr(block, linear_name), gemm)
                setattr(block, linear_name, linear)
        for block_name, linear_name in _UNNORMED_LINEARS:
            block = getattr(layer, block_name)
            setattr(block, linear_name, W8A8Linear.from_linear(getattr(block, linear_name), gemm))
        converted.append(name)
    if fuse_add:
        hf._fuse_adds(model)
    return converted

"""W8A8 inference: weights quantized per output channel, activations per token, in INT8
(GEMM by FBGEMM / oneDNN, CPU) or FP8 E4M3 (GEMM by ``torch._scaled_mm``, CPU and CUDA), and
the quantized RMSNorm feeding it.

The pieces:

* ``quantize_weight(w, dtype=...)``: symmetric per-output-channel INT8 or FP8, done once when
  a linear is converted. INT8: ``w_scale[n] = amax(|w[n, :]|) / qmax_w``; FP8:
  ``w_scale[n] = max(amax(|w[n, :]|) / 448, 1 / (448 * 512))`` (the activations' formula).
* ``quantize_per_token(x, dtype=...)``: the plain dynamic per-token quantize for activations
  that no norm precedes (the inputs of o_proj and down_proj): ``scale[r] = max(amax_r(|x|) /
  qmax, min_scale)`` and ``q = saturate(round_half_even(x * (1 / scale)))``, the same
  formula ``rms_norm_quant`` applies to the normalized row (reciprocal multiplied, vLLM's
  floors: qmax 127 / min_scale FLT_EPSILON for int8, 448 / 1 / (448 * 512) for FP8), in four
  torch elementwise/reduction passes.
* ``W8A8Linear``: the GEMM on ``(q, token_scale)``, by FBGEMM for few tokens (decode) and
  oneDNN for many (prefill), both inside torch; each computes ``acc[m, n] * w_scale[n]`` in
  fp32 (activation scale 1, so the per-channel dequantization is its output scaling); the
  per-token scale is applied once afterwards, in one in-place multiply (both take a
  per-tensor activation scale only), fused with the bias add when there is one. Both want
  the activation as uint8 with zero point 128: oneDNN (``torch.ops.onednn.qlinear_*``, the
  int8 path of inductor's x86 quantization) gets ``q XOR 0x80`` (= q + 128), one byte
  pass; FBGEMM (``quantized.linear_with_input_q_dq_qweight_dq_output_fp32``) gets ``q`` as
  fp32 and quantizes it with scale 1 and zero point 128 itself, which is exact.
  FP8 (``dtype=torch.float8_e4m3fn``): ``torch._scaled_mm``. On CUDA with row-wise scales
  (the per-token and per-channel scales applied inside; written from torch's source, not
  run: no GPU where this was written). On the CPU this torch takes
  per-tensor scales only, so it runs with unit scales and an fp32 output, and both scales
  are applied afterwards as in the int8 path (they factor out of the dot product).
* ``QuantizedRMSNorm`` + ``patch_hf_w8a8``: a Hugging Face Llama-class decoder's
  ``input_layernorm`` and ``post_attention_layernorm`` become norms that quantize once
  (``fusednorm.rms_norm_quant``, dynamic per token) and hand a ``QuantizedActivation`` to
  the linears that read them (q/k/v, gate/up); o_proj and down_proj quantize their input
  with ``quantize_per_token``.

Why these libraries and why 7-bit int8 weights on this CPU: see python/README.md "W8A8". On CPUs
without VNNI (AVX2, AVX-512 without VNNI) oneDNN and FBGEMM multiply u8 x s8 with
``vpmaddubsw``, which adds two products in saturating int16: 255 * 127 * 2 overflows, and
the GEMM is silently wrong (measured: 18 % relative error on random int8 data). Weights in [-64, 63]
keep every pair sum in range (255 * 64 * 2 = 32640), so there the weights are quantized
with ``qmax_w = 63``; with VNNI (``vpdpbusd`` accumulates in int32) ``qmax_w = 127``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch
from torch import nn

from . import functional as F
from . import hf

__all__ = [
    "QuantizedActivation",
    "QuantizedRMSNorm",
    "W8A8Linear",
    "fp8_unsupported_reason",
    "patch_hf_w8a8",
    "quantize_per_token",
    "quantize_weight",
    "weight_qmax",
]

_INT8_MIN_SCALE = torch.finfo(torch.float32).eps  # rms_norm_quant's int8 floor (vLLM's)
# FP8 E4M3 (OCP e4m3fn), None on a torch without it: its largest finite value and
# rms_norm_quant's FP8 floor (vLLM's).
_FP8 = getattr(torch, "float8_e4m3fn", None)
_FP8_MAX = 448.0
_FP8_MIN_SCALE = 1.0 / (448.0 * 512.0)
_DTYPES = tuple(d for d in (torch.int8, _FP8) if d is not None)


def _check_dtype(dtype, where: str) -> None:
    if dtype not in _DTYPES:
        raise ValueError(
            f"fusednorm.quant.{where}: dtype must be one of {_DTYPES}, got {dtype!r}"
        )


@functools.lru_cache(maxsize=None)
def fp8_unsupported_reason() -> str | None:
    """Why this torch cannot run the FP8 W8A8 path on the CPU, or None if it can (it has
    float8_e4m3fn and its ``torch._scaled_mm`` runs on the CPU)."""
    if _FP8 is None:
        return f"torch {torch.__version__} has no torch.float8_e4m3fn"
    if not hasattr(torch, "_scaled_mm"):
        return f"torch {torch.__version__} has no torch._scaled_mm"
    a = torch.zeros(1, 16, dtype=_FP8)
    one = torch.ones(())
    try:
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError) as e:
        return f"torch {torch.__version__}: torch._scaled_mm fails on the CPU: {e}"
    return None


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


def _quantize_rows_fp8(xf: torch.Tensor):
    """rms_norm_quant's dynamic FP8 formula on the rows of the fp32 ``xf [..., K]``:
    ``scale = max(amax / 448, 1 / (448 * 512))``, ``q = saturate(rne(x * (1 / scale)))``.
    The clamp is the saturation: torch's fp32 -> e4m3fn cast rounds to nearest even but
    makes NaN of anything beyond 464 (measured), where the operator saturates to 448."""
    scale = (xf.abs().amax(dim=-1, keepdim=True) / _FP8_MAX).clamp_min_(_FP8_MIN_SCALE)
    q = (xf * scale.reciprocal()).clamp_(-_FP8_MAX, _FP8_MAX).to(_FP8)
    return q, scale


def quantize_weight(w: torch.Tensor, qmax: int | None = None, dtype: torch.dtype = torch.int8):
    """Symmetric per-output-channel quantization of a ``[N, K]`` weight: ``(w_q [N, K] in
    dtype, w_scale fp32 [N])`` with ``w ~= w_q * w_scale[:, None]``. ``torch.int8``: in
    [-qmax, qmax] (default ``weight_qmax()``); ``torch.float8_e4m3fn``: amax / 448 per channel,
    floored at 1 / (448 * 512) (so an all-zero channel gets q = 0), no qmax."""
    _check_dtype(dtype, "quantize_weight")
    w = w.detach().float()
    if dtype == _FP8:
        if qmax is not None:
            raise ValueError(
                "fusednorm.quant.quantize_weight: qmax is for int8 weights; "
                f"dtype={dtype} always uses 448"
            )
        w_q, scale = _quantize_rows_fp8(w)
        return w_q, scale.squeeze(1)
    qmax = weight_qmax() if qmax is None else qmax
    scale = (w.abs().amax(dim=1) / qmax).clamp_min(_INT8_MIN_SCALE)
    w_q = torch.round(w / scale[:, None]).clamp_(-qmax, qmax).to(torch.int8)
    return w_q, scale


def quantize_per_token(x: torch.Tensor, dtype: torch.dtype = torch.int8):
    """Dynamic per-token INT8 or FP8 E4M3 of ``x [..., K]`` (the formula of rms_norm_quant
    without the norm): ``(q [..., K] in dtype, scale fp32 [..., 1])``, ``q * scale ~= x``.
    Unlike rms_norm_quant, a NaN in a row gives that row a NaN scale (torch's amax
    propagates it)."""
    _check_dtype(dtype, "quantize_per_token")
    xf = x.float()
    if dtype == _FP8:
        return _quantize_rows_fp8(xf)
    scale = (xf.abs().amax(dim=-1, keepdim=True) / 127.0).clamp_min_(_INT8_MIN_SCALE)
    q = torch.round(xf * scale.reciprocal()).clamp_(-128, 127).to(torch.int8)
    return q, scale


@dataclasses.dataclass(frozen=True)
class QuantizedActivation:
    """An activation quantized per token: ``q [..., K]`` (int8 or float8_e4m3fn) and
    ``scale [..., 1]`` (fp32), ``q * scale`` dequantizes. What QuantizedRMSNorm returns and
    W8A8Linear reads; it is not a tensor, so code that would do float math on it fails
    loudly instead of silently promoting q. ``shape`` is there for the attention's
    ``hidden_states.shape[:-1]``."""

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


def _check_gemm(gemm: str, dtype, where: str) -> None:
    if gemm not in _GEMMS:
        raise ValueError(f"fusednorm.quant.{where}: gemm must be one of {_GEMMS}, got {gemm!r}")
    if dtype == _FP8 and gemm != "auto":
        raise ValueError(
            f"fusednorm.quant.{where}: gemm={gemm!r} is an int8 GEMM library; with "
            f"dtype={dtype} the GEMM is torch._scaled_mm, pass gemm='auto'"
        )


class W8A8Linear(nn.Module):
    """``y = x @ W.T + b`` with W quantized per output channel and x per token, both in
    ``dtype``: ``torch.int8`` (default) or ``torch.float8_e4m3fn``.

    ``forward`` takes a ``QuantizedActivation`` of that dtype (from QuantizedRMSNorm:
    quantized once for every linear reading it) or a float tensor (quantized here with
    quantize_per_token). The output has ``out_dtype`` (the original linear's dtype by
    default).

    ``gemm`` picks the INT8 GEMM library (both inside torch, both exact on the int8
    operands): ``"fbgemm"``, ``"onednn"``, or ``"auto"`` (default): FBGEMM for at most
    ``FBGEMM_MAX_TOKENS`` rows (decode), oneDNN above (prefill). ``"auto"`` keeps the
    weight packed for both, 2 bytes per weight in all (half of bf16); a single library
    keeps 1 byte. FP8 has one GEMM, ``torch._scaled_mm`` (``gemm="auto"`` only), and keeps
    the weight once, 1 byte per weight, ``[N, K]`` row-major (column-major as the GEMM's
    second operand, which CUDA requires; on the CPU a row-major ``[K, N]`` copy would run
    25 % faster at 1 x 4096 x 4096, measured, but the CPU path is a fallback, 20-60x slower
    than int8)."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, out_dtype=None,
        gemm: str = "auto", dtype: torch.dtype = torch.int8,
    ):
        super().__init__()
        _check_dtype(dtype, "W8A8Linear")
        _check_gemm(gemm, dtype, "W8A8Linear")
        self.dtype = dtype
        self.out_features, self.in_features = weight.shape
        self.out_dtype = out_dtype or weight.dtype
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        if dtype == _FP8:
            self.gemm = "scaled_mm"
            w_q, w_scale = quantize_weight(weight, dtype=dtype)
            self.register_buffer("weight_fp8", w_q)
            self.register_buffer("weight_scale", w_scale)
            return
        has_fbgemm = "fbgemm" in torch.backends.quantized.supported_engines
        if gemm == "fbgemm" and not has_fbgemm:
            raise ValueError(
                "fusednorm.quant.W8A8Linear: gemm='fbgemm' but this torch has no FBGEMM"
            )
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

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, gemm: str = "auto", dtype: torch.dtype = torch.int8
    ) -> W8A8Linear:
        return cls(linear.weight, linear.bias, linear.weight.dtype, gemm, dtype)

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

    def _fp8_gemm_cpu(self, q: torch.Tensor) -> torch.Tensor:
        """``acc[m, n] * weight_scale[n]`` in fp32 for the e4m3 ``q [M, K]`` on the CPU,
        where torch._scaled_mm takes per-tensor scales only (row-wise ones raise "Now
        _scaled_mm only supports per-tensor scaling for CPU backend"): unit scales, fp32
        output, the channel scale after (the per-token one in forward, as for int8)."""
        one = torch.ones((), device=q.device)
        acc = torch._scaled_mm(
            q, self.weight_fp8.t(), scale_a=one, scale_b=one, out_dtype=torch.float32
        )
        return acc.mul_(self.weight_scale)

    def _fp8_gemm_cuda(self, q: torch.Tensor, token_scale: torch.Tensor) -> torch.Tensor:
        """``acc[m, n] * token_scale[m] * weight_scale[n]`` by torch._scaled_mm with
        row-wise scales (not run here: no GPU). Its CUDA contract: first operand
        row-major, second column-major, K and N multiples of 16, scales fp32 and contiguous
        ([M, 1] and [1, N]), output bf16 / fp16 / fp32 (bf16 only on ROCm), a GPU with FP8
        (sm_89+, MI300+). bf16 out for a bf16 linear, fp32 otherwise; the bias is added
        after (torch._scaled_mm refuses a bias with an fp32 output)."""
        if self.in_features % 16 or self.out_features % 16:
            raise ValueError(
                "fusednorm.quant.W8A8Linear: dtype=torch.float8_e4m3fn on CUDA needs "
                "in_features and out_features divisible by 16 (torch._scaled_mm), got "
                f"in_features={self.in_features}, out_features={self.out_features}"
            )
        out_dtype = torch.bfloat16 if self.out_dtype == torch.bfloat16 else torch.float32
        return torch._scaled_mm(
            q.contiguous(), self.weight_fp8.t(),
            scale_a=token_scale.float().contiguous(),
            scale_b=self.weight_scale.view(1, -1),
            out_dtype=out_dtype,
        )

    def forward(self, x) -> torch.Tensor:
        if isinstance(x, QuantizedActivation):
            act = x
            if act.q.dtype != self.dtype:
                raise ValueError(
                    f"fusednorm.quant.W8A8Linear: x.q is {act.q.dtype}, this linear's "
                    f"dtype is {self.dtype}"
                )
        else:
            if x.dim() == 0 or x.shape[-1] != self.in_features:
                raise ValueError(
                    f"fusednorm.quant.W8A8Linear: x's last dimension must be in_features = "
                    f"{self.in_features}, got shape {tuple(x.shape)}"
                )
            act = QuantizedActivation(*quantize_per_token(x, self.dtype))
        if act.q.shape[-1] != self.in_features:
            raise ValueError(
                f"fusednorm.quant.W8A8Linear: x.q's last dimension must be in_features = "
                f"{self.in_features}, got shape {tuple(act.q.shape)}"
            )
        q = act.q.reshape(-1, self.in_features)
        token_scale = act.scale.reshape(-1, 1)
        if q.is_cuda:
            if self.dtype != _FP8:
                raise ValueError(
                    "fusednorm.quant.W8A8Linear: the int8 GEMMs (FBGEMM, oneDNN) are "
                    "CPU-only; on CUDA use dtype=torch.float8_e4m3fn"
                )
            y = self._fp8_gemm_cuda(q, token_scale)
            if self.bias is not None:
                y = y + self.bias
        else:
            y = self._fp8_gemm_cpu(q) if self.dtype == _FP8 else self._int8_gemm(q)
            if self.bias is None:
                y.mul_(token_scale)
            else:
                y = torch.addcmul(self.bias, y, token_scale)
        y = y.view(*act.q.shape[:-1], self.out_features)
        return y if y.dtype == self.out_dtype else y.to(self.out_dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, out_dtype={self.out_dtype}, dtype={self.dtype}, "
            f"gemm={self.gemm}"
        )


class QuantizedRMSNorm(nn.Module):
    """RMSNorm whose output is quantized per token to ``dtype`` (``torch.int8`` or
    ``torch.float8_e4m3fn``; ``fusednorm.rms_norm_quant``, dynamic scale): returns a
    ``QuantizedActivation`` that every W8A8Linear reading it shares, so the activation is
    normalized and quantized once for all of them.

    ``forward(x, residual=r)`` (the fused-add decoder forward of fusednorm.hf, which
    patch_hf_w8a8 installs) returns ``(quantized norm of x + r, x + r)`` in one
    ``fused_add_rms_norm_quant`` call. That operator adds in place into its ``residual``
    argument; it is given ``x`` there (the attention output, dead after the call) and ``r``
    as its ``x``, so the caller's residual (the layer's input, which transformers may keep
    in its collected hidden states) is left intact, and the returned sum is ``x``'s buffer.
    The swap changes no bit: an IEEE addition is commutative."""

    takes_residual = True  # fusednorm.hf._fuse_adds keeps this norm as it is

    def __init__(
        self, weight: torch.Tensor | None, eps: float, weight_offset: float = 0.0,
        dtype: torch.dtype = torch.int8,
    ):
        super().__init__()
        _check_dtype(dtype, "QuantizedRMSNorm")
        self.dtype = dtype
        self.weight = None if weight is None else nn.Parameter(weight.detach(), requires_grad=False)
        self.eps = float(eps)
        self.weight_offset = float(weight_offset)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            q, scale = F.rms_norm_quant(
                x, self.weight, self.eps, dtype=self.dtype, weight_offset=self.weight_offset
            )
            return QuantizedActivation(q, scale)
        q, scale = F.fused_add_rms_norm_quant(
            residual, x, self.weight, self.eps, dtype=self.dtype, weight_offset=self.weight_offset
        )
        return QuantizedActivation(q, scale), x

    def extra_repr(self) -> str:
        return f"eps={self.eps}, weight_offset={self.weight_offset}, dtype={self.dtype}"


# Decoder-layer shape this patch knows (Llama, Mistral, Qwen2, Qwen3 in transformers 5.x):
# norm -> the linears that read its output.
_NORM_CONSUMERS = {
    "input_layernorm": ("self_attn", ("q_proj", "k_proj", "v_proj")),
    "post_attention_layernorm": ("mlp", ("gate_proj", "up_proj")),
}
_UNNORMED_LINEARS = (("self_attn", "o_proj"), ("mlp", "down_proj"))
_LLAMA_STYLE = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})


def patch_hf_w8a8(
    model: nn.Module, fuse_add: bool = True, gemm: str = "auto", dtype: torch.dtype = torch.int8
) -> list[str]:
    """Make a Hugging Face Llama-class model W8A8 in place (inference only): in every
    decoder layer, input_layernorm and post_attention_layernorm become QuantizedRMSNorm and
    q/k/v/o and gate/up/down become W8A8Linear. Embeddings, the final norm and lm_head stay
    as they are. Returns the names of the decoder layers converted. ``dtype``: the weights'
    and activations' format, ``torch.int8`` (default) or ``torch.float8_e4m3fn`` (FP8 E4M3,
    GEMM by torch._scaled_mm). ``gemm``: the W8A8Linear's int8 GEMM library ("auto",
    "fbgemm", "onednn"; see W8A8Linear; FP8 takes "auto" only). Both are checked before
    the model is touched.

    With ``fuse_add``, the layers fusednorm.patch_hf would fuse (``hf.FUSED_ADD_DECODER_
    LAYERS``) also take the residual add before post_attention_layernorm into it (one
    ``fused_add_rms_norm_quant`` call: the same sum; a per-token scale may differ from the
    unfused one by one fp32 ulp, see python/README.md); the layer's class becomes
    ``FusedAdd<Class>``, see fusednorm.hf).

    Llama-style norms only (``weight * normalized`` without offset); the norms' outputs are
    fed to nothing but the listed linears in these layers' forwards, which is what makes it
    correct to hand them a QuantizedActivation."""
    _check_dtype(dtype, "patch_hf_w8a8")
    _check_gemm(gemm, dtype, "patch_hf_w8a8")
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
            setattr(layer, norm_name, QuantizedRMSNorm(norm.weight, eps, dtype=dtype))
            block = getattr(layer, block_name)
            for linear_name in linear_names:
                linear = W8A8Linear.from_linear(getattr(block, linear_name), gemm, dtype)
                setattr(block, linear_name, linear)
        for block_name, linear_name in _UNNORMED_LINEARS:
            block = getattr(layer, block_name)
            linear = W8A8Linear.from_linear(getattr(block, linear_name), gemm, dtype)
            setattr(block, linear_name, linear)
        converted.append(name)
    if fuse_add:
        hf._fuse_adds(model)
    return converted

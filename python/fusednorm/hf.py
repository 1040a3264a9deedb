"""Swap the RMSNorm modules of a Hugging Face transformers model for fusednorm's.

Two conventions exist in transformers (checked against transformers 5.x modeling files):

* Llama style (Llama, Mistral, Qwen2, Qwen3, ... attribute ``variance_epsilon``)::

      h = x.float(); h = h * rsqrt(mean(h**2) + eps)
      return weight * h.to(x.dtype)          # rounded to x's dtype, THEN times weight

  fusednorm multiplies by the weight in fp32 and rounds once, which differs from this by
  at most one rounding of x's dtype; the output dtype is torch's promotion of
  (weight, x) as in the original (fp32 weight with a bf16 x gives fp32).

* Gemma style (Gemma, Gemma2, Gemma3, attribute ``eps``, weight zero-initialized)::

      out = norm(x.float()) * (1.0 + weight.float())
      return out.type_as(x)                  # all fp32, one rounding at the end

  This is exactly fusednorm's rms_norm with ``weight_offset=1.0``.

Other ``*RMSNorm`` classes with a 1-D ``weight`` and an ``eps`` / ``variance_epsilon``
attribute are replaced only if a numerical probe on a small fp32 input matches one of the
two conventions; anything else is left alone.

Fused residual add (``fuse_add=True``): in the decoder layers of Llama, Mistral, Qwen2,
Qwen3 and Gemma (the classes in ``FUSED_ADD_DECODER_LAYERS``) the MLP's input is::

    hidden_states = residual + attn_out          # rounded to the activation dtype
    residual = hidden_states
    hidden_states = post_attention_layernorm(hidden_states)

which is exactly ``fused_add_rms_norm(attn_out, residual, inplace=False)``: the same
rounding, so the same numbers. patch_hf makes post_attention_layernorm an
``HFFusedAddRMSNorm`` and gives the layer a forward (a subclass of its class) that calls
``post_attention_layernorm(attn_out, residual=residual)``. The residual is a keyword
argument so that torch's SequenceParallel, whose input hook rewrites only the positional
input, leaves it alone. Gemma2 and Gemma3 normalize the attention output before the add
(post_attention_layernorm, then pre_feedforward_layernorm on the sum); they keep their
unfused layers. The add before the next layer's input_layernorm crosses a layer boundary
and stays unfused.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from . import functional as F

__all__ = ["patch_hf", "HFRMSNorm", "HFFusedAddRMSNorm"]

LLAMA_STYLE = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})
GEMMA_STYLE = frozenset({"GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm"})
# Decoder layers whose "residual + attention output -> post_attention_layernorm" is taken
# into fused_add_rms_norm (checked against transformers 5.x modeling files).
FUSED_ADD_DECODER_LAYERS = frozenset(
    {
        "LlamaDecoderLayer",
        "MistralDecoderLayer",
        "Qwen2DecoderLayer",
        "Qwen3DecoderLayer",
        "GemmaDecoderLayer",
    }
)


class HFRMSNorm(nn.Module):
    """A transformers RMSNorm computed by fusednorm.

    Holds the original module's ``weight`` Parameter itself (tied weights, optimizers and
    ``state_dict`` keys are unchanged) and exposes both ``eps`` and ``variance_epsilon``.
    """

    def __init__(
        self,
        weight: nn.Parameter | None,
        eps: float,
        weight_offset: float = 0.0,
        promote_output: bool = True,
        original_class: str = "",
    ) -> None:
        super().__init__()
        if weight is None:
            self.register_parameter("weight", None)
        else:
            self.weight = weight
        self.eps = float(eps)
        self.weight_offset = float(weight_offset)
        self.promote_output = promote_output
        self.original_class = original_class

    @property
    def variance_epsilon(self) -> float:
        return self.eps

    @variance_epsilon.setter
    def variance_epsilon(self, value: float) -> None:
        self.eps = float(value)

    def _kernel_weight(self, x: torch.Tensor) -> torch.Tensor | None:
        w = self.weight
        if w is not None and w.dtype != x.dtype and w.dtype != torch.float32:
            w = w.float()  # exact; the kernels take x's dtype or fp32
        return w

    def _promote(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.promote_output and self.weight is not None:
            out_dtype = torch.promote_types(self.weight.dtype, x.dtype)
            if out_dtype != y.dtype:
                y = y.to(out_dtype)
        return y

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        w = self._kernel_weight(hidden_states)
        y = F.rms_norm(hidden_states, w, self.eps, self.weight_offset)
        return self._promote(y, hidden_states)

    def extra_repr(self) -> str:
        shape = tuple(self.weight.shape) if self.weight is not None else None
        return (
            f"{shape}, eps={self.eps}, weight_offset={self.weight_offset}, "
            f"replaces={self.original_class}"
        )


class HFFusedAddRMSNorm(HFRMSNorm):
    """An HFRMSNorm that can also take the residual add: ``forward(x)`` is the norm, and
    ``forward(x, residual=r)`` returns ``(norm(x + r), x + r)`` through the functional
    ``fused_add_rms_norm(..., inplace=False)`` (fused forward and backward)."""

    takes_residual = True  # what _fused_add_norm looks for

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return super().forward(hidden_states)
        w = self._kernel_weight(hidden_states)
        y, residual_out = F.fused_add_rms_norm(
            hidden_states, residual, w, self.eps, self.weight_offset, inplace=False
        )
        return self._promote(y, hidden_states), residual_out


def _fused_add_decoder_forward(self, hidden_states, *args, **kwargs):
    """The decoder layer's forward with the residual add taken into the MLP's norm. Every
    argument but hidden_states goes to self_attn, as in the original forward.

    ``post_attention_layernorm(attn_out, residual=layer_input)`` returns ``(norm(attn_out +
    layer_input), attn_out + layer_input)``; it may write the sum into ``attn_out`` (dead
    after the call) but never into ``layer_input``, which the caller may keep (the
    collected hidden states, autograd)."""
    if args:
        bound = self._unfused_signature.bind(hidden_states, *args, **kwargs)
        bound.arguments.pop(next(iter(bound.arguments)))  # hidden_states
        extra = bound.arguments.pop("kwargs", {})
        kwargs = {**bound.arguments, **extra}
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states, _ = self.self_attn(hidden_states=hidden_states, **kwargs)
    hidden_states, residual = self.post_attention_layernorm(hidden_states, residual=residual)
    hidden_states = self.mlp(hidden_states)
    return residual + hidden_states


_FUSED_LAYER_CLASSES: dict[type, type] = {}


def _fused_layer_class(cls: type) -> type:
    if cls not in _FUSED_LAYER_CLASSES:
        _FUSED_LAYER_CLASSES[cls] = type(
            f"FusedAdd{cls.__name__}",
            (cls,),
            {
                "forward": _fused_add_decoder_forward,
                "_unfused_signature": inspect.signature(cls.forward).replace(
                    parameters=list(inspect.signature(cls.forward).parameters.values())[1:]
                ),
                "__doc__": f"{cls.__name__} with its post-attention residual add fused "
                "into post_attention_layernorm (fusednorm.patch_hf, fusednorm.quant."
                "patch_hf_w8a8).",
            },
        )
    return _FUSED_LAYER_CLASSES[cls]


def _takes_residual(norm) -> bool:
    return getattr(norm, "takes_residual", False)


def _fused_add_norm(norm: nn.Module) -> nn.Module:
    """The post_attention_layernorm that takes ``residual=`` (see _fused_add_decoder_forward)
    in place of ``norm``: the norm itself when it already does (a class with
    ``takes_residual = True``, e.g. fusednorm.quant.QuantizedRMSNorm), else an
    HFFusedAddRMSNorm for the HFRMSNorm ``norm``."""
    if _takes_residual(norm):
        return norm
    fused_norm = HFFusedAddRMSNorm(
        norm.weight,
        norm.eps,
        weight_offset=norm.weight_offset,
        promote_output=norm.promote_output,
        original_class=norm.original_class,
    )
    fused_norm.train(norm.training)
    return fused_norm


def _fusable_layer(module: nn.Module) -> bool:
    if type(module) in _FUSED_LAYER_CLASSES.values():
        return False  # already fused
    names = {cls.__name__ for cls in type(module).__mro__}
    return (
        bool(names & FUSED_ADD_DECODER_LAYERS)
        and all(hasattr(module, a) for a in ("input_layernorm", "self_attn", "mlp"))
        and (isinstance(norm := getattr(module, "post_attention_layernorm", None), HFRMSNorm)
             or _takes_residual(norm))
    )


def _fuse_adds(model: nn.Module) -> list[str]:
    """Give every fusable decoder layer of ``model`` the fused-add forward (patch_hf's
    ``fuse_add``, and fusednorm.quant.patch_hf_w8a8); returns the layers' names."""
    fused = []
    for name, module in model.named_modules():
        if not _fusable_layer(module):
            continue
        module.post_attention_layernorm = _fused_add_norm(module.post_attention_layernorm)
        module.__class__ = _fused_layer_class(type(module))
        fused.append(name)
    return fused


def _eps_of(module: nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps"):
        value = getattr(module, name, None)
        if isinstance(value, (float, int)) and not isinstance(value, bool):
            return float(value)
    return None


def _known_style(module: nn.Module) -> str | None:
    for cls in type(module).__mro__:
        if cls.__name__ in LLAMA_STYLE:
            return "llama"
        if cls.__name__ in GEMMA_STYLE:
            return "gemma"
    return None


@torch.no_grad()
def _probe_style(module: nn.Module, weight: torch.Tensor, eps: float) -> str | None:
    """Which convention an unknown RMSNorm follows, judged on a small fp32 input."""
    if weight.device.type == "meta":
        return None
    generator = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(3, weight.shape[0], generator=generator).to(weight.device)
    try:
        expected = module(x).float()
    except Exception:  # noqa: BLE001 (an exotic module we should not touch)
        return None
    for style, offset in (("llama", 0.0), ("gemma", 1.0)):
        ours = F.rms_norm(x, weight.float(), eps, offset)
        if expected.shape == ours.shape and torch.allclose(expected, ours, rtol=1e-4, atol=1e-5):
            return style
    return None


def patch_hf(
    model: nn.Module, include_generic: bool = True, fuse_add: bool = True
) -> list[tuple[str, str]]:
    """Replace, in place, the RMSNorm modules of a transformers model by fusednorm modules.

    Known classes: LlamaRMSNorm, MistralRMSNorm, Qwen2RMSNorm, Qwen3RMSNorm (and their
    subclasses) as ``weight * norm(x)``; GemmaRMSNorm, Gemma2RMSNorm, Gemma3RMSNorm as
    ``(1 + weight) * norm(x)`` (``weight_offset=1.0``). With ``include_generic``, other
    ``*RMSNorm`` modules are replaced when a numerical probe shows which of the two they
    compute. The replacement keeps the very same ``weight`` Parameter object.

    With ``fuse_add``, the decoder layers listed in ``FUSED_ADD_DECODER_LAYERS`` (Llama,
    Mistral, Qwen2, Qwen3, Gemma) also take the residual add before their MLP into
    post_attention_layernorm (``fused_add_rms_norm``, fused forward and backward; the
    same numbers as the unfused layer). Their class becomes a subclass
    ``FusedAdd<Class>`` whose forward does that.

    Returns the ``(qualified module name, original class name)`` pairs replaced, in
    ``model.named_modules()`` order. Already-patched modules are skipped, so calling it
    twice is harmless.

    With torch.distributed: call it before ``parallelize_module`` / ``fully_shard`` (they
    attach hooks to the modules that patch_hf replaces).
    """
    replaced: list[tuple[str, str]] = []
    replacements: dict[int, HFRMSNorm] = {}  # a module shared by several parents
    for name, module in list(model.named_modules(remove_duplicate=False)):
        if not name or isinstance(module, HFRMSNorm):
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if id(module) in replacements:
            setattr(parent, child, replacements[id(module)])
            continue
        class_name = type(module).__name__
        style = _known_style(module)
        if style is None and not (include_generic and class_name.endswith("RMSNorm")):
            continue
        weight = getattr(module, "weight", None)
        eps = _eps_of(module)
        if eps is None or not (weight is None or (isinstance(weight, torch.Tensor) and weight.dim() == 1)):
            continue
        if style is None:
            if weight is None:
                continue
            style = _probe_style(module, weight, eps)
            if style is None:
                continue
        replacement = HFRMSNorm(
            weight,
            eps,
            weight_offset=1.0 if style == "gemma" else 0.0,
            promote_output=(style == "llama"),
            original_class=class_name,
        )
        replacement.train(module.training)
        replacements[id(module)] = replacement
        setattr(parent, child, replacement)
        replaced.append((name, class_name))
    if fuse_add:
        _fuse_adds(model)
    return replaced

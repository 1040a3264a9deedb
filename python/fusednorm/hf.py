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
"""

from __future__ import annotations

import torch
from torch import nn

from . import functional as F

__all__ = ["patch_hf", "HFRMSNorm"]

LLAMA_STYLE = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})
GEMMA_STYLE = frozenset({"GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm"})


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

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if w is not None and w.dtype != hidden_states.dtype and w.dtype != torch.float32:
            w = w.float()  # exact; the kernels take x's dtype or fp32
        y = F.rms_norm(hidden_states, w, self.eps, self.weight_offset)
        if self.promote_output and self.weight is not None:
            out_dtype = torch.promote_types(self.weight.dtype, hidden_states.dtype)
            if out_dtype != y.dtype:
                y = y.to(out_dtype)
        return y

    def extra_repr(self) -> str:
        shape = tuple(self.weight.shape) if self.weight is not None else None
        return (
            f"{shape}, eps={self.eps}, weight_offset={self.weight_offset}, "
            f"replaces={self.original_class}"
        )


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


def patch_hf(model: nn.Module, include_generic: bool = True) -> list[tuple[str, str]]:
    """Replace, in place, the RMSNorm modules of a transformers model by fusednorm modules.

    Known classes: LlamaRMSNorm, MistralRMSNorm, Qwen2RMSNorm, Qwen3RMSNorm (and their
    subclasses) as ``weight * norm(x)``; GemmaRMSNorm, Gemma2RMSNorm, Gemma3RMSNorm as
    ``(1 + weight) * norm(x)`` (``weight_offset=1.0``). With ``include_generic``, other
    ``*RMSNorm`` modules are replaced when a numerical probe shows which of the two they
    compute. The replacement keeps the very same ``weight`` Parameter object.

    Returns the ``(qualified module name, original class name)`` pairs replaced, in
    ``model.named_modules()`` order. Already-patched modules are skipped, so calling it
    twice is harmless.
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
    return replaced

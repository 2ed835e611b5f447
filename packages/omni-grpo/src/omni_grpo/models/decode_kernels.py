"""The default path's decode steps on fewer kernels: RMSNorm, the MoE router and LoRA linears.

Why: a decode step computes one token per row, so a layer's work is ~100 kernels that each move
a few kilobytes besides the weights; inside the step's CUDA graph each still costs a few
microseconds. Counted from the code, per layer and token:

- transformers' RMSNorm is eight kernels (cast, square, mean, add, rsqrt, multiply, cast back,
  weight), four times a layer (input, post-attention, the q and k norms);
- its router, after the logits, five (fp32 softmax, top-k, sum, divide, cast);
- peft's LoRA linear, besides the base product, eight (``x`` cast to the fp32 adapters' dtype,
  autocast casting ``x`` and both adapter weights back to bf16, two products, the scale, the
  add), four times a layer with the attention targeted.

Here RMSNorm and the router are one Triton program per row each (``models.row_kernels``, the
kernels exact mode runs), and a LoRA linear is three products on bf16 factors cached until the
adapters change: ``x W``, ``x A^T``, and one ``addmm`` adding ``(x A^T)(scale B^T)`` to the first.

Swapped onto the module instances for the duration of the decode steps only, as
``models.decode_attention`` swaps the attention: the prefill, the trainer's forwards and the KL
reference keep their own. Not in exact mode (``omni_grpo.exact``): there a decode step must
compute as the trainer's forward does, and exact mode has its own kernels. The formulas are the
same; the rounding differs within bf16 (the RMSNorm's sum order; the LoRA scale folded into
``B`` before its bf16 cast, and the adapter's term added in the product's fp32 accumulator
instead of after two bf16 roundings). ``OMNI_GRPO_DECODE_KERNELS=0`` keeps transformers' and
peft's forwards (a comparison switch).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import MethodType
from typing import Any

import torch
from torch import nn

from omni_grpo.models.grouped_experts import ADAPTER, cached_factors

EXACT_FLAG = "exact_logprobs"  # omni_grpo.exact.install.FLAG (not imported: a floor up)


def enabled(thinker: nn.Module) -> bool:
    """Whether the decode steps of ``thinker`` take these forwards: CUDA, bf16, Triton, not exact
    mode, and not switched off by ``OMNI_GRPO_DECODE_KERNELS=0``."""
    if os.environ.get("OMNI_GRPO_DECODE_KERNELS", "1") == "0" or getattr(thinker, EXACT_FLAG, 0):
        return False
    weight = thinker.lm_head.weight
    if not weight.is_cuda or weight.dtype != torch.bfloat16:
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


# ----------------------------------------------------------------------------------- RMSNorm
def is_rmsnorm(module: nn.Module) -> bool:
    """transformers' RMSNorm (by class name: the text model's and the q/k norms' classes)."""
    return type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon")


def rmsnorm_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """transformers' Qwen3 RMSNorm (``weight * (x / rms(x)).to(x.dtype)``) in one kernel."""
    if x.dtype != self.weight.dtype:
        return type(self).forward(self, x)
    from omni_grpo.models.row_kernels import rmsnorm_rows

    return rmsnorm_rows(x, self.weight, self.variance_epsilon)


# ------------------------------------------------------------------------------------ router
def _is_router(module: nn.Module) -> bool:
    """transformers' top-k router (Qwen3 MoE): ``forward(x) -> (logits, weights, indices)``."""
    needed = ("weight", "top_k", "hidden_dim")
    return type(module).__name__.endswith("TopKRouter") and all(hasattr(module, n) for n in needed)


def router_forward(
    self: nn.Module, hidden: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The router's logits, then its fp32 softmax, top-k and renormalisation in one kernel."""
    from omni_grpo.models.row_kernels import route_rows

    logits = torch.nn.functional.linear(hidden.reshape(-1, self.hidden_dim), self.weight)
    # Qwen3-VL-MoE's router always renormalises (no attribute); Qwen3-Omni's reads its config
    index, weights = route_rows(logits, self.top_k, bool(getattr(self, "norm_topk_prob", True)))
    return logits, weights.to(logits.dtype), index


# -------------------------------------------------------------------------------- LoRA linear
def is_lora_linear(module: nn.Module) -> bool:
    try:
        from peft.tuners.lora.layer import Linear
    except ImportError:
        return False
    return type(module) is Linear


def plain_adapter(layer: Any) -> bool:
    """One active vanilla adapter (no DoRA or other variant, no bias), not merged or disabled."""
    return (
        not layer.disable_adapters
        and not layer.merged
        and list(layer.active_adapters) == [ADAPTER]
        and ADAPTER in layer.lora_A
        and ADAPTER not in getattr(layer, "lora_variant", {})
        and layer.lora_B[ADAPTER].bias is None
        and not (layer.training and getattr(layer.lora_dropout[ADAPTER], "p", 0.0))
    )


def linear_factors(layer: Any, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A^T [in, r], scale * B^T [r, out])`` in ``dtype``, cached on the layer until the
    adapters change (``grouped_experts.invalidate_factor_caches`` drops it after an optimizer
    step): read once per decode step, at fixed addresses for the CUDA graph."""

    def make(a_w: torch.Tensor, b_w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale = float(layer.scaling[ADAPTER])
        return a_w.detach().to(dtype).t(), (b_w.detach().float() * scale).to(dtype).t()

    return cached_factors(layer, dtype, make, tag="decode")


def lora_linear_forward(self: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """peft's LoRA linear as ``x W + (x A^T)(scale B^T)``: three products, the last an ``addmm``."""
    if args or kwargs or not plain_adapter(self):
        return type(self).forward(self, x, *args, **kwargs)
    out = self.base_layer(x)
    a_t, b_t = linear_factors(self, out.dtype)
    flat = x.reshape(-1, x.shape[-1]).to(out.dtype)
    return torch.addmm(out.reshape(-1, out.shape[-1]), flat @ a_t, b_t).view(out.shape)


def _forward_for(module: nn.Module) -> Callable[..., Any] | None:
    if is_rmsnorm(module):
        return rmsnorm_forward
    if _is_router(module):
        return router_forward
    if is_lora_linear(module):
        return lora_linear_forward
    return None


@contextmanager
def decode_kernels(thinker: nn.Module, on: bool | None = None) -> Iterator[int]:
    """Inside, the text model's RMSNorms, routers and LoRA linears compute with the forwards above
    (``on``: default :func:`enabled`); yields how many modules were swapped. A module whose
    forward is already bound on the instance (exact mode's) is left alone."""
    swapped: list[nn.Module] = []
    if enabled(thinker) if on is None else on:
        for module in thinker.model.language_model.modules():
            forward = _forward_for(module)
            if forward is not None and "forward" not in module.__dict__:
                module.forward = MethodType(forward, module)
                swapped.append(module)
    try:
        yield len(swapped)
    finally:
        for module in swapped:
            del module.forward

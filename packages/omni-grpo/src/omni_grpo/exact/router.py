"""The MoE router's softmax, top-k and renormalisation for one token in one kernel.

Why a kernel: the row-invariant torch version (an fp32 softmax whose sum is a fixed tree of
elementwise adds, a stable sort, a tree sum of the top-k) is ~20 small kernels per layer, and a
decode step replays them for every one of the 48 layers (counted from the code; on the H200 the
4-layer LoRA generation went 1.19-1.34 s -> 0.80 s together with the tile-map change in
``exact.grouped``, not measured apart). Here one program reads a token's router
logits once and does every step in registers, in one fixed order, so a token's experts and
weights depend on that token alone, in a decode step as in a training micro-batch. The kernel
lives a floor below (``models.row_kernels``: the default path's decode steps run it too).

The semantics are transformers' Qwen3 router: probabilities from an fp32 softmax, the ``top_k``
largest (ties: the lower expert first, as a stable descending sort), renormalised to sum to one
when ``norm_topk_prob``. The same kernel serves the first forward and the recompute (the
routing must not change between them: the recompute's gradients are for the same experts).
Backward: torch's softmax, gather and renormalisation at the chosen experts (the router's
weight trains in full fine-tuning).
"""

from __future__ import annotations

from typing import Any

import torch

from omni_grpo.models.row_kernels import route_rows

__all__ = ["route", "route_rows"]


def _weights_at(logits: torch.Tensor, index: torch.Tensor, normalize: bool) -> torch.Tensor:
    """The kernel's weights in torch ops (for the gradient): softmax, gather, renormalise."""
    values = torch.softmax(logits.float(), dim=-1).gather(-1, index)
    return values / values.sum(-1, keepdim=True) if normalize else values


class _Route(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, logits: torch.Tensor, top_k: int, normalize: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        index, weights = route_rows(logits, top_k, normalize)
        ctx.save_for_backward(logits, index)
        ctx.normalize = normalize
        ctx.mark_non_differentiable(index)
        return index, weights

    @staticmethod
    def backward(ctx: Any, _grad_index: Any, grad_weights: torch.Tensor) -> tuple[Any, None, None]:  # type: ignore[override]
        logits, index = ctx.saved_tensors
        with torch.enable_grad():
            z = logits.detach().requires_grad_()
            (grad,) = torch.autograd.grad(_weights_at(z, index, ctx.normalize), z, grad_weights)
        return grad, None, None


def route(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable :func:`route_rows` (the gradient flows to the logits through the weights)."""
    return _Route.apply(logits, top_k, normalize)

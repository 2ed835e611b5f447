"""The MoE router's softmax, top-k and renormalisation for one token in one kernel.

Why a kernel: the row-invariant torch version (an fp32 softmax whose sum is a fixed tree of
elementwise adds, a stable sort, a tree sum of the top-k) is ~20 small kernels per layer, and a
decode step replays them for every one of the 48 layers (counted from the code; on the H200 the
4-layer LoRA generation went 1.19-1.34 s -> 0.80 s together with the tile-map change in
``exact.grouped``, not measured apart). Here one program reads a token's router
logits once and does every step in registers, in one fixed order, so a token's experts and
weights depend on that token alone, in a decode step as in a training micro-batch.

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
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["T"])  # one compiled kernel for every token count
def _route_kernel(
    z_ptr,
    idx_ptr,
    w_ptr,
    T,
    E,
    stride_z,
    K: tl.constexpr,
    NORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    ok = cols < E
    z = tl.load(z_ptr + row * stride_z + cols, mask=ok, other=float("-inf")).to(tl.float32)
    e = tl.exp(z - tl.max(z, axis=0))
    p = e / tl.sum(e, axis=0)
    p = tl.where(ok, p, -1.0)  # padding is never picked
    slots = tl.arange(0, BLOCK_K)
    values = tl.zeros((BLOCK_K,), tl.float32)
    picks = tl.zeros((BLOCK_K,), tl.int32)
    total = tl.sum(tl.zeros((BLOCK_K,), tl.float32), axis=0)
    for j in tl.static_range(K):
        best = tl.max(p, axis=0)
        pick = tl.min(tl.where(p == best, cols, BLOCK_E), axis=0)  # ties: the lower expert
        values = tl.where(slots == j, best, values)
        picks = tl.where(slots == j, pick, picks)
        total += best  # in slot order
        p = tl.where(cols == pick, -1.0, p)
    if NORMALIZE:
        values = values / total
    keep = slots < K
    tl.store(idx_ptr + row * K + slots, picks.to(tl.int64), mask=keep)
    tl.store(w_ptr + row * K + slots, values, mask=keep)


def route_rows(
    logits: torch.Tensor, top_k: int, normalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(index int64 [T, k], weights fp32 [T, k])`` from router ``logits [T, E]``."""
    tokens, experts = logits.shape
    if top_k > experts:
        raise ValueError(f"route: top_k {top_k} exceeds the {experts} experts")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    index = torch.empty(tokens, top_k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=logits.device)
    if tokens:
        _route_kernel[(tokens,)](
            logits,
            index,
            weights,
            tokens,
            experts,
            logits.stride(0),
            K=top_k,
            NORMALIZE=normalize,
            BLOCK_E=triton.next_power_of_2(experts),
            BLOCK_K=triton.next_power_of_2(top_k),
            num_warps=1 if experts <= 256 else 4,
        )
    return index, weights


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

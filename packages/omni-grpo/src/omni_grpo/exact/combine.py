"""The MoE block's last step in exact mode: each token's ``top_k`` expert outputs, weighted and
summed, in one kernel.

Why a kernel: the off path's ``bmm`` picks its kernel (and so its summation order) from the token
count; the row-invariant replacement was ``top_k`` rounds of elementwise fp32 upcast, multiply
and add (16 passes over ``tokens x hidden`` and fp32 temporaries of that size). Here one program
reads a block of tokens' ``top_k`` rows once and adds ``pairs[t, s] * w[t, s]`` in slot order in
fp32 registers: an element's arithmetic involves only its own token, whatever the batch. Backward
is torch's (any kernel may serve the gradient), and under ``exact.switch.torch_kernels`` the
forward is the off path's ``bmm``.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from omni_grpo.exact.switch import torch_kernels_on

BLOCK_T = 16
BLOCK_H = 256


@triton.jit(do_not_specialize=["T"])  # one compiled kernel for every token count
def _topk_sum_kernel(
    p_ptr,
    w_ptr,
    o_ptr,
    T,
    H,
    stride_pt,
    stride_ps,
    stride_wt,
    stride_ws,
    stride_ot,
    K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    rt = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    rh = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    t_ok = rt < T
    ok = t_ok[:, None] & (rh[None, :] < H)
    acc = tl.zeros((BLOCK_T, BLOCK_H), tl.float32)
    for s in tl.static_range(K):
        w = tl.load(w_ptr + rt * stride_wt + s * stride_ws, mask=t_ok, other=0.0).to(tl.float32)
        p = tl.load(
            p_ptr + rt[:, None] * stride_pt + s * stride_ps + rh[None, :], mask=ok, other=0.0
        ).to(tl.float32)
        acc += p * w[:, None]
    tl.store(o_ptr + rt[:, None] * stride_ot + rh[None, :], acc.to(o_ptr.dtype.element_ty), mask=ok)


def topk_sum_kernel(pairs: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``sum_s pairs[:, s] * weights[:, s]`` (``[T, k, H]``, ``[T, k]``) in fp32, slot order, as
    ``dtype``."""
    tokens, top_k, hidden = pairs.shape
    if pairs.stride(-1) != 1:
        pairs = pairs.contiguous()
    out = torch.empty(tokens, hidden, dtype=dtype, device=pairs.device)
    if tokens:
        grid = (triton.cdiv(tokens, BLOCK_T), triton.cdiv(hidden, BLOCK_H))
        _topk_sum_kernel[grid](
            pairs,
            weights,
            out,
            tokens,
            hidden,
            pairs.stride(0),
            pairs.stride(1),
            weights.stride(0),
            weights.stride(1),
            out.stride(0),
            K=top_k,
            BLOCK_T=BLOCK_T,
            BLOCK_H=BLOCK_H,
            num_warps=4,
        )
    return out


class _TopkSum(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, pairs: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        ctx.save_for_backward(pairs, weights)
        if torch_kernels_on():  # a recompute: the off path's bmm
            tokens, top_k, hidden = pairs.shape
            w = weights.to(pairs.dtype).reshape(tokens, 1, top_k)
            return torch.bmm(w, pairs).view(tokens, hidden).to(dtype)
        return topk_sum_kernel(pairs, weights, dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, Any, None]:  # type: ignore[override]
        pairs, weights = ctx.saved_tensors
        g = grad.to(pairs.dtype)
        grad_pairs = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_pairs = g[:, None, :] * weights.to(pairs.dtype)[:, :, None]
        if ctx.needs_input_grad[1]:
            grad_w = torch.bmm(pairs, g[:, :, None])[:, :, 0].to(weights.dtype)
        return grad_pairs, grad_w, None


def topk_sum(pairs: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Differentiable :func:`topk_sum_kernel`: a token's ``top_k`` expert outputs weighted and
    summed, row-invariant."""
    return _TopkSum.apply(pairs, weights, dtype)

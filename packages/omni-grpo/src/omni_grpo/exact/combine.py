"""The MoE block's last step in exact mode: each token's ``top_k`` expert outputs, weighted and
summed, in one kernel.

Why a kernel: the off path's ``bmm`` picks its kernel (and so its summation order) from the token
count; the row-invariant replacement was ``top_k`` rounds of elementwise fp32 upcast, multiply
and add (16 passes over ``tokens x hidden`` and fp32 temporaries of that size). Here one program
reads a block of tokens' ``top_k`` rows once and adds ``pairs[t, s] * w[t, s]`` in slot order in
fp32 registers: an element's arithmetic involves only its own token, whatever the batch. Backward
is torch's (any kernel may serve the gradient), and under ``exact.switch.torch_kernels`` the
forward is the off path's ``bmm``.

:func:`unsort_topk_sum` (the differentiable form ``exact.moe`` calls) reads the experts' output
rows where they lie (expert order) through the pairs' inverse permutation instead of a gathered
``[T, k, H]`` copy: the same values in the same order, so the same bits, without writing and
reading back the MoE block's largest tensor. :func:`topk_sum_kernel` (over such a copy) is what
the tests hold it to.
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
    idx_ptr,
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
    GATHER: tl.constexpr,
):
    """``GATHER``: pair ``(t, s)`` is row ``idx[t * K + s]`` of ``p`` (``stride_pt`` its row
    stride); else ``p[t, s]`` of a ``[T, K, H]`` tensor."""
    rt = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    rh = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    t_ok = rt < T
    ok = t_ok[:, None] & (rh[None, :] < H)
    acc = tl.zeros((BLOCK_T, BLOCK_H), tl.float32)
    for s in tl.static_range(K):
        w = tl.load(w_ptr + rt * stride_wt + s * stride_ws, mask=t_ok, other=0.0).to(tl.float32)
        if GATHER:
            row = tl.load(idx_ptr + rt * K + s, mask=t_ok, other=0).to(tl.int64)
            at = p_ptr + row[:, None] * stride_pt + rh[None, :]
        else:
            at = p_ptr + rt[:, None] * stride_pt + s * stride_ps + rh[None, :]
        p = tl.load(at, mask=ok, other=0.0).to(tl.float32)
        acc += p * w[:, None]
    tl.store(o_ptr + rt[:, None] * stride_ot + rh[None, :], acc.to(o_ptr.dtype.element_ty), mask=ok)


def topk_sum_kernel(pairs: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``sum_s pairs[:, s] * weights[:, s]`` (``[T, k, H]``, ``[T, k]``) in fp32, slot order, as
    ``dtype``."""
    tokens, top_k, hidden = pairs.shape
    if pairs.stride(-1) != 1:
        pairs = pairs.contiguous()
    return _launch(pairs, pairs.stride(0), pairs.stride(1), None, weights, dtype)


def topk_sum_rows_kernel(
    rows: torch.Tensor, inv: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """:func:`topk_sum_kernel` of ``rows[inv].view(T, k, H)`` without the gathered copy:
    ``rows [T * k, H]`` (the experts' outputs in expert order), ``inv [T * k]`` the row of
    each (token, slot) pair, ``weights [T, k]``."""
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    return _launch(rows, rows.stride(0), 0, inv, weights, dtype)


def _launch(
    p: torch.Tensor,
    stride_pt: int,
    stride_ps: int,
    idx: torch.Tensor | None,
    weights: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    tokens, top_k = weights.shape
    hidden = p.shape[-1]
    out = torch.empty(tokens, hidden, dtype=dtype, device=p.device)
    if tokens:
        grid = (triton.cdiv(tokens, BLOCK_T), triton.cdiv(hidden, BLOCK_H))
        _topk_sum_kernel[grid](
            p,
            weights,
            out,
            out if idx is None else idx,  # not read without GATHER
            tokens,
            hidden,
            stride_pt,
            stride_ps,
            weights.stride(0),
            weights.stride(1),
            out.stride(0),
            K=top_k,
            BLOCK_T=BLOCK_T,
            BLOCK_H=BLOCK_H,
            GATHER=idx is not None,
            num_warps=4,
        )
    return out


def _unsorted(rows: torch.Tensor, inv: torch.Tensor, top_k: int) -> torch.Tensor:
    """``[T, k, H]``: each (token, slot)'s expert output, gathered from expert order."""
    return rows.index_select(0, inv).view(-1, top_k, rows.shape[-1])


class _UnsortTopkSum(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        rows: torch.Tensor,
        inv: torch.Tensor,
        perm: torch.Tensor,
        weights: torch.Tensor,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        ctx.save_for_backward(rows, inv, perm, weights)
        tokens, top_k = weights.shape
        if torch_kernels_on():  # a recompute: the off path's gather and bmm
            pairs = _unsorted(rows, inv, top_k)
            w = weights.to(pairs.dtype).reshape(tokens, 1, top_k)
            return torch.bmm(w, pairs).view(tokens, -1).to(dtype)
        return topk_sum_rows_kernel(rows, inv, weights, dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        rows, inv, perm, weights = ctx.saved_tensors
        tokens, top_k = weights.shape
        g = grad.to(rows.dtype)
        grad_rows = grad_w = None
        if ctx.needs_input_grad[0]:  # d pairs, then back to expert order (Unsort's backward)
            grad_pairs = g[:, None, :] * weights.to(rows.dtype)[:, :, None]
            grad_rows = grad_pairs.view(tokens * top_k, -1).index_select(0, perm)
        if ctx.needs_input_grad[3]:
            pairs = _unsorted(rows, inv, top_k)
            grad_w = torch.bmm(pairs, g[:, :, None])[:, :, 0].to(weights.dtype)
        return grad_rows, None, None, grad_w, None


def unsort_topk_sum(
    rows: torch.Tensor,
    inv: torch.Tensor,
    perm: torch.Tensor,
    weights: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Differentiable :func:`topk_sum_rows_kernel`: each token's ``top_k`` expert outputs
    weighted and summed, row-invariant, with the bits of :func:`topk_sum_kernel` over the
    unsorted copy ``rows[inv].view(T, k, H)``. ``rows`` the experts' outputs in expert order,
    ``inv``/``perm`` the pairs' permutation (``grouped_experts.expert_order``), ``weights [T, k]``."""
    return _UnsortTopkSum.apply(rows, inv, perm, weights, dtype)

"""A row-invariant bf16 matmul: row ``i`` of ``x @ w.T`` has the same bits whatever the other rows.

Why: a decode step multiplies one row per sequence, the trainer's forward every row of a
micro-batch; cuBLAS picks its tiling (and split-K) from the shape, so the same row can come out
with a different rounding. Here the tiling is a function of ``(K, N)`` only (:func:`tiles`): each
output element is one fp32 accumulation over ``K`` in ``BLOCK_K`` chunks, in order, with the same
tensor-core instruction for every ``M`` — no split-K. Backward uses torch's own kernels (only the
forward must match the rollout).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

# One config per (K, N) class; BLOCK_M never depends on M (64 rows: one warpgroup's wgmma).
BLOCK_M = 64
NUM_WARPS = 4
NUM_STAGES = 3


def tiles(k: int, n: int) -> tuple[int, int]:
    """``(BLOCK_N, BLOCK_K)`` for a product with reduction ``k`` and ``n`` output columns."""
    block_n = 128 if n >= 128 else max(16, triton.next_power_of_2(n))
    block_k = 64 if k >= 64 else max(16, triton.next_power_of_2(k))
    return block_n, block_k


@triton.jit(do_not_specialize=["M"])  # one compiled kernel for every size
def _mm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    bias_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = tl.load(
            a_ptr + rm[:, None] * stride_am + kk[None, :] * stride_ak,
            mask=(rm[:, None] < M) & (kk[None, :] < K),
            other=0.0,
        )
        b = tl.load(
            b_ptr + kk[:, None] * stride_bk + rn[None, :] * stride_bn,
            mask=(kk[:, None] < K) & (rn[None, :] < N),
            other=0.0,
        )
        acc = tl.dot(a, b, acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(
        c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn,
        acc.to(c_ptr.dtype.element_ty),
        mask=(rm[:, None] < M) & (rn[None, :] < N),
    )


def mm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``a [M, K] @ b [K, N] (+ bias)`` in ``a``'s dtype with fp32 accumulation, row-invariant."""
    m, k = a.shape
    k2, n = b.shape
    if k != k2:
        raise ValueError(f"mm: a is {tuple(a.shape)} but b is {tuple(b.shape)}")
    out = torch.empty(m, n, dtype=a.dtype, device=a.device)
    if m == 0:
        return out
    block_n, block_k = tiles(k, n)
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, block_n))
    _mm_kernel[grid](
        a,
        b,
        out,
        bias if bias is not None else a,
        m,
        n,
        k,
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        out.stride(0),
        out.stride(1),
        HAS_BIAS=bias is not None,
        BLOCK_M=BLOCK_M,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )
    return out


class _Linear(torch.autograd.Function):
    """``x @ w.T + b`` in ``dtype``: the invariant kernel forward, torch's matmuls backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).to(dtype)
        w = weight.to(dtype)
        out = mm(flat, w.t(), bias.to(dtype) if bias is not None else None)
        ctx.save_for_backward(flat, w)
        ctx.shapes = (x.shape, x.dtype, weight.dtype, bias is not None)
        return out.view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, Any, Any, None]:  # type: ignore[override]
        flat, w = ctx.saved_tensors
        x_shape, x_dtype, w_dtype, has_bias = ctx.shapes
        g = grad.reshape(-1, grad.shape[-1]).to(w.dtype)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = (g @ w).view(x_shape).to(x_dtype)
        if ctx.needs_input_grad[1]:
            grad_w = (g.t() @ flat).to(w_dtype)
        if has_bias and ctx.needs_input_grad[2]:
            grad_b = g.float().sum(0).to(w_dtype)
        return grad_x, grad_w, grad_b, None


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``F.linear`` with both operands cast to ``dtype`` (autocast's rule), row-invariant."""
    return _Linear.apply(x, weight, bias, dtype)

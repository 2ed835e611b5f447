"""A row-invariant bf16 matmul: row ``i`` of ``x @ w.T`` has the same bits whatever the other rows.

Why: a decode step multiplies one row per sequence, the trainer's forward every row of a
micro-batch; cuBLAS picks its tiling (and split-K) from the shape, so the same row can come out
with a different rounding. Here the tiling is a function of ``(K, N)`` only (:func:`tiles`): each
output element is one fp32 accumulation over ``K`` in ``BLOCK_K`` chunks, in order, with the same
tensor-core instruction for every ``M`` — no split-K. Backward uses torch's own kernels (only the
forward must match the rollout).

Skinny products (``N <= 512``: k/v projections, the router, LoRA's A) have few output tiles, so
a decode step's one row tile ran them on 1-4 CTAs walking all of ``K``. They split ``K`` into a
number of chunks fixed by ``(K, N)`` (:func:`config`), each chunk accumulated in order into an
fp32 partial, and the partials summed in chunk order by a second kernel: the reduction order of
an element is still a function of ``(K, N)`` only, so the product stays row-invariant.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch
import triton
import triton.language as tl

from omni_grpo.exact.switch import torch_kernels_on
from omni_grpo.models.grouped_gemm import (
    NUM_WARPS,
    RowTiling,
    row_tiling,
    swizzle,
    tiles,
)

# A bulk split-K product this narrow sums its chunks in one program (RowTiling.fuse_splits): on
# an H100 at 16k rows (benchmarks/results/exact_tiles_schedules_h100.json) a rank-16 LoRA A ran
# 1.74x faster so, the 128-column router 0.80x and the 512-column k/v projections 0.91x.
FUSED_SPLITS_MAX_N = 64

# One reduction per (K, N) class (tiles, config): never a function of M. The rows per tile may
# be (grouped_gemm.RowTiling: the same per-element arithmetic); BLOCK_M: the sum kernel's.
BLOCK_M = 64


@cache
def config(k: int, n: int) -> tuple[int, int, int, int]:
    """``(BLOCK_N, BLOCK_K, splits, chunk)``: the tiling, how many ``K`` chunks (1: no split) and
    each chunk's length (a multiple of ``BLOCK_K``). A function of ``(k, n)`` only, never of M."""
    block_n, block_k = tiles(k, n)
    if n <= 128 and k >= 1024:
        splits = min(8, k // 256)
    elif n <= 512 and k >= 1024:
        splits = min(4, k // 512)
    else:
        splits = 1
    chunk = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    return block_n, block_k, triton.cdiv(k, chunk), chunk


@triton.jit
def _chunk(
    a_ptr,
    b_ptr,
    rm,
    rn,
    M,
    N,
    k_lo,
    k_hi,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One output tile's fp32 product over ``K`` in ``[k_lo, k_hi)``, ``BLOCK_K`` at a time."""
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + rk
        a = tl.load(
            a_ptr + rm[:, None] * stride_am + kk[None, :] * stride_ak,
            mask=(rm[:, None] < M) & (kk[None, :] < k_hi),
            other=0.0,
        )
        b = tl.load(
            b_ptr + kk[:, None] * stride_bk + rn[None, :] * stride_bn,
            mask=(kk[:, None] < k_hi) & (rn[None, :] < N),
            other=0.0,
        )
        acc = tl.dot(a, b, acc)
    return acc


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
    stride_cs,
    stride_cm,
    stride_cn,
    CHUNK,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    FUSED_SPLITS: tl.constexpr,
):
    """One output tile, or (split-``K``) one ``K`` chunk's fp32 partial of it. ``FUSED_SPLITS``
    > 1: the program computes every chunk itself and adds them in chunk order in fp32 — the
    arithmetic of the partials summed by :func:`_sum_chunks_kernel`, without them in memory."""
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m, pid_n = swizzle(tl.program_id(0), num_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    pid_s = tl.program_id(1)  # the K chunk (split-K: c is then the fp32 partials [S, M, N])
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_lo = pid_s * CHUNK
    k_hi = tl.minimum(k_lo + CHUNK, K)
    c_ptr += pid_s.to(tl.int64) * stride_cs
    acc = _chunk(
        a_ptr,
        b_ptr,
        rm,
        rn,
        M,
        N,
        k_lo,
        k_hi,
        stride_am,
        stride_ak,
        stride_bk,
        stride_bn,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
    )
    for s in tl.static_range(1, FUSED_SPLITS):  # chunk 0 above, then 1, 2, ... in order
        acc += _chunk(
            a_ptr,
            b_ptr,
            rm,
            rn,
            M,
            N,
            s * CHUNK,
            tl.minimum((s + 1) * CHUNK, K),
            stride_am,
            stride_ak,
            stride_bk,
            stride_bn,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
        )
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(
        c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn,
        acc.to(c_ptr.dtype.element_ty),
        mask=(rm[:, None] < M) & (rn[None, :] < N),
    )


@triton.jit(do_not_specialize=["M", "stride_ps"])
def _sum_chunks_kernel(
    p_ptr,
    c_ptr,
    bias_ptr,
    M,
    N,
    stride_ps,
    stride_pm,
    stride_cm,
    stride_cn,
    S: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """``c = sum_s p[s] (+ bias)``, the chunks added in order ``s = 0, 1, ...``."""
    rm = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = (rm[:, None] < M) & (rn[None, :] < N)
    offs = rm[:, None] * stride_pm + rn[None, :]
    acc = tl.load(p_ptr + offs, mask=ok, other=0.0)
    for s in tl.static_range(1, S):
        acc += tl.load(p_ptr + stride_ps.to(tl.int64) * s + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(
        c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn,
        acc.to(c_ptr.dtype.element_ty),
        mask=ok,
    )


def mm(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None = None,
    tiling: RowTiling | None = None,
) -> torch.Tensor:
    """``a [M, K] @ b [K, N] (+ bias)`` in ``a``'s dtype with fp32 accumulation, row-invariant.
    ``tiling``: the tiles' rows, warps and launch order (default ``row_tiling(M)``: 128-row tiles for
    a training micro-batch or a prefill, split-K chunks summed in the program where ``N <=
    FUSED_SPLITS_MAX_N``; 64-row tiles for a decode step's rows)."""
    m, k = a.shape
    k2, n = b.shape
    if k != k2:
        raise ValueError(f"mm: a is {tuple(a.shape)} but b is {tuple(b.shape)}")
    out = torch.empty(m, n, dtype=a.dtype, device=a.device)
    if m == 0:
        return out
    if tiling is None:
        tiling = row_tiling(m)
        if tiling.block_m > BLOCK_M and n <= FUSED_SPLITS_MAX_N:  # the bulk tiling
            tiling = tiling._replace(fuse_splits=True)
    block_n, block_k, splits, chunk = config(k, n)
    block_n = tiling.column_block(k, n)
    fused = splits if splits > 1 and tiling.fuse_splits else 1  # the chunks in one program
    split = splits > 1 and fused == 1
    # split-K: the chunks' fp32 partials, summed in order below (bias added there)
    dest = torch.empty(splits, m, n, dtype=torch.float32, device=a.device) if split else out
    block_m, warps = tiling.block_m, tiling.warps
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n), splits if split else 1)
    _mm_kernel[grid](
        a,
        b,
        dest,
        bias if bias is not None and not split else a,
        m,
        n,
        k,
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        dest.stride(0) if split else 0,
        dest.stride(-2),
        dest.stride(-1),
        chunk,
        HAS_BIAS=bias is not None and not split,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        GROUP_M=tiling.group_m,
        FUSED_SPLITS=fused,
        num_warps=warps,
        num_stages=tiling.stages,
    )
    if split:
        _sum_chunks_kernel[(triton.cdiv(m, BLOCK_M), triton.cdiv(n, block_n))](
            dest,
            out,
            bias if bias is not None else a,
            m,
            n,
            dest.stride(0),
            dest.stride(1),
            out.stride(0),
            out.stride(1),
            S=splits,
            HAS_BIAS=bias is not None,
            BLOCK_M=BLOCK_M,
            BLOCK_N=block_n,
            num_warps=NUM_WARPS,
        )
    return out


class _Linear(torch.autograd.Function):
    """``x @ w.T + b`` in ``dtype``: the invariant kernel forward (torch's under
    ``exact.switch.torch_kernels``: the same saved tensors), torch's matmuls backward."""

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
        b = bias.to(dtype) if bias is not None else None
        # torch's kernel in a recompute (exact.switch)
        out = torch.nn.functional.linear(flat, w, b) if torch_kernels_on() else mm(flat, w.t(), b)
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

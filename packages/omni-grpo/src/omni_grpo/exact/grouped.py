"""A row-invariant grouped GEMM for the MoE experts: ``out[rows of e] = x[rows of e] @ w[e]``.

Why not torch's grouped GEMM: its kernel is chosen from the problem sizes, and an expert sees a
few rows in a decode step but hundreds in the trainer's forward. Here every expert's rows are cut
into ``BLOCK_M``-row tiles with the tiling a function of ``(K, N)`` only (``matmul.tiles``), so
each output row is one in-order fp32 accumulation over ``K`` whatever the rows around it. The
tile -> (expert, first row) map is computed on the device from the group offsets (no host sync:
the decode step stays CUDA-graph capturable); the grid is sized for the worst case and spare tiles
exit at once. Backward: torch's grouped GEMM (CUDA) or a loop over the groups (CPU tests), as
is the forward under ``exact.switch.torch_kernels`` (a recompute, the KL reference).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from omni_grpo.exact.matmul import NUM_STAGES, NUM_WARPS, tiles
from omni_grpo.exact.switch import torch_kernels_on

BLOCK_M = 64


@triton.jit
def _gmm_kernel(
    x_ptr,
    w_ptr,
    c_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    ends_ptr,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_we,
    stride_wk,
    stride_wn,
    stride_cm,
    stride_cn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(tile_expert_ptr + pid_t)
    if e >= 0:
        row0 = tl.load(tile_row_ptr + pid_t)
        end = tl.load(ends_ptr + e)
        rm = (row0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        w_base = w_ptr + e.to(tl.int64) * stride_we
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            a = tl.load(
                x_ptr + rm[:, None] * stride_xm + kk[None, :] * stride_xk,
                mask=(rm[:, None] < end) & (kk[None, :] < K),
                other=0.0,
            )
            b = tl.load(
                w_base + kk[:, None] * stride_wk + rn[None, :] * stride_wn,
                mask=(kk[:, None] < K) & (rn[None, :] < N),
                other=0.0,
            )
            acc = tl.dot(a, b, acc)
        tl.store(
            c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn,
            acc.to(c_ptr.dtype.element_ty),
            mask=(rm[:, None] < end) & (rn[None, :] < N),
        )


def tile_map(offs: torch.Tensor, rows: int, block_m: int = BLOCK_M) -> tuple[torch.Tensor, ...]:
    """``(tile_expert, tile_row)`` for every tile slot of the worst-case grid (device ops only).

    ``offs`` are the groups' cumulative row ends. A slot past the last real tile gets expert -1.
    """
    experts = offs.numel()
    ends = offs.long()
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    per = (ends - starts + block_m - 1) // block_m
    tile_end = torch.cumsum(per, 0)
    slots = torch.arange(triton.cdiv(rows, block_m) + experts, device=offs.device)
    expert = torch.searchsorted(tile_end, slots, right=True)
    used = expert < experts
    e = expert.clamp(max=experts - 1)
    row = starts[e] + (slots - (tile_end[e] - per[e])) * block_m
    return torch.where(used, e, -1).to(torch.int32), row.to(torch.int32)


TileMap = tuple[torch.Tensor, torch.Tensor]  # (tile_expert, tile_row): tile_map's result


def gmm(
    x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, plan: TileMap | None = None
) -> torch.Tensor:
    """``x [T, K]`` rows grouped by ``offs`` times ``w [E, K, N]`` (any strides), in ``x``'s dtype.

    ``plan``: ``tile_map(offs, T)`` when the caller has it already. A MoE block makes six
    grouped products over the same rows and offsets (gate_up, down and their LoRA A and B), and
    the map is ~20 small kernels: the H200 generation profile showed its index, searchsorted and
    scan kernels 6 times per layer and decode step, so ``exact.moe`` computes it once per block."""
    rows, k = x.shape
    experts, k2, n = w.shape
    if k != k2 or offs.numel() != experts:
        raise ValueError(f"gmm: x {tuple(x.shape)}, w {tuple(w.shape)}, {offs.numel()} offsets")
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    tile_expert, tile_row = plan if plan is not None else tile_map(offs, rows)
    block_n, block_k = tiles(k, n)
    grid = (tile_expert.numel(), triton.cdiv(n, block_n))
    _gmm_kernel[grid](
        x,
        w,
        out,
        tile_expert,
        tile_row,
        offs.to(torch.int32),
        n,
        k,
        x.stride(0),
        x.stride(1),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        out.stride(0),
        out.stride(1),
        BLOCK_M=BLOCK_M,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )
    return out


def _reference_gmm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    from omni_grpo.models.grouped_experts import grouped_mm

    return grouped_mm(x, w, offs).to(x.dtype)


def _weight_grad(x: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``[E, K, N]``: per group ``x_e.T @ grad_e`` (empty groups: zeros)."""
    if x.is_cuda and x.dtype == torch.bfloat16:
        fn = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
        # strides must be multiples of 16 bytes (a LoRA rank of 4 is not): zero-pad, then cut
        k, n = x.shape[1], grad.shape[1]
        x_pad = torch.nn.functional.pad(x, (0, -k % 8))
        grad_pad = torch.nn.functional.pad(grad, (0, -n % 8))
        return fn(x_pad.t(), grad_pad, offs=offs)[:, :k, :n]
    out = x.new_zeros(offs.numel(), x.shape[1], grad.shape[1])
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            out[e] = x[start:end].t() @ grad[start:end]
        start = end
    return out


class _GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, plan: TileMap | None
    ) -> torch.Tensor:
        ctx.save_for_backward(x, w, offs)
        if torch_kernels_on():  # a recompute or the KL reference (exact.switch)
            return _reference_gmm(x, w, offs)
        return gmm(x, w, offs, plan)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, Any, None, None]:  # type: ignore[override]
        x, w, offs = ctx.saved_tensors
        grad = grad.to(x.dtype)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = _reference_gmm(grad, w.transpose(-2, -1).to(x.dtype), offs)
        if ctx.needs_input_grad[1]:
            grad_w = _weight_grad(x, grad, offs).to(w.dtype)
        return grad_x, grad_w, None, None


def grouped_linear(
    x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, plan: TileMap | None = None
) -> torch.Tensor:
    """Differentiable :func:`gmm` (``w`` cast to ``x``'s dtype first, as autocast would)."""
    return _GroupedMM.apply(x, w.to(x.dtype), offs, plan)

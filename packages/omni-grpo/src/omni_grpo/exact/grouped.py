"""A row-invariant grouped GEMM for the MoE experts: ``out[rows of e] = x[rows of e] @ w[e]``.

Why not torch's grouped GEMM: its kernel is chosen from the problem sizes, and an expert sees a
few rows in a decode step but hundreds in the trainer's forward. Here every expert's rows are cut
into ``BLOCK_M``-row tiles with the tiling a function of ``(K, N)`` only (``matmul.tiles``), so
each output row is one in-order fp32 accumulation over ``K`` whatever the rows around it. The
tile -> (expert, first row) map is computed on the device from the group offsets (no host sync:
the decode step stays CUDA-graph capturable); the grid is sized for the worst case and spare tiles
exit at once. The kernel lives a floor below (``models.grouped_gemm``: the default path's
generation runs it too); here it becomes a differentiable Function. Backward: torch's grouped
GEMM (CUDA) or a loop over the groups (CPU tests), as is the forward under
``exact.switch.torch_kernels`` (a recompute).
"""

from __future__ import annotations

from typing import Any

import torch

from omni_grpo.exact.switch import torch_kernels_on
from omni_grpo.models.grouped_gemm import (
    BLOCK_M,
    DECODE_TILING,
    RowTiling,
    TileMap,
    gmm,
    row_tiling,
    tile_map,
)

__all__ = ["BLOCK_M", "RowTiling", "TileMap", "gmm", "grouped_linear", "row_tiling", "tile_map"]


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
        ctx: Any,
        x: torch.Tensor,
        w: torch.Tensor,
        offs: torch.Tensor,
        plan: TileMap | None,
        tiling: RowTiling,
        residual: torch.Tensor | None,
    ) -> torch.Tensor:
        ctx.save_for_backward(x, w, offs)
        if torch_kernels_on():  # a recompute (exact.switch)
            out = _reference_gmm(x, w, offs)
            return out if residual is None else residual + out
        return gmm(x, w, offs, plan, tiling, residual)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        x, w, offs = ctx.saved_tensors
        grad_residual = grad if ctx.needs_input_grad[5] else None
        grad = grad.to(x.dtype)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = _reference_gmm(grad, w.transpose(-2, -1).to(x.dtype), offs)
        if ctx.needs_input_grad[1]:
            grad_w = _weight_grad(x, grad, offs).to(w.dtype)
        return grad_x, grad_w, None, None, None, grad_residual


def grouped_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    offs: torch.Tensor,
    plan: TileMap | None = None,
    tiling: RowTiling = DECODE_TILING,
    residual: torch.Tensor | None = None,
    gather: torch.Tensor | None = None,
) -> torch.Tensor:
    """Differentiable :func:`gmm` (``w`` cast to ``x``'s dtype first, as autocast would);
    ``plan`` cut for ``tiling.block_m``; ``residual``: added in the kernel's epilogue, the bits
    of ``residual + grouped_linear(x, w, offs)``. ``gather``: the product of ``x[gather]``, its
    rows read through the ids by the kernel — only where no graph is recorded (the backward
    would need the gathered rows)."""
    if gather is None:
        return _GroupedMM.apply(x, w.to(x.dtype), offs, plan, tiling, residual)
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        raise ValueError(
            "grouped_linear: gather= reads rows without a graph; call it under no_grad"
        )
    return gmm(x, w.to(x.dtype), offs, plan, tiling, residual, gather)

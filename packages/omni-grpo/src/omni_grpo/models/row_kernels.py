"""Two per-row Triton kernels below the exact path: RMSNorm and the MoE router's top-k.

Each reduces one row in one program over a fixed order, so a row's result does not depend on
the rows beside it. Exact mode (``omni_grpo.exact.rowwise``, ``omni_grpo.exact.router``) needs
that; the default path's decode steps (``models.decode_kernels``) take them for their kernel
count: transformers' RMSNorm is eight elementwise and reduction kernels and its router five,
each a few microseconds in a 64-row decode step, for every layer and every token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# ----------------------------------------------------------------------------------- RMSNorm
@triton.jit
def _rmsnorm_kernel(x_ptr, w_ptr, y_ptr, N, eps, stride_x, stride_y, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    var = tl.sum(x * x, axis=0) / N
    normed = (x * (1.0 / tl.sqrt(var + eps))).to(y_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    y = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=ok)


def rmsnorm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The kernel's forward over the last dim of ``x``: one program per row, fixed order."""
    n = x.shape[-1]
    flat = x.reshape(-1, n)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    out = torch.empty(flat.shape, dtype=x.dtype, device=x.device)
    if flat.shape[0]:
        _rmsnorm_kernel[(flat.shape[0],)](
            flat,
            weight,
            out,
            n,
            eps,
            flat.stride(0),
            out.stride(0),
            BLOCK=triton.next_power_of_2(n),
            num_warps=4,
        )
    return out.view(x.shape)


# ------------------------------------------------------------------------------------ router
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

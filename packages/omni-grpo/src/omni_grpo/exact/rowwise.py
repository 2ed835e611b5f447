"""Row-wise reductions with one fixed order: RMSNorm, token log-probabilities, small sums.

Why: torch's reduction kernels choose how to split a row across threads and blocks from the
number of rows (few rows: more blocks per row), so a decode step's row and the same row inside a
training micro-batch can be summed in different orders. Here a row is always reduced by one
program over fixed-size chunks in order (Triton), or, for the router's few values, by a fixed
pairwise tree of elementwise adds (:func:`tree_sum`; elementwise kernels round every element
the same way whatever the shape). The RMSNorm kernel lives a floor below
(``models.row_kernels``: the default path's decode steps run it too).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from omni_grpo.exact.switch import torch_kernels_on
from omni_grpo.models.row_kernels import rmsnorm_rows


# ----------------------------------------------------------------------------------- RMSNorm
def _torch_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' formula (the backward's recompute)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        if torch_kernels_on():  # a recompute (exact.switch)
            return _torch_rmsnorm(x, weight, eps)
        return rmsnorm_rows(x, weight, eps)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, Any, None]:  # type: ignore[override]
        x, weight = ctx.saved_tensors
        with torch.enable_grad():
            xd = x.detach().requires_grad_(ctx.needs_input_grad[0])
            wd = weight.detach().requires_grad_(ctx.needs_input_grad[1])
            out = _torch_rmsnorm(xd, wd, ctx.eps)
            inputs = [t for t in (xd, wd) if t.requires_grad]
            grads = iter(torch.autograd.grad(out, inputs, grad))
        return (
            next(grads) if ctx.needs_input_grad[0] else None,
            next(grads) if ctx.needs_input_grad[1] else None,
            None,
        )


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / rms(x)).to(x.dtype)`` over the last dim (transformers' Qwen3 RMSNorm
    formula), the sum of squares in one fixed order per row."""
    if weight.dtype != x.dtype:
        raise ValueError(f"rmsnorm: weight is {weight.dtype} but the input is {x.dtype}")
    return _RMSNorm.apply(x, weight, eps)


# --------------------------------------------------------------------------- token logprobs
@triton.jit
def _token_logprob_kernel(z_ptr, tgt_ptr, out_ptr, V, stride_z, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = z_ptr + row * stride_z
    cols = tl.arange(0, BLOCK)
    m = tl.max(tl.full((BLOCK,), float("-inf"), tl.float32), axis=0)
    s = tl.sum(tl.zeros((BLOCK,), tl.float32), axis=0)
    for v0 in range(0, V, BLOCK):
        x = tl.load(base + v0 + cols, mask=v0 + cols < V, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    t = tl.load(tgt_ptr + row)
    zt = tl.load(base + t)
    tl.store(out_ptr + row, zt - (m + tl.log(s)))


LOGPROB_BLOCK = 4096


def token_logprobs(z: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``log_softmax(z)[target]`` per row of fp32 ``z [N, V]``; the log-sum-exp is one online pass
    over ``LOGPROB_BLOCK``-wide chunks in order, the same for a decode row and a training row."""
    if z.dtype != torch.float32 or z.dim() != 2:
        raise ValueError(
            f"token_logprobs takes float32 [N, V] logits, got {z.dtype} {tuple(z.shape)}"
        )
    if z.stride(-1) != 1:
        z = z.contiguous()
    out = torch.empty(z.shape[0], dtype=torch.float32, device=z.device)
    if z.shape[0]:
        _token_logprob_kernel[(z.shape[0],)](
            z,
            targets.long().contiguous(),
            out,
            z.shape[1],
            z.stride(0),
            BLOCK=LOGPROB_BLOCK,
            num_warps=8,
        )
    return out


# ------------------------------------------------------------------------------ small sums
def tree_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim (keepdim) by a fixed pairwise tree of elementwise adds; the width is
    zero-padded to a power of two (adding 0 is exact)."""
    n = x.shape[-1]
    width = 1 << max(0, (n - 1).bit_length())
    if width != n:
        x = torch.nn.functional.pad(x, (0, width - n))
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x


def softmax(x: torch.Tensor) -> torch.Tensor:
    """fp32 softmax over the last dim: the max is exact in any order, the sum is :func:`tree_sum`."""
    z = x.float()
    e = torch.exp(z - z.amax(-1, keepdim=True))
    return e / tree_sum(e)

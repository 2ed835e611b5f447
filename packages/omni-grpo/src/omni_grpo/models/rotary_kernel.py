"""The text attention's rotary embedding as one kernel per tensor, bit for bit torch's composition.

Why: transformers applies it as ``q * cos + rotate_half(q) * sin`` and the same for ``k``: ten
elementwise kernels a layer (two products, a negation, a concatenation and a sum per tensor) over
the attention's transposed views, which take torch's generic strided path. In a profile of the
exact update (20 real-width layers, 9k-token micro-batches, one H100) they were the largest cost
of the KL reference's and the policy's forwards after the GEMMs (``CatArrayBatchedCopy``, ``neg``
and the strided ``mul``/``add`` kernels: ~90 ms a forward), and they are ten graph nodes a layer
in every decode step. Here one Triton program per (row, position) reads ``x``, ``cos`` and ``sin``
once and writes the result.

The result is torch's bits: each product is rounded to bf16, then the two are added in fp32 and
rounded (round to nearest even), which is what torch's bf16 ``mul`` and ``add`` do on CUDA
(fp32 arithmetic, one rounding per op). So no path's numbers change — exact mode's decode and
trainer alike, the option-off path's generation and reference — only the kernel count.

Where: forwards that record no autograd graph (generation, the KL reference, exact mode's first
forward) on CUDA in bf16, outside ``torch.compile`` (whose inductor fuses the composition itself);
anything else calls transformers' function.

Opt-in for now (``OMNI_GRPO_FUSED_ROTARY=1``). Session 46 ran it on an H100
(``benchmarks/results/rotary_h100.json``): 7.8x transformers' composition at a 16 x 560-token
micro-batch (0.078 against 0.612 ms a layer's q and k; 0.71 of the copy bandwidth's bound) and
1.6x at a 64-row decode step, but that version rounded with ``.to(bf16).to(fp32)`` and came out
one bf16 ulp off torch on a few elements of every GPU test shape. It now rounds on the bits
(:func:`_nearest_bf16`), which Triton's interpreter runs as the GPU does: the CPU test compares
it with torch's bf16 ops bit for bit. The GPU test (``tests/test_rotary_kernel_gpu.py``) has
not run on this version; until it passes, every forward keeps transformers' function.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl
from torch import nn

FUNCTION = "apply_rotary_pos_emb"  # transformers' name, in the text attention's module
_FUSED = "_omni_fused_rotary"  # marks the wrapper (installed once per module)
SWITCH = "OMNI_GRPO_FUSED_ROTARY"  # "1": take the kernel (opt-in: see the module docstring)


@triton.jit
def _nearest_bf16(x):
    """fp32 ``x`` -> the nearest bf16 value (ties to even) held in fp32: the rounding of torch's
    bf16 ops, done on the bits. Why not ``x.to(bf16).to(fp32)``: on an H100 that version of this
    kernel came out one bf16 ulp off torch on a few elements in every test shape (a rounding the
    compiler may drop, fusing the product into the sum), and Triton's interpreter truncates."""
    bits = x.to(tl.int32, bitcast=True)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))


@triton.jit
def _rotary_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    T,
    H,
    sx_b,
    sx_h,
    sx_t,
    so_b,
    so_h,
    so_t,
    sc_b,
    sc_t,
    ss_b,
    ss_t,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    row = tl.program_id(0)
    b = (row // T).to(tl.int64)
    t = (row % T).to(tl.int64)
    d = tl.arange(0, HALF)
    c1 = tl.load(cos_ptr + b * sc_b + t * sc_t + d).to(tl.float32)
    c2 = tl.load(cos_ptr + b * sc_b + t * sc_t + HALF + d).to(tl.float32)
    s1 = tl.load(sin_ptr + b * ss_b + t * ss_t + d).to(tl.float32)
    s2 = tl.load(sin_ptr + b * ss_b + t * ss_t + HALF + d).to(tl.float32)
    h = (tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)
    ok = (h < H)[:, None]
    src = x_ptr + b * sx_b + t * sx_t + h[:, None] * sx_h + d[None, :]
    x1 = tl.load(src, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=ok, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    # x * cos and rotate_half(x) * sin = (-x2, x1) * sin, each rounded as torch's mul rounds it,
    # then their sum rounded as torch's add (the store's conversion is then exact)
    a1 = x1 * c1[None, :]
    a2 = x2 * c2[None, :]
    r1 = -x2 * s1[None, :]
    r2 = x1 * s2[None, :]
    if ROUND_BF16:
        a1, a2, r1, r2 = _nearest_bf16(a1), _nearest_bf16(a2), _nearest_bf16(r1), _nearest_bf16(r2)
    o1 = a1 + r1
    o2 = a2 + r2
    if ROUND_BF16:
        o1, o2 = _nearest_bf16(o1), _nearest_bf16(o2)
    dst = out_ptr + b * so_b + t * so_t + h[:, None] * so_h + d[None, :]
    tl.store(dst, o1.to(dt), mask=ok)
    tl.store(dst + HALF, o2.to(dt), mask=ok)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` for ``x [B, H, T, D]`` (any strides with the last dim
    dense) and ``cos``/``sin`` ``[B or 1, T, D]`` (broadcast over the heads), in one launch.
    The output keeps ``x``'s memory layout (``empty_like``)."""
    if x.dtype not in (torch.bfloat16, torch.float32):  # the roundings it reproduces
        raise ValueError(f"rotate: {x.dtype} (bf16 with torch's roundings, or fp32)")
    bsz, heads, length, dim = x.shape
    out = torch.empty_like(x)
    if out.numel() == 0:
        return out
    block_h = min(triton.next_power_of_2(heads), 16)
    sc_b = cos.stride(0) if cos.shape[0] > 1 else 0
    ss_b = sin.stride(0) if sin.shape[0] > 1 else 0
    grid = (bsz * length, triton.cdiv(heads, block_h))
    _rotary_kernel[grid](
        x,
        cos,
        sin,
        out,
        length,
        heads,
        x.stride(0),
        x.stride(1),
        x.stride(2),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        sc_b,
        cos.stride(1),
        ss_b,
        sin.stride(1),
        HALF=dim // 2,
        BLOCK_H=block_h,
        ROUND_BF16=out.dtype == torch.bfloat16,
        num_warps=4,
    )
    return out


def _dense_last(*tensors: torch.Tensor) -> bool:
    return all(t.stride(-1) == 1 for t in tensors)


def fused_applies(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether :func:`rotate` computes this call (see the module docstring): CUDA bf16 tensors of
    the text attention's shapes, no autograd graph, not inside ``torch.compile``."""
    if os.environ.get(SWITCH, "0") != "1" or torch.compiler.is_compiling():
        return False
    tensors = (q, k, cos, sin)
    if not all(t.is_cuda and t.dtype == torch.bfloat16 for t in tensors):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or sin.shape != cos.shape:
        return False
    bsz, _, length, dim = q.shape
    half = dim // 2
    return (
        k.shape[0] == bsz
        and k.shape[2:] == q.shape[2:]
        and cos.shape[1:] == (length, dim)
        and cos.shape[0] in (1, bsz)
        and dim % 2 == 0
        and half == triton.next_power_of_2(half)
        and _dense_last(*tensors)
    )


def fused_rotary(original: Callable[..., Any]) -> Callable[..., Any]:
    """transformers' ``apply_rotary_pos_emb`` that takes :func:`rotate` where it applies."""

    @functools.wraps(original)
    def apply_rotary_pos_emb(
        q: torch.Tensor,
        k: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        *args: Any,
        **kw: Any,
    ) -> Any:
        # only the call as the attention makes it: nothing past ``unsqueeze_dim``, which is 1
        plain = set(kw) <= {"unsqueeze_dim"} and [*args, *kw.values()] in ([], [1])
        if plain and fused_applies(q, k, cos, sin):
            return rotate(q, cos, sin), rotate(k, cos, sin)
        return original(q, k, cos, sin, *args, **kw)

    setattr(apply_rotary_pos_emb, _FUSED, True)
    return apply_rotary_pos_emb


def install_fused_rotary(layers: nn.ModuleList) -> bool:
    """Route the text attention's ``apply_rotary_pos_emb`` (a global of the module that defines
    its class) through :func:`fused_rotary`; once per module, safe to call again. Returns
    whether that module has the function (another architecture keeps its own)."""
    attention = getattr(layers[0], "self_attn", None) if len(layers) else None
    module = sys.modules.get(type(attention).__module__) if attention is not None else None
    original = getattr(module, FUNCTION, None)
    if original is None:
        return False
    if not getattr(original, _FUSED, False):
        setattr(module, FUNCTION, fused_rotary(original))
    return True

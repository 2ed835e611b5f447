"""A split-KV decode attention kernel (Triton) reading each row's keys only up to its length.

Why our own: measured on an H200 (``benchmarks/decode_attention.py``) at the thinker's widths,
torch's SDPA over the decoder's static, left-padded KV buffer (with the padding mask it needs)
read what a step must read at 11-32 % of the copy bandwidth — 90 us per layer at 64 rows and
310 us at 256, i.e. 4.3 and 15 ms of every 48-layer decode step — and it reads the whole buffer
(``prompt + max_new_tokens``) from the first new token on. Here each program reads one KV head's
keys of one row, from the row's first real key (left padding skipped) to the current decode
slot (a device tensor: nothing is read back to the host, so the step stays CUDA-graph
capturable), split over ``splits`` programs when there are few rows, with an online softmax in
fp32; a second kernel merges the splits. The 8 query heads of a KV group share each key block
(one ``tl.dot`` of 16 padded query rows), so the cache is read once per group.

Used by ``models.decode_attention`` inside the decode steps on CUDA; everything else (prefill,
training, CPU) stays on SDPA. The CPU tests run it in Triton's interpreter.
"""

from __future__ import annotations

import math
from typing import Any

import torch

BLOCK_N = 64  # keys per block
LOG2E = 1.4426950408889634
_KERNELS: tuple[Any, Any] | None = None


def _kernels() -> tuple[Any, Any]:
    """The two Triton kernels, built on first use (Triton is imported only where it runs)."""
    global _KERNELS
    if _KERNELS is not None:
        return _KERNELS
    import triton
    import triton.language as tl

    @triton.jit
    def split_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        start_ptr,
        slot_ptr,
        m_ptr,
        l_ptr,
        acc_ptr,
        stride_qb,
        stride_qh,
        stride_qg,
        stride_kb,
        stride_kh,
        stride_kt,
        stride_vb,
        stride_vh,
        stride_vt,
        scale_log2e,
        G: tl.constexpr,
        GP: tl.constexpr,
        D: tl.constexpr,
        BLOCK: tl.constexpr,
        SPLITS: tl.constexpr,
        SLOT_STRIDE: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.program_id(2)
        kv_heads = tl.num_programs(1)
        start = tl.load(start_ptr + b)
        # the slot written this step is the row's last key (one for all rows, or one per row)
        end = tl.load(slot_ptr + b * SLOT_STRIDE) + 1
        first = (start // BLOCK) * BLOCK  # blocks aligned to the buffer: coalesced loads
        chunk = tl.cdiv(tl.cdiv(end - first, SPLITS), BLOCK) * BLOCK
        lo = tl.multiple_of(first + s * chunk, BLOCK)
        hi = tl.minimum(lo + chunk, end)
        offs_g = tl.arange(0, GP)
        offs_d = tl.arange(0, D)
        offs_n = tl.arange(0, BLOCK)
        q_rows = q_ptr + b * stride_qb + h * stride_qh + offs_g[:, None] * stride_qg
        q = tl.load(q_rows + offs_d[None, :], mask=offs_g[:, None] < G, other=0.0)
        m = tl.full([GP], float("-inf"), tl.float32)
        l_sum = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        k_base = k_ptr + b * stride_kb + h * stride_kh
        v_base = v_ptr + b * stride_vb + h * stride_vh
        for pos0 in range(lo, hi, BLOCK):
            pos = pos0 + offs_n
            valid = (pos >= start) & (pos < hi)
            k = tl.load(
                k_base + pos[:, None] * stride_kt + offs_d[None, :], mask=valid[:, None], other=0.0
            )
            scores = tl.dot(q, tl.trans(k)) * scale_log2e
            scores = tl.where(valid[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, 1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(scores - m_new[:, None])
            l_sum = l_sum * alpha + tl.sum(p, 1)
            v = tl.load(
                v_base + pos[:, None] * stride_vt + offs_d[None, :], mask=valid[:, None], other=0.0
            )
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        row = (b * kv_heads + h) * SPLITS + s
        tl.store(m_ptr + row * GP + offs_g, m)
        tl.store(l_ptr + row * GP + offs_g, l_sum)
        tl.store(acc_ptr + (row * GP + offs_g[:, None]) * D + offs_d[None, :], acc)

    @triton.jit
    def merge_kernel(
        m_ptr,
        l_ptr,
        acc_ptr,
        out_ptr,
        stride_ob,
        stride_oh,
        stride_og,
        G: tl.constexpr,
        GP: tl.constexpr,
        D: tl.constexpr,
        SPLITS: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        kv_heads = tl.num_programs(1)
        offs_s = tl.arange(0, SPLITS)
        offs_g = tl.arange(0, GP)
        offs_d = tl.arange(0, D)
        rows = (b * kv_heads + h) * SPLITS + offs_s
        m = tl.load(m_ptr + rows[:, None] * GP + offs_g[None, :])  # [SPLITS, GP]
        l_sum = tl.load(l_ptr + rows[:, None] * GP + offs_g[None, :])
        m_max = tl.max(m, 0)
        w = tl.exp2(m - m_max[None, :])  # an empty split (m = -inf) weighs 0
        denom = tl.sum(w * l_sum, 0)
        acc = tl.load(
            acc_ptr + (rows[:, None, None] * GP + offs_g[None, :, None]) * D + offs_d[None, None, :]
        )
        out = tl.sum(acc * w[:, :, None], 0) / denom[:, None]
        dst = out_ptr + b * stride_ob + h * stride_oh + offs_g[:, None] * stride_og
        tl.store(dst + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=offs_g[:, None] < G)

    _KERNELS = (split_kernel, merge_kernel)
    return _KERNELS


def num_splits(rows: int, kv_heads: int, device: torch.device) -> int:
    """Splits per (row, KV head): enough programs for ~4 waves over the SMs, a power of 2 <= 16."""
    sms = (
        torch.cuda.get_device_properties(device).multi_processor_count
        if device.type == "cuda"
        else 8
    )
    want = math.ceil(4 * sms / max(1, rows * kv_heads))
    return min(16, 1 << max(0, math.ceil(math.log2(want))))


def decode_attention_kernel(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    start: torch.Tensor,
    slot: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """Attention of one packed query per (row, KV head) over keys ``[start[b], slot]``.

    ``query [B, KVH, G, D]`` (the G query heads of a KV group as rows), ``key``/``value``
    ``[B, KVH, T, D]`` (any strides with a contiguous last dim), ``start [B]`` int32 (first real
    key of each row), ``slot [1]`` int64 (the last key, the same for every row) or ``[B]`` (each
    row's own last key: the continuous decoder's rows started at different steps). Returns
    ``[B, KVH, G, D]`` in the query's dtype.
    """
    split_kernel, merge_kernel = _kernels()
    batch, kv_heads, group, dim = query.shape
    gp = max(16, 1 << math.ceil(math.log2(group)))  # tl.dot needs >= 16 rows
    splits = num_splits(batch, kv_heads, query.device)
    f32 = dict(device=query.device, dtype=torch.float32)
    m = torch.empty(batch, kv_heads, splits, gp, **f32)
    l_sum = torch.empty(batch, kv_heads, splits, gp, **f32)
    acc = torch.empty(batch, kv_heads, splits, gp, dim, **f32)
    out = torch.empty_like(query)
    for t in (query, key, value):
        if t.stride(-1) != 1:
            raise ValueError("decode_attention_kernel needs a contiguous last (head) dimension")
    split_kernel[(batch, kv_heads, splits)](
        query,
        key,
        value,
        start,
        slot,
        m,
        l_sum,
        acc,
        query.stride(0),
        query.stride(1),
        query.stride(2),
        key.stride(0),
        key.stride(1),
        key.stride(2),
        value.stride(0),
        value.stride(1),
        value.stride(2),
        scaling * LOG2E,
        G=group,
        GP=gp,
        D=dim,
        BLOCK=BLOCK_N,
        SPLITS=splits,
        SLOT_STRIDE=1 if slot.numel() > 1 else 0,
    )
    merge_kernel[(batch, kv_heads)](
        m,
        l_sum,
        acc,
        out,
        out.stride(0),
        out.stride(1),
        out.stride(2),
        G=group,
        GP=gp,
        D=dim,
        SPLITS=splits,
    )
    return out

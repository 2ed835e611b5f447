"""One attention kernel for the decode step and the full-sequence forward, bitwise alike per query.

Why: the decode step attends one new query per sequence over a static KV buffer, the trainer's
forward every query of the sequence at once; SDPA's kernels (and the decode path's GQA packing)
split the keys differently in the two, so the same query's softmax sums in another order. Here
every query's keys are visited in ``BLOCK_N`` blocks that start at the sequence's first real key
(``start``, per batch row: left padding differs between a generation batch and a micro-batch),
in order, with an online softmax whose per-row arithmetic does not depend on the other rows of
the tile. A tile is always ``BLOCK_M`` rows of (query position, head of one KV group), so decode
(one position x the group's heads) and training (several positions x the heads) run the same
instructions. Blocks past a row's own last key are fully masked for it and leave its running
max, sum and accumulator bit-identical (``exp(0) = 1``, ``p = 0``), so the extra blocks a
training tile walks for its later rows change nothing. Keys past the tile's last query are
loaded as 0.

Backward: torch's SDPA (any kernel may serve the gradient). Under ``exact.switch.torch_kernels``
(gradient checkpointing's recompute) the forward is SDPA with transformers' own
mask — the off path's kernels — and in a recompute the SDPA graph built there travels to the
backward attached to a saved placeholder tensor (the checkpoint hands the recomputed saved
tensors, as objects, to the first forward's node), so the backward is SDPA's backward alone.
Without a recompute (checkpointing off) the backward re-runs SDPA's forward first.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl

from omni_grpo.exact.switch import torch_kernels_on

BLOCK_M = 64
BLOCK_N = 64
NAME = "omni_exact"


@triton.jit(do_not_specialize=["Lq", "Lk"])  # one compiled kernel for every size
def _attn_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    start_ptr,
    qoff_ptr,
    scale,
    Lq,
    Lk,
    KVH,
    sqb,
    sqh,
    sql,
    skb,
    skh,
    skl,
    svb,
    svh,
    svl,
    sob,
    sol,
    soh,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    POS: tl.constexpr = BLOCK_M // G
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // KVH).to(tl.int64)
    kvh = pid_bh % KVH
    r = tl.arange(0, BLOCK_M)
    pos = pid_m * POS + r // G
    head = kvh * G + r % G
    row_ok = pos < Lq
    d = tl.arange(0, D)
    q = tl.load(
        q_ptr + b * sqb + head[:, None] * sqh + pos[:, None] * sql + d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    start = tl.load(start_ptr + b)
    qoff = tl.load(qoff_ptr + b)
    qabs = qoff + pos
    hi = tl.minimum(qoff + tl.minimum(pid_m * POS + POS, Lq), Lk)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    k_base = k_ptr + b * skb + kvh * skh
    v_base = v_ptr + b * svb + kvh * svh
    for kb in range(start, hi, BLOCK_N):
        kn = kb + tl.arange(0, BLOCK_N)
        kin = kn < hi
        k = tl.load(k_base + kn[:, None] * skl + d[None, :], mask=kin[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale
        allowed = (kn[None, :] <= qabs[:, None]) & kin[None, :] & row_ok[:, None]
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + kn[:, None] * svl + d[None, :], mask=kin[:, None], other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    has_keys = l_i > 0  # a padding query attends nothing: 0, and no 0/0 computed
    out = tl.where(has_keys[:, None], acc / tl.where(has_keys, l_i, 1.0)[:, None], 0.0)
    tl.store(
        o_ptr + b * sob + pos[:, None] * sol + head[:, None] * soh + d[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=row_ok[:, None],
    )


def row_bounds(
    mask: torch.Tensor | None, batch: int, q_len: int, kv_len: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(start, qoff)`` per batch row: the first real key, and the key column of query 0.

    From transformers' boolean mask ``[B, 1, q, kv]`` (True = attend): the last query row sees
    every real key up to itself. A decode step (``q == 1``) over a static buffer sits at that
    row's last attended key; a full-sequence forward has its queries at the last ``q`` columns.
    ``None`` (no padding anywhere): start 0.
    """
    if mask is None:
        start = torch.zeros(batch, dtype=torch.int32, device=device)
        return start, torch.full_like(start, kv_len - q_len)
    last = mask[:, 0, -1, :kv_len]
    if last.dtype != torch.bool:
        last = last == 0  # an additive float mask: 0 = attend
    last = last.expand(batch, kv_len).to(torch.int8)
    start = last.argmax(-1).to(torch.int32)
    if q_len == 1:
        qoff = (kv_len - 1 - last.flip(-1).argmax(-1)).to(torch.int32)
    else:
        qoff = torch.full_like(start, kv_len - q_len)
    return start, qoff


def exact_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start: torch.Tensor,
    qoff: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``q [B, H, Lq, D]``, ``k``/``v [B, KVH, Lk, D]`` -> ``[B, Lq, H, D]`` (the kernel's forward)."""
    batch, heads, q_len, dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    group = heads // kv_heads
    if heads % kv_heads or BLOCK_M % group:
        raise ValueError(
            f"exact attention: {heads} heads over {kv_heads} KV heads is not supported"
        )
    if dim & (dim - 1) or dim < 16:
        raise ValueError(f"exact attention: head_dim {dim} is not a power of two >= 16")
    for t in (q, k, v):
        if t.stride(-1) != 1:
            raise ValueError("exact attention: the head dim must be contiguous")
    out = torch.empty(batch, q_len, heads, dim, dtype=q.dtype, device=q.device)
    grid = (triton.cdiv(q_len, BLOCK_M // group), batch * kv_heads)
    _attn_kernel[grid](
        q,
        k,
        v,
        out,
        start,
        qoff,
        scale,
        q_len,
        kv_len,
        kv_heads,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        G=group,
        D=dim,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        num_warps=4,
        num_stages=2,
    )
    return out


def allowed_mask(start: torch.Tensor, qoff: torch.Tensor, q_len: int, kv_len: int) -> torch.Tensor:
    """The boolean ``[B, 1, q, kv]`` mask the kernel applies (plus each query's own column, so a
    padding query is never fully masked in the backward's SDPA)."""
    keys = torch.arange(kv_len, device=start.device)
    qabs = qoff[:, None].long() + torch.arange(q_len, device=start.device)[None]
    ok = (keys[None, None] >= start[:, None, None]) & (keys[None, None] <= qabs[..., None])
    ok |= keys[None, None] == qabs[..., None]
    return ok[:, None]


def torch_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """The same attention with torch's SDPA and the model's mask (``None``: causal), as the
    off path computes it: ``[B, H, q, d]`` -> ``[B, q, H, d]``."""
    group = q.shape[1] // k.shape[1]
    if group > 1:  # transformers' repeat_kv: SDPA's GQA mode takes no mask on CUDA
        k = k.repeat_interleave(group, 1)
        v = v.repeat_interleave(group, 1)
    causal = mask is None and q.shape[2] > 1
    if causal and k.shape[2] != q.shape[2]:
        raise ValueError("exact attention: no mask and a KV length unlike the query's")
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, scale=scale
    )
    return out.transpose(1, 2).contiguous()


_GRAPH = "_omni_sdpa_graph"  # the placeholder's attribute that carries a recompute's SDPA graph


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        start: torch.Tensor,
        qoff: torch.Tensor,
        mask: torch.Tensor | None,
        scale: float,
    ) -> torch.Tensor:
        needs = ctx.needs_input_grad[:3]
        if not any(needs):  # no graph (a decode step, a no-grad forward): nothing to save
            if torch_kernels_on():
                return torch_attention(q, k, v, mask, scale)
            return exact_attention(q, k, v, start, qoff, scale)
        # the same saved tensors in both branches: the checkpoint compares their metadata
        placeholder = torch.empty(0, device=q.device)
        ctx.scale = scale
        if torch_kernels_on():  # a recompute: SDPA with its graph, for the backward
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_keep, _keep):
                leaves = tuple(
                    t.detach().requires_grad_(n) for t, n in zip((q, k, v), needs, strict=True)
                )
                out = torch_attention(*leaves, mask, scale)
            setattr(placeholder, _GRAPH, (out, leaves, needs))
            ctx.save_for_backward(q, k, v, start, qoff, placeholder)
            return out.detach()
        ctx.save_for_backward(q, k, v, start, qoff, placeholder)
        return exact_attention(q, k, v, start, qoff, scale)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        q, k, v, start, qoff, placeholder = ctx.saved_tensors
        graph = placeholder.__dict__.pop(_GRAPH, None)
        if graph is not None:  # recomputed under exact.switch.torch_kernels: SDPA's backward
            out, leaves, needs = graph
            wanted = [t for t, n in zip(leaves, needs, strict=True) if n]
            grads = iter(torch.autograd.grad(out, wanted, grad) if wanted else ())
            gq, gk, gv = (next(grads) if n else None for n in needs)
            return gq, gk, gv, None, None, None, None
        group = q.shape[1] // k.shape[1]
        with torch.enable_grad():
            qd, kd, vd = (t.detach().requires_grad_() for t in (q, k, v))
            mask = allowed_mask(start, qoff, q.shape[2], k.shape[2])
            out = torch.nn.functional.scaled_dot_product_attention(
                qd,
                kd.repeat_interleave(group, 1),
                vd.repeat_interleave(group, 1),
                attn_mask=mask,
                scale=ctx.scale,
            )
            gq, gk, gv = torch.autograd.grad(out.transpose(1, 2), (qd, kd, vd), grad)
        return gq, gk, gv, None, None, None, None


def _keep(t: torch.Tensor) -> torch.Tensor:
    """Identity saved-tensor hook: the recompute's inner SDPA graph keeps its own tensors (the
    checkpoint's hooks would count them as the layer's)."""
    return t


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract (``[B, H, q, d]`` -> ``[B, q, H, d]``)."""
    if dropout:
        raise ValueError("exact attention has no dropout (rollout.exact_logprobs)")
    batch, _, q_len, dim = query.shape
    scale = scaling if scaling is not None else 1.0 / math.sqrt(dim)
    start, qoff = row_bounds(attention_mask, batch, q_len, key.shape[2], query.device)
    mask = _bool_mask(attention_mask)
    return _Attention.apply(query, key, value, start, qoff, mask, scale), None


def _bool_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """transformers' SDPA mask as a boolean one (True = attend; an additive mask: 0 = attend)."""
    if mask is None or mask.dtype == torch.bool:
        return mask
    return mask == 0


_REGISTERED = False


def register() -> None:
    """Make ``NAME`` an attention implementation (and its mask the SDPA boolean one)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, attention_forward)
    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

        ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
    except ImportError:  # older transformers build the SDPA mask for any unknown name
        pass
    _REGISTERED = True

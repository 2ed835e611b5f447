"""Token logprobs and entropies from logits, chunked so the float32 copy of a [N, V] logit
matrix (V = 152k for Qwen3-Omni) is never materialised at once.

Both functions upcast one chunk of rows at a time to float32. Token logprobs are one autograd
function (``_TokenLogprobs``): the forward keeps only the (bf16) logits themselves, and the
backward writes ``(onehot - softmax) * grad / T`` chunk by chunk straight into one gradient
buffer in the logits' dtype — no float32 chunk is kept for backward, no per-chunk gradients wait
for a concatenation. Against activation checkpointing of each chunk (the previous form) this
removed ~2 GiB of peak memory from a 4-layer real-width GRPO step (benchmarks/vs_trl.py) at the
same speed. Entropies (only with ``algo.entropy_coef``) keep checkpointed chunks. The exact
forward KL to a reference (``algo.kl_type: full``) is one such function too: its gradient
``(softmax(z) - softmax(z_ref)) / T`` is written chunk by chunk from the two logit matrices.

Chunks are sized in elements (``CHUNK_ELEMENTS`` float32 values, 128 MiB), not rows: the row
count that bounds memory depends on the vocabulary, and a tiny model's whole batch is one chunk.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

DEFAULT_CHUNK_ROWS = 1024  # entropies
CHUNK_ELEMENTS = 1 << 25  # token logprobs: float32 values per chunk


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    return z


def _logprob_chunk(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, exact: bool = False
) -> torch.Tensor:
    if exact:  # rollout.exact_logprobs: the sampler's kernel, one fixed reduction order per row
        from omni_grpo.exact.rowwise import token_logprobs

        return token_logprobs(_scaled(logits, temperature), targets)
    # log_softmax + gather rather than logit - logsumexp: measurably faster on CPU (benchmarks/core_logprobs.py)
    logp = torch.log_softmax(_scaled(logits, temperature), dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def _entropy_chunk(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    z = _scaled(logits, temperature)
    logp = torch.log_softmax(z, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def _chunked(fn, rows: list[torch.Tensor], chunk_rows: int, recompute: bool = True) -> torch.Tensor:  # type: ignore[no-untyped-def]
    grad = recompute and torch.is_grad_enabled() and rows[0].requires_grad
    outs = []
    # torch.split, not slicing: its backward concatenates all chunk gradients in one node, whereas
    # each slice's backward would allocate (and add) a full-size zero gradient per chunk.
    for parts in zip(*(r.split(chunk_rows) for r in rows), strict=True):
        outs.append(checkpoint(fn, *parts, use_reentrant=False) if grad else fn(*parts))
    return torch.cat(outs) if outs else rows[0].new_zeros(0, dtype=torch.float32)


class _TokenLogprobs(torch.autograd.Function):
    """``log_softmax(logits / T)[target]`` over ``[N, V]`` rows, chunked in forward and backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits: torch.Tensor,
        targets: torch.Tensor,
        temperature: float,
        rows: int,
        exact: bool = False,
    ) -> torch.Tensor:
        out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        for start in range(0, logits.shape[0], rows):
            end = start + rows
            out[start:end] = _logprob_chunk(
                logits[start:end], targets[start:end], temperature, exact
            )
        ctx.save_for_backward(logits, targets)
        ctx.temperature, ctx.rows = temperature, rows
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:  # type: ignore[override]
        logits, targets = ctx.saved_tensors
        out = torch.empty_like(logits)
        scale = 1.0 / ctx.temperature
        for start in range(0, logits.shape[0], ctx.rows):
            end = start + ctx.rows
            g = grad[start:end, None].float()
            d = torch.softmax(_scaled(logits[start:end], ctx.temperature), dim=-1).mul_(-g)
            d.scatter_add_(-1, targets[start:end, None], g)
            out[start:end] = d.mul_(scale) if scale != 1.0 else d
        return out, None, None, None, None


class _ForwardKL(torch.autograd.Function):
    """``KL(softmax(ref / T) || softmax(logits / T))`` per row of ``[N, V]``, chunked; the gradient
    flows to ``logits`` only (the reference is a constant)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, logits: torch.Tensor, ref_logits: torch.Tensor, temperature: float, rows: int
    ) -> torch.Tensor:
        out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        for start in range(0, logits.shape[0], rows):
            end = start + rows
            ref = torch.log_softmax(_scaled(ref_logits[start:end], temperature), dim=-1)
            pol = torch.log_softmax(_scaled(logits[start:end], temperature), dim=-1)
            out[start:end] = (ref.exp() * (ref - pol)).sum(-1)
        ctx.save_for_backward(logits, ref_logits)
        ctx.temperature, ctx.rows = temperature, rows
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        logits, ref_logits = ctx.saved_tensors
        out = torch.empty_like(logits)
        scale = 1.0 / ctx.temperature
        for start in range(0, logits.shape[0], ctx.rows):
            end = start + ctx.rows
            g = grad[start:end, None].float() * scale
            d = torch.softmax(_scaled(logits[start:end], ctx.temperature), dim=-1)
            d.sub_(torch.softmax(_scaled(ref_logits[start:end], ctx.temperature), dim=-1))
            out[start:end] = d.mul_(g)
        return out, None, None, None


def forward_kl_from_logits(
    logits: torch.Tensor,
    ref_logits: torch.Tensor,
    temperature: float = 1.0,
    *,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """Exact ``KL(ref || pi)`` (nats, float32) at every position, over the whole vocabulary.

    ``logits [..., V]`` are the policy's (with grad), ``ref_logits`` the reference's at the same
    positions (no grad needed; only ``logits`` receives one). This is what the sampled k3 loss
    estimates (its gradient's expectation under pi is that of ``KL(ref || pi)``), without the
    sampling: k3's per-sample gradient is ``1 - ref/pi`` on the sampled token, unbounded for a
    token pi has made rare — the spike that flips a near-deterministic policy (issue 16) —
    while this gradient, ``softmax(z) - softmax(z_ref)`` per logit, is bounded by 1 and does not
    fade as pi turns deterministic.
    """
    if logits.shape != ref_logits.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and reference logits {tuple(ref_logits.shape)} differ"
        )
    t = temperature if temperature > 0 else 1.0
    v = logits.shape[-1]
    rows = chunk_rows or max(1, CHUNK_ELEMENTS // v)
    flat = _ForwardKL.apply(logits.reshape(-1, v), ref_logits.detach().reshape(-1, v), t, rows)
    return flat.view(logits.shape[:-1])


def token_logprobs_from_logits(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    *,
    chunk_rows: int | None = None,
    recompute: bool = True,
    exact: bool = False,
) -> torch.Tensor:
    """``log softmax(logits / T)[target]`` in float32, shape of ``targets``.

    ``logits [..., V]`` and ``targets [...]`` must already be aligned (logits at position t predict
    token t+1: slice ``logits[:, start-1:end-1]`` against ``ids[:, start:end]``). ``temperature``
    must equal the rollout sampling temperature (T <= 0, i.e. greedy, is treated as 1).
    ``recompute=False`` trades memory for speed: autograd then keeps each chunk's float32
    log-softmax (2x the bf16 logits) instead of recomputing the softmax in backward.
    Pass contiguous logits (e.g. via ``logits_to_keep`` positions, not a slice of a longer
    tensor): a strided view is copied by ``reshape`` and its gradient scattered back.
    ``exact`` (``rollout.exact_logprobs``, CUDA): the forward is the sampler's Triton kernel
    (``omni_grpo.exact.rowwise.token_logprobs``), so the values equal the rollout's bit for bit.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} are not aligned"
        )
    t = temperature if temperature > 0 else 1.0
    v = logits.shape[-1]
    rows = chunk_rows or max(1, CHUNK_ELEMENTS // v)
    flat_logits, flat_targets = logits.reshape(-1, v), targets.reshape(-1).long()
    if recompute or exact:
        flat = _TokenLogprobs.apply(flat_logits, flat_targets, t, rows, exact)
    else:
        flat = _chunked(lambda lg, tg: _logprob_chunk(lg, tg, t), [flat_logits, flat_targets], rows)
    return flat.view(targets.shape)


def entropy_from_logits(
    logits: torch.Tensor,
    temperature: float = 1.0,
    *,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    recompute: bool = True,
) -> torch.Tensor:
    """Entropy (nats) of ``softmax(logits / T)`` per position, float32, shape ``logits.shape[:-1]``."""
    t = temperature if temperature > 0 else 1.0
    v = logits.shape[-1]
    flat = _chunked(
        lambda lg: _entropy_chunk(lg, t), [logits.reshape(-1, v)], chunk_rows, recompute
    )
    return flat.view(logits.shape[:-1])

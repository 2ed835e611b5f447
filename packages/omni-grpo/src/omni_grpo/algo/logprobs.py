"""Token logprobs and entropies from logits, chunked so the float32 copy of a [N, V] logit
matrix (V = 152k for Qwen3-Omni) is never materialised at once.

Both functions upcast one chunk of rows at a time to float32. When gradients are needed the chunk
computation is wrapped in activation checkpointing, so autograd keeps only the (bf16) logits
view instead of a float32 copy per chunk; the backward recomputes the chunk's softmax.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

DEFAULT_CHUNK_ROWS = 1024


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    return z


def _logprob_chunk(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
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


def token_logprobs_from_logits(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    *,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    recompute: bool = True,
) -> torch.Tensor:
    """``log softmax(logits / T)[target]`` in float32, shape of ``targets``.

    ``logits [..., V]`` and ``targets [...]`` must already be aligned (logits at position t predict
    token t+1: slice ``logits[:, start-1:end-1]`` against ``ids[:, start:end]``). ``temperature``
    must equal the rollout sampling temperature (T <= 0, i.e. greedy, is treated as 1).
    ``recompute=False`` trades memory for speed: autograd then keeps each chunk's float32
    log-softmax (2x the bf16 logits) instead of recomputing it in backward
    (benchmarks/core_logprobs.py: half the saved bytes for ~1.5x the CPU time with recompute).
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} are not aligned"
        )
    t = temperature if temperature > 0 else 1.0
    v = logits.shape[-1]
    flat = _chunked(
        lambda lg, tg: _logprob_chunk(lg, tg, t),
        [logits.reshape(-1, v), targets.reshape(-1).long()],
        chunk_rows,
    )
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

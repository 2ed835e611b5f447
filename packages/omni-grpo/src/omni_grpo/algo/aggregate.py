"""Masked reductions of per-token quantities into one scalar (token- or sequence-level).

Masked positions are ZEROED with ``torch.where`` rather than multiplied by the mask, because
``nan * 0 = nan``: a NaN/inf logprob on a padding token must not poison the loss or its gradient.
"""

from __future__ import annotations

import torch


def masked_zero(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` where ``mask`` is set, exactly 0 elsewhere (NaN/inf included)."""
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))


def aggregate(
    x: torch.Tensor,
    mask: torch.Tensor,
    loss_agg: str = "sequence",
    *,
    num_samples: float | None = None,
    num_tokens: float | None = None,
) -> torch.Tensor:
    """Reduce ``x [B, T]`` over the response tokens in ``mask [B, T]``.

    - ``"sequence"``: per-sample token mean ``sum_t x*m / max(sum_t m, 1)``, summed over samples and
      divided by ``num_samples`` (default: this batch's B) — each completion weighs the same.
    - ``"token"``: sum over all tokens divided by ``num_tokens`` (default: this batch's token count)
      — each token weighs the same (long answers weigh more).

    Pass the GLOBAL ``num_samples``/``num_tokens`` of the optimiser step when a step is split into
    micro-batches (gradient accumulation, data parallel): then the micro-batch losses simply add up
    to the full-batch loss.
    """
    m = mask.bool()
    xz = masked_zero(x, m)
    if loss_agg == "sequence":
        per_sample = xz.sum(-1) / m.sum(-1).clamp(min=1).to(xz.dtype)
        denom = float(num_samples) if num_samples is not None else max(per_sample.numel(), 1)
        return per_sample.sum() / denom
    if loss_agg == "token":
        denom = float(num_tokens) if num_tokens is not None else max(int(m.sum()), 1)
        return xz.sum() / denom
    raise ValueError(f"unknown loss_agg {loss_agg!r}; expected 'sequence' or 'token'")


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over masked tokens (0 when the mask is empty)."""
    m = mask.bool()
    return masked_zero(x, m).sum() / m.sum().clamp(min=1).to(x.dtype)

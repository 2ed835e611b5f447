"""Rollout <-> trainer mismatch metrics: how far the engine's logprobs are from the trainer's.

Computed on response tokens only, with no gradient. ``train_logp`` is the trainer's logprob of the
sampled tokens under the SAME weights the engine sampled with (the recompute before the update),
so in a perfect world every metric here is trivial (diff 0, corr 1, ratios 1, kl 0, ess 1).

Nothing here reads a value back to the host (no boolean-mask selection, no Python branch on a
tensor): the trainer computes them between a micro-batch's forward and its backward, where a
host read would leave the GPU idle until the host had queued the backward.
"""

from __future__ import annotations

import torch

from omni_grpo.algo.kl import kl_estimate

MISMATCH_KEYS: tuple[str, ...] = (
    "train_rollout_logprob_abs_diff",
    "train_rollout_logprob_exact_fraction",
    "train_rollout_logprob_pearson",
    "train_rollout_kl",
    "train_rollout_ratio_p5",
    "train_rollout_ratio_p50",
    "train_rollout_ratio_p95",
    "ess_ratio",
)


@torch.no_grad()
def mismatch_metrics(
    train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """0-dim tensors keyed by metric name (see trainer_facts §5):

    ``train_rollout_logprob_abs_diff`` mean |train - rollout|; ``train_rollout_logprob_exact_fraction``
    the share of tokens whose two fp32 logprobs are bitwise equal (1 only when the rollout's and
    the trainer's forwards compute the same numbers); ``train_rollout_logprob_pearson``;
    ``train_rollout_kl`` low_var_kl estimate of KL(rollout || train) from the rollout's samples;
    ``train_rollout_ratio_p5/p50/p95`` quantiles of exp(train - rollout); ``ess_ratio``
    (sum w)^2 / (n sum w^2) of those ratios (1 = no mismatch).
    """
    m = mask.bool()
    if m.numel() == 0:  # no positions at all (a known shape: no read of the device)
        return {k: torch.full((), float("nan"), device=train_logp.device) for k in MISMATCH_KEYS}
    t = torch.where(m, train_logp.detach().float(), 0.0)
    r = torch.where(m, rollout_logp.detach().float(), 0.0)
    count = m.sum()
    n = count.clamp(min=1).float()
    nan = torch.full((), float("nan"), device=t.device)

    def mean(x: torch.Tensor) -> torch.Tensor:
        return torch.where(m, x, 0.0).sum() / n

    w = torch.where(m, torch.exp(t - r), 0.0)
    # Pearson over the masked tokens: centred by their means, nothing else contributing
    a, b = torch.where(m, t - mean(t), 0.0), torch.where(m, r - mean(r), 0.0)
    denom = a.norm() * b.norm()
    pearson = torch.where((count >= 2) & (denom > 0), (a * b).sum() / denom, nan)
    out = {
        "train_rollout_logprob_abs_diff": mean((t - r).abs()),
        # a count over a count, not ``.float().mean()``: CUDA's mean multiplies by 1/n, which
        # rounds an all-equal batch to 0.99999994 and a step of them to 0.999999985
        "train_rollout_logprob_exact_fraction": ((t == r) & m).sum().double() / n.double(),
        "train_rollout_logprob_pearson": pearson,
        "train_rollout_kl": mean(kl_estimate(r, t, "low_var_kl")),
        **dict(zip(QUANTILE_KEYS, _masked_quantiles(w, m, count, QUANTILES), strict=True)),
        "ess_ratio": w.sum() ** 2 / (n * (w * w).sum()),
    }
    empty = count == 0
    return {k: torch.where(empty, nan.to(v.dtype), v) for k, v in out.items()}


QUANTILES = (0.05, 0.5, 0.95)
QUANTILE_KEYS = ("train_rollout_ratio_p5", "train_rollout_ratio_p50", "train_rollout_ratio_p95")


def _masked_quantiles(
    x: torch.Tensor, m: torch.Tensor, count: torch.Tensor, qs: tuple[float, ...]
) -> list[torch.Tensor]:
    """``torch.quantile``'s linear interpolation over the masked values of ``x``, with no host
    read of how many there are (the masked-out sort last as +inf; NaN among them gives NaN)."""
    ordered = torch.sort(torch.where(m, x, float("inf")).reshape(-1)).values
    last = (count - 1).clamp(min=0)
    out = []
    for q in qs:
        pos = q * last.double()
        lo, hi = pos.floor().long(), pos.ceil().long()
        # index_select with a device index: ``ordered[lo]`` would read ``lo`` back to the host
        v_lo = ordered.index_select(0, lo.reshape(1)).reshape(())
        v_hi = ordered.index_select(0, hi.reshape(1)).reshape(())
        out.append(v_lo + (pos - lo).to(x.dtype) * (v_hi - v_lo))
    has_nan = (torch.isnan(x) & m).any()
    return [torch.where(has_nan, torch.full_like(v, float("nan")), v) for v in out]

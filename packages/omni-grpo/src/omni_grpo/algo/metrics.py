"""Rollout <-> trainer mismatch metrics: how far the engine's logprobs are from the trainer's.

Computed on response tokens only, with no gradient. ``train_logp`` is the trainer's logprob of the
sampled tokens under the SAME weights the engine sampled with (the recompute before the update),
so in a perfect world every metric here is trivial (diff 0, corr 1, ratios 1, kl 0, ess 1).
"""

from __future__ import annotations

import torch

from omni_grpo.algo.kl import kl_estimate


def _pearson(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.numel() < 2:
        return torch.tensor(float("nan"))
    a = a - a.mean()
    b = b - b.mean()
    denom = a.norm() * b.norm()
    return (a * b).sum() / denom if denom > 0 else torch.tensor(float("nan"))


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
    t = train_logp.detach().float()[m]
    r = rollout_logp.detach().float()[m]
    if t.numel() == 0:
        nan = torch.tensor(float("nan"))
        return dict.fromkeys(MISMATCH_KEYS, nan)
    w = torch.exp(t - r)
    q = torch.quantile(w, torch.tensor([0.05, 0.5, 0.95], dtype=w.dtype, device=w.device))
    return {
        "train_rollout_logprob_abs_diff": (t - r).abs().mean(),
        # a count over a count, not ``.float().mean()``: CUDA's mean multiplies by 1/n, which
        # rounds an all-equal batch to 0.99999994 and a step of them to 0.999999985
        "train_rollout_logprob_exact_fraction": (t == r).sum().double() / t.numel(),
        "train_rollout_logprob_pearson": _pearson(t, r),
        "train_rollout_kl": kl_estimate(r, t, "low_var_kl").mean(),
        "train_rollout_ratio_p5": q[0],
        "train_rollout_ratio_p50": q[1],
        "train_rollout_ratio_p95": q[2],
        "ess_ratio": w.sum() ** 2 / (w.numel() * (w * w).sum()),
    }

"""Per-token KL estimators between the policy and a reference (Schulman's k1/k2/k3)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def _k1(d: torch.Tensor) -> torch.Tensor:
    return d


def _k2(d: torch.Tensor) -> torch.Tensor:
    return 0.5 * d * d


def _k3(d: torch.Tensor) -> torch.Tensor:
    return torch.expm1(-d) + d  # exp(-d) - 1 + d, accurate near d = 0


def _low_var_kl(d: torch.Tensor) -> torch.Tensor:
    return _k3(d).clamp(-10.0, 10.0)


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "k1": _k1,
    "k2": _k2,
    "k3": _k3,
    "low_var_kl": _low_var_kl,
}


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kl_type: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from samples of pi, with ``d = logp - ref_logp``.

    k1 = d (unbiased, high variance, can be negative); k2 = d^2/2; k3 = exp(-d) - 1 + d (unbiased,
    non-negative); low_var_kl = k3 clamped to [-10, 10] for stability.
    """
    try:
        fn = KL_ESTIMATORS[kl_type]
    except KeyError:
        raise ValueError(
            f"unknown kl_type {kl_type!r}; expected one of {sorted(KL_ESTIMATORS)}"
        ) from None
    return fn(logp - ref_logp)

"""GRPO math as plain torch functions, shared by the torch and Megatron backends."""

from omni_grpo.algo.advantages import group_advantages
from omni_grpo.algo.aggregate import aggregate, masked_mean, masked_zero
from omni_grpo.algo.kl import KL_ESTIMATORS, kl_estimate
from omni_grpo.algo.logprobs import (
    entropy_from_logits,
    forward_kl_from_logits,
    token_logprobs_from_logits,
)
from omni_grpo.algo.loss import (
    clipped_surrogate,
    grpo_loss,
    grpo_loss_terms,
    read_metrics,
    tis_weights,
)
from omni_grpo.algo.metrics import MISMATCH_KEYS, mismatch_metrics

__all__ = [
    "KL_ESTIMATORS",
    "MISMATCH_KEYS",
    "aggregate",
    "clipped_surrogate",
    "entropy_from_logits",
    "forward_kl_from_logits",
    "grpo_loss",
    "grpo_loss_terms",
    "group_advantages",
    "kl_estimate",
    "masked_mean",
    "masked_zero",
    "mismatch_metrics",
    "read_metrics",
    "tis_weights",
    "token_logprobs_from_logits",
]

"""The GRPO/PPO policy loss shared by the torch and Megatron backends (trainer_facts §5).

All inputs are per-token ``[B, T]`` tensors over the same positions (one row per completion, the
response tokens selected by ``mask``). Only ``logp`` carries gradient; the other logprobs and the
advantages are treated as constants.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from omni_grpo.algo.aggregate import aggregate, masked_mean, masked_zero
from omni_grpo.algo.kl import kl_estimate
from omni_grpo.algo.metrics import mismatch_metrics

if TYPE_CHECKING:
    from omni_grpo.config import AlgoConfig, TISConfig


def clipped_surrogate(
    ratio: torch.Tensor,
    adv: torch.Tensor,
    eps_low: float,
    eps_high: float,
    dual_clip_c: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token PPO loss ``max(-r*A, -clip(r, 1-eps_low, 1+eps_high)*A)`` (clip-higher when
    ``eps_high > eps_low``), optionally dual-clipped: for ``A < 0`` the loss is capped at ``-c*A``
    so a huge ratio on a bad token cannot blow up the update.

    Returns ``(pg, clipped, dual_clipped)``; the last two are boolean token masks for metrics.
    """
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    pg = torch.maximum(pg1, pg2)
    clipped = pg2 > pg1
    dual = torch.zeros_like(clipped)
    if dual_clip_c is not None:
        pg3 = -adv * dual_clip_c
        dual = (adv < 0) & (pg3 < pg)
        pg = torch.where(dual, pg3, pg)
    return pg, clipped, dual


def tis_weights(
    old_logp: torch.Tensor, rollout_logp: torch.Tensor, tis: TISConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Importance weights of the trainer's behaviour logprobs against the engine's: raw
    ``exp(old - rollout)``; ``truncate`` clamps into ``[clip_low, clip_high]``, ``icepop`` zeroes
    tokens whose raw weight leaves that interval. Returns ``(w, raw)``, both without gradient."""
    raw = torch.exp(old_logp.detach() - rollout_logp.detach())
    if tis.mode == "truncate":
        w = raw.clamp(tis.clip_low, tis.clip_high)
    elif tis.mode == "icepop":
        keep = (raw >= tis.clip_low) & (raw <= tis.clip_high)
        w = torch.where(keep, raw, torch.zeros_like(raw))
    else:
        raise ValueError(f"unknown tis.mode {tis.mode!r}")
    return w, raw


def grpo_loss(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, dict[str, float]]:
    """:func:`grpo_loss_terms` (same arguments) with its metrics read to plain floats (one
    device sync): for callers with nothing to queue behind the read."""
    loss, metrics = grpo_loss_terms(*args, **kwargs)
    return loss, read_metrics(metrics)


def read_metrics(metrics: Mapping[Any, torch.Tensor]) -> dict[Any, float]:
    """0-dim metric tensors as floats, in one host read (keys kept)."""
    names = list(metrics)
    values = torch.stack([metrics[k] for k in names]).tolist() if names else []
    return dict(zip(names, values, strict=True))


def grpo_loss_terms(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: AlgoConfig,
    ref_logp: torch.Tensor | None = None,
    rollout_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    kl: torch.Tensor | None = None,
    *,
    num_samples: float | None = None,
    num_tokens: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``loss = pg_loss - entropy_coef * entropy + kl_coef * kl`` and the step metrics.

    - ``logp [B, T]``: current policy logprobs of the sampled tokens (with grad).
    - ``old_logp``: behaviour logprobs (trainer recompute before the update); ignored and replaced by
      ``rollout_logp`` when ``cfg.use_rollout_logprobs``.
    - ``advantages``: ``[B]`` (broadcast over tokens) or ``[B, T]``.
    - ``mask``: response tokens; masked positions are zeroed everywhere, NaN/inf included.
    - ``ref_logp``: needed when ``cfg.kl_coef > 0`` (also reported as ``kl_loss`` when given),
      except with ``kl_type: full``, which takes ``kl`` instead.
    - ``rollout_logp``: engine logprobs; enables TIS (``cfg.tis.enabled``) and the mismatch metrics.
    - ``entropy [B, T]``: per-token entropy (``entropy_from_logits``); needed when ``entropy_coef > 0``.
    - ``kl [B, T]``: per-token exact KL (``forward_kl_from_logits``, with grad) for ``kl_type: full``:
      it needs both models' logits over the vocabulary, which only the backend holds.
    - ``num_samples`` / ``num_tokens``: global normalisers for micro-batching (see ``aggregate``).

    Metrics are 0-dim float32 tensors on ``logp``'s device, nothing read back to the host (a
    backend may queue the backward first and read them at the step's end: ``algo.step.
    DeferredMetrics``); means over this call's response tokens/samples."""
    m = mask.bool()
    if logp.shape != m.shape:
        raise ValueError(f"logp {tuple(logp.shape)} and mask {tuple(m.shape)} differ")
    if cfg.use_rollout_logprobs:
        if rollout_logp is None:
            raise ValueError("algo.use_rollout_logprobs is set but no rollout_logp was given")
        old_logp = rollout_logp
    if old_logp is None:
        raise ValueError(
            "old_logp is required (or set algo.use_rollout_logprobs with rollout_logp)"
        )
    agg = dict(loss_agg=cfg.loss_agg, num_samples=num_samples, num_tokens=num_tokens)

    logp = masked_zero(logp.float(), m)  # all loss math in float32, whatever the model dtype
    old = masked_zero(old_logp.detach().to(logp.dtype), m)
    adv = advantages.detach().to(logp.dtype)
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1).expand_as(logp)
    adv = masked_zero(adv, m)

    log_ratio = logp - old
    ratio = torch.exp(log_ratio)
    pg, clipped, dual = clipped_surrogate(
        ratio, adv, cfg.clip_eps_low, cfg.clip_eps_high, cfg.dual_clip_c
    )

    metrics: dict[str, torch.Tensor] = {}
    if cfg.tis.enabled:
        if rollout_logp is None:
            raise ValueError("algo.tis.enabled needs rollout_logp")
        w, raw = tis_weights(old, masked_zero(rollout_logp.to(logp.dtype), m), cfg.tis)
        pg = pg * w
        metrics["tis"] = masked_mean(w, m)
        metrics["tis_clipfrac"] = masked_mean((w != raw).to(logp.dtype), m)
        metrics["tis_abs"] = masked_mean((raw - 1.0).abs(), m)

    pg_loss = aggregate(pg, m, **agg)
    loss = pg_loss
    metrics["pg_loss"] = pg_loss.detach()
    metrics["pg_clipfrac"] = masked_mean(clipped.to(logp.dtype), m)
    if cfg.dual_clip_c is not None:
        metrics["pg_dual_clipfrac"] = masked_mean(dual.to(logp.dtype), m)
    metrics["ppo_kl"] = masked_mean(-log_ratio.detach(), m)
    metrics["ois"] = masked_mean(ratio.detach(), m)

    if cfg.entropy_coef != 0 and entropy is None:
        raise ValueError("algo.entropy_coef > 0 needs per-token entropy (entropy_from_logits)")
    if entropy is not None:
        entropy_loss = aggregate(entropy, m, **agg)
        metrics["entropy_loss"] = entropy_loss.detach()
        if cfg.entropy_coef != 0:
            loss = loss - cfg.entropy_coef * entropy_loss

    if cfg.kl_type == "full":
        if cfg.kl_coef != 0 and kl is None:
            raise ValueError("algo.kl_type full needs the per-token kl (forward_kl_from_logits)")
        kl_tokens = masked_zero(kl.float(), m) if kl is not None else None
    else:
        if cfg.kl_coef != 0 and ref_logp is None:
            raise ValueError("algo.kl_coef > 0 needs ref_logp from the reference model")
        kl_tokens = None
        if ref_logp is not None:
            ref = masked_zero(ref_logp.detach().to(logp.dtype), m)
            kl_tokens = kl_estimate(logp, ref, cfg.kl_type)
            if cfg.kl_unbiased:
                kl_tokens = kl_tokens * ratio
    if kl_tokens is not None:
        kl_loss = aggregate(kl_tokens, m, **agg)
        metrics["kl_loss"] = kl_loss.detach()
        if cfg.kl_coef != 0:
            loss = loss + cfg.kl_coef * kl_loss

    if rollout_logp is not None and not cfg.use_rollout_logprobs:
        metrics.update(mismatch_metrics(old, rollout_logp, m))

    metrics["loss"] = loss.detach()
    metrics["response_tokens"] = m.sum().to(logp.dtype)
    return loss, {k: v.detach().float().reshape(()).to(logp.device) for k, v in metrics.items()}

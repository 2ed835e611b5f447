"""``algo:``: the GRPO objective: advantages, clipping, KL, entropy, importance sampling."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from omni_grpo.config.base import StrictModel


class AdvantageConfig(StrictModel):
    std_normalize: bool = Field(True, description="False = Dr.GRPO (mean-centred only)")
    eps: float = Field(1e-6, gt=0)


class TISConfig(StrictModel):
    """Truncated importance sampling of the trainer's old logprobs against the rollout engine's."""

    enabled: bool = False
    clip_low: float = Field(0.0, ge=0)
    clip_high: float = Field(2.0, gt=0)
    mode: Literal["truncate", "icepop"] = "truncate"

    @model_validator(mode="after")
    def _ordered(self) -> TISConfig:
        if self.clip_low >= self.clip_high:
            raise ValueError(f"clip_low ({self.clip_low}) must be < clip_high ({self.clip_high})")
        return self


class AlgoConfig(StrictModel):
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    clip_eps_low: float = Field(0.2, ge=0, lt=1)
    clip_eps_high: float = Field(0.28, ge=0)
    dual_clip_c: float | None = Field(
        None, gt=1, description="dual-clip constant c > 1; None disables"
    )
    kl_coef: float = Field(0.0, ge=0)
    kl_type: Literal["k1", "k2", "k3", "low_var_kl", "full"] = Field(
        "k1",
        description="k1/k2/k3/low_var_kl: estimators on the sampled tokens; full: the exact "
        "KL(ref || pi) over the vocabulary at each response position (the expectation of k3's "
        "gradient without its sampling variance; torch backend)",
    )
    kl_unbiased: bool = Field(
        False, description="multiply the KL term by the importance ratio exp(logp-old)"
    )
    entropy_coef: float = Field(0.0, ge=0)
    tis: TISConfig = Field(default_factory=TISConfig)
    loss_agg: Literal["token", "sequence"] = Field(
        "sequence",
        description="sequence: per-sample token mean, averaged over samples; token: global token mean",
    )
    use_rollout_logprobs: bool = Field(
        False, description="use rollout logprobs as old_logp (no trainer recompute)"
    )

    @model_validator(mode="after")
    def _exclusive(self) -> AlgoConfig:
        if self.use_rollout_logprobs and self.tis.enabled:
            raise ValueError(
                "use_rollout_logprobs and tis.enabled are mutually exclusive (TIS would be identically 1)"
            )
        if self.kl_unbiased and self.kl_type == "full":
            raise ValueError(
                "algo.kl_unbiased does not apply to kl_type full (an exact KL, not a sample estimate)"
            )
        return self

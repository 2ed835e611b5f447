"""``eval:``: the held-out greedy evaluation, and the modality ablations it also runs."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from omni_grpo.config.base import StrictModel

AblationName = Literal["audio", "image", "video", "all"]


class EvalConfig(StrictModel):
    """Held-out greedy evaluation, always reported per modality and overall."""

    every: int = Field(10, ge=0, description="0 disables periodic evaluation (the final one stays)")
    max_samples: int | None = Field(None, ge=1)
    ablations: list[AblationName] = Field(
        default_factory=list,
        description="also evaluate with this modality's media replaced by a neutral input of the "
        "same shape (silence, mid-grey frames): eval/ablated/<modality>/accuracy/*",
    )

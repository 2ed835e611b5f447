"""``rewards:``: which reward scores a row that does not name its own."""

from __future__ import annotations

from pydantic import Field

from omni_grpo.config.base import StrictModel


class RewardsConfig(StrictModel):
    """Which reward (entry-point name in ``omni_grpo.rewards``) scores rows that do not name one."""

    default: str = "mcq"
    by_modality: dict[str, str] = Field(
        default_factory=dict, description="e.g. {'video': 'answer_tag'}"
    )

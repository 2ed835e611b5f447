"""``run:``: where a run writes, how long it lasts, what it logs."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from omni_grpo.config.base import PathField, StrictModel


class RunConfig(StrictModel):
    dir: PathField = Path("runs/default")
    seed: int = 0
    steps: int = Field(100, ge=0)
    save_every: int = Field(50, ge=0, description="0 saves only at the end")
    log_every: int = Field(1, ge=1)
    tensorboard: bool = True
    wandb: bool = False
    plots: bool = True
    collapse_warn_steps: int = Field(
        20,
        ge=0,
        description="warn when a modality has had no group with reward variance (no GRPO signal) "
        "while unsolved for this many consecutive steps; 0 disables",
    )

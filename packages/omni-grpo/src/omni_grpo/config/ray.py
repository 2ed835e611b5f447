"""``ray:``: how the driver joins Ray when a run spans several processes."""

from __future__ import annotations

from pydantic import Field

from omni_grpo.config.base import StrictModel


class RayConfig(StrictModel):
    """How the driver joins Ray when the run spans several processes (``omni_grpo.ray``)."""

    address: str | None = Field(
        None, description="cluster address; None = $RAY_ADDRESS, else a local Ray on this machine"
    )
    # A whole number: Ray hands it to the raylet as an int32 flag, and a float (YAML's `8` read
    # as 8.0 by a float field) made the raylet exit at once, 30 s before ray.init said only
    # "node timed out during startup" (seen on the H200 box). Actors take fractions below.
    num_cpus: int | None = Field(None, gt=0, description="local Ray only; None = all cores")
    cpus_per_trainer: float = Field(
        1.0, gt=0, description="fractions let several actors share a small machine"
    )
    gpus_per_trainer: float = Field(
        1.0,
        gt=0,
        le=1,
        description="GPU ranks: a fraction lets the ranks (and rollout actors) share one GPU; "
        "ranks sharing a GPU reduce over gloo (NCCL refuses two ranks of one group on one device)",
    )
    gpus_per_node: int = Field(8, ge=1, description="for planning: where TP groups may go")
    start_timeout_s: float = Field(300.0, gt=0, description="placement and actor start-up")

"""Ray placement for the Megatron trainer, disaggregated from external sglang-omni rollout servers.

:mod:`.placement` is pure planning (testable without Ray): trainer ranks -> GPU bundles and their
Megatron coordinates, and the external servers' place in the weight-sync group. Only
:func:`.placement.create_placement_group` / :func:`.placement.actor_options` import ``ray``
(the optional ``ray`` extra).
"""

from omni_grpo.ray.placement import (
    PlacementError,
    PlacementPlan,
    ServerAttachment,
    TrainerRank,
    plan_placement,
    rank_env,
)

__all__ = [
    "PlacementError",
    "PlacementPlan",
    "ServerAttachment",
    "TrainerRank",
    "plan_placement",
    "rank_env",
]

"""One run across many processes, on Ray.

* :mod:`.placement` — pure planning (testable without Ray): trainer ranks -> bundles with their
  TP/EP/DP coordinates, rollout slots (launched or external servers, embedded rollout actors) and
  their weight-sync rank offsets, refusals naming the field; ``omni-grpo train --plan`` prints it.
* :mod:`.driver` — what ``omni-grpo train`` does when the plan spans several processes: joins or
  starts Ray, starts the actors, and hands the loop stand-ins for the backend, the engine and the
  weight sync (``RayTrainerGroup``, ``RayRolloutEngine``, ``ActorWeightSync``/``TrainerSideSync``).
* :mod:`.actors` — the actor classes (trainer rank, rollout worker, server owner), plain classes
  wrapped with ``ray.remote`` by the driver.
* :mod:`.rollout` — the embedded engine over rollout actors and the broadcast that refreshes them.

Only the driver and the actors import ``ray`` (the optional ``ray`` extra); a one-process run
never does.
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

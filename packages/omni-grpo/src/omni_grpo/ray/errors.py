"""The run's error for a failed actor, in its own module: the driver raises it and the stand-ins
it hands the loop (``rollout.ActorWeightSync``) catch it, so neither imports the other."""

from __future__ import annotations


class ActorFailure(RuntimeError):
    """An actor of the run died or raised; the message names it and quotes its log."""

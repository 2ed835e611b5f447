"""Partial rollouts continued across calls against the same samples decoded in one call.

The CPU test (``tests/test_partial_rollouts.py``) and the GPU bitwise test
(``test_exact_gpu.py``) check the same property at their own tolerance: three groups whose
first one ends early, decoded once in two calls (stopped after group 0, continued) and once in
one call.
"""

from __future__ import annotations

from typing import Any

from omni_grpo.rollout.in_flight import GroupInFlight, SampleInFlight

# per group, each sample's length: group 0 ends first, groups 1 and 2 run on
LIMITS = [[2, 3, 4, 5], [38, 3, 3, 3], [34, 2, 2, 2]]


def continued_and_one_go(
    engine: Any, prompts: list[Any], sampling: Any
) -> list[tuple[SampleInFlight, SampleInFlight]]:
    """``(continued, one_go)`` pairs of the same samples (same noise keys and limits); the first
    call of the continued set must stop with group 0 done and group 1 mid-sample."""

    def groups() -> list[GroupInFlight]:
        return [
            GroupInFlight(p, [SampleInFlight(key=10 * g + j, limit=n) for j, n in enumerate(ls)])
            for g, (p, ls) in enumerate(zip(prompts[: len(LIMITS)], LIMITS, strict=True))
        ]

    split, once = groups(), groups()
    engine.continue_groups(split, 1, sampling)
    if not (split[0].done and not split[1].done and split[1].samples[0].token_ids):
        raise AssertionError("the first call did not stop after group 0 with group 1 running")
    engine.continue_groups(split, 3, sampling)
    engine.continue_groups(once, 3, sampling)
    return [
        (x, y)
        for a, b in zip(split, once, strict=True)
        for x, y in zip(a.samples, b.samples, strict=True)
    ]

"""Is a modality still learning? Per-modality GRPO signal watch.

GRPO learns only from groups whose rewards differ. A modality whose policy has become
deterministic and wrong produces groups that are all-wrong (or, for a policy that answers one
letter to everything, all-right and all-wrong by class) — zero variance, zero advantage, zero
gradient — and it never recovers on its own, while the other modalities keep the mean reward
looking healthy (issue 16: video went 1.0 -> 0.5 at step ~99 and stayed there with
``signal/video`` = 0 for 100 steps). The watch counts, per modality, the consecutive steps with
no signal while the modality is NOT solved (a solved task also has zero variance: every sample
right), records that count as ``no_signal_steps/<modality>`` and warns once when it reaches K.

The count is a pure function of the logged metrics, so a resumed run rebuilds it from
``metrics.jsonl`` (``replay``) and writes the same lines as an uninterrupted one.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

log = logging.getLogger(__name__)

SIGNAL_PREFIX = "signal/"
REWARD_PREFIX = "reward/"
COUNT_PREFIX = "no_signal_steps/"
SOLVED = 1.0 - 1e-9  # mean reward at or above this: every sample right, zero variance is success


class SignalWatch:
    """``watch.update(step, metrics)`` -> ``{no_signal_steps/<m>: n}``; warns when n reaches K."""

    def __init__(self, warn_after: int) -> None:
        self.warn_after = warn_after
        self.count: dict[str, int] = {}
        self.warned: set[str] = set()

    def _advance(self, metrics: dict[str, Any]) -> list[tuple[str, int, float]]:
        reached = []
        for key, signal in metrics.items():
            if not key.startswith(SIGNAL_PREFIX) or signal is None:
                continue
            modality = key[len(SIGNAL_PREFIX) :]
            reward = metrics.get(REWARD_PREFIX + modality)
            if signal > 0 or reward is None or reward >= SOLVED:
                self.count[modality] = 0
                self.warned.discard(modality)
                continue
            self.count[modality] = self.count.get(modality, 0) + 1
            if (
                self.warn_after
                and self.count[modality] >= self.warn_after
                and modality not in self.warned
            ):
                self.warned.add(modality)
                reached.append((modality, self.count[modality], float(reward)))
        return reached

    def update(self, step: int, metrics: dict[str, Any]) -> dict[str, float]:
        for modality, n, reward in self._advance(metrics):
            log.warning(
                "step %d: modality %r has had no group with reward variance for %d steps "
                "(reward %.2f, not solved): GRPO gets no signal from it and it will not recover "
                "on its own (policy collapsed: see entropy/%s)",
                step,
                modality,
                n,
                reward,
                modality,
            )
        return {COUNT_PREFIX + m: float(n) for m, n in sorted(self.count.items())}

    def replay(self, records: Iterable[dict[str, Any]]) -> None:
        """Rebuild the counts from earlier ``metrics.jsonl`` records (resume), without warning
        again for a collapse that was already reported."""
        for record in records:
            self._advance(record)

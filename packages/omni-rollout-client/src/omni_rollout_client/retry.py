"""Bounded retries with exponential backoff and jitter."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class RetryPolicy:
    """``max_attempts`` counts the first try. Delay before retry k (1-based) is drawn uniformly
    from ``[0.5, 1.0] * min(max_delay_s, base_delay_s * 2**(k-1))`` so a burst of failing
    requests does not come back in lockstep."""

    max_attempts: int = 5
    base_delay_s: float = 0.25
    max_delay_s: float = 8.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts: expected >= 1, got {self.max_attempts}")
        if self.base_delay_s < 0 or self.max_delay_s < 0:
            raise ValueError("retry delays must be >= 0")

    def delay(self, retry_number: int, rng: random.Random | None = None) -> float:
        ceiling = min(self.max_delay_s, self.base_delay_s * (2 ** (retry_number - 1)))
        return ceiling * (0.5 + 0.5 * (rng or random).random())

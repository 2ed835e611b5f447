"""The state of partial rollouts between calls: each sample's tokens so far, and its group.

Below both the embedded engine (which continues the samples) and ``rollout.partial`` (which
decides which groups a step takes), so that neither imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from omni_grpo.types import PromptInputs


@dataclass
class SampleInFlight:
    """One sample: its noise key, its tokens so far and the call that drew each one."""

    key: int
    limit: int | None = None  # a planned length (benchmarks), else max_new_tokens
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    drawn_in: list[int] = field(default_factory=list)  # the call index of each token
    reason: str | None = None  # stop | length once ended; None while it runs
    call: int = 0  # the current call's index (set by the pool before each call)

    def advance(self, tokens: list[int], logprobs: list[float], reason: str) -> None:
        """The engine's result for this sample: its tokens so far (earlier ones first)."""
        new = len(tokens) - len(self.token_ids)
        self.drawn_in += [self.call] * new
        self.token_ids, self.logprobs = list(tokens), list(logprobs)
        self.reason = None if reason == "partial" else reason


@dataclass
class GroupInFlight:
    """A prompt's ``n`` samples, some of which may still run."""

    prompt: PromptInputs
    samples: list[SampleInFlight]

    @property
    def done(self) -> bool:
        return all(s.reason is not None for s in self.samples)

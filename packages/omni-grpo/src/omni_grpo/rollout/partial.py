"""Partial rollouts: more groups in flight than a step trains; the unfinished continue next step.

Why: a GRPO step cannot end before its longest sample, and with long-tailed lengths that sample
decodes almost alone for most of the step (measured on one H200: continuous batching over one
step's 64 samples gave only 1.26x the static decoder). Over-provisioning (APRIL, arXiv
2509.18521) keeps ``extra_groups`` more groups running: a step takes the first
``len(prompts)`` groups whose every sample has ended, and the others keep their tokens and
continue in the next step's call, first.

What that costs: a continued sample's earlier tokens were drawn by an earlier policy. Each
sample records the call that drew each of its tokens; a completion reports how many of its
tokens are ``stale`` (drawn before the call that finished its group), which a trainer must treat
as off-policy (TIS) and leave out of the exact-logprob check. The noise of every draw is keyed
on the sample and the token index (``models.continuous``), so a sample continued with unchanged
weights is the sample that would have been drawn in one go.

Wraps an :class:`~omni_grpo.rollout.embedded.EmbeddedEngine` with continuous batching;
``omni-grpo train`` uses it with ``rollout.embedded.extra_groups`` (``loop.rollout_batches``),
the benchmark with ``one_gpu_thinker.py --extra-groups``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from omni_grpo.rollout.in_flight import GroupInFlight, SampleInFlight
from omni_grpo.types import Completion

if TYPE_CHECKING:
    from omni_grpo.rollout.embedded import EmbeddedEngine
    from omni_grpo.types import PromptInputs, SamplingParams

__all__ = ["GroupInFlight", "PartialRollouts", "SampleInFlight"]


class PartialRollouts:
    """A ``RolloutEngine``: ``generate(prompts, n, sampling)`` returns ``len(prompts)`` ended
    groups, the oldest first, while ``extra_groups`` more stay in flight (topped up by
    ``top_up(k)``, which draws ``k`` more prompts from the data stream)."""

    def __init__(
        self,
        engine: EmbeddedEngine,
        extra_groups: int,
        top_up: Callable[[int], list[PromptInputs]],
    ) -> None:
        if engine.batching != "continuous":
            raise ValueError("partial rollouts need the embedded engine's continuous batching")
        if extra_groups < 0:
            raise ValueError(f"extra_groups must be >= 0, got {extra_groups}")
        self.engine, self.extra_groups, self.top_up = engine, extra_groups, top_up
        self.carry: list[GroupInFlight] = []
        self.calls = 0
        self._next_key = int(torch.randint(0, 2**30, (1,)))  # the global RNG: resumable
        self.last_stats: dict[str, float] = {}
        # per row the last call decoded: (prompt + earlier tokens, tokens drawn in the call),
        # what a roofline of the call counts (its rows' KV and the steps they stay live)
        self.last_rows: list[tuple[int, int]] = []
        self.last_prefill: list[int] = []  # the lengths the call prefilled (shared per prompt)

    def _group(self, prompt: PromptInputs, n: int) -> GroupInFlight:
        limits: list[int | None] = [None] * n
        if self.engine.length_plan is not None:
            limits = list(self.engine.length_plan([prompt], n))
        samples = []
        for limit in limits:
            samples.append(SampleInFlight(key=self._next_key % (2**31), limit=limit))
            self._next_key += 1
        return GroupInFlight(prompt, samples)

    def generate(
        self, prompts: list[PromptInputs], n: int, sampling: SamplingParams
    ) -> list[list[Completion]]:
        extra = max(0, self.extra_groups - len(self.carry))
        fresh = [self._group(p, n) for p in prompts + (self.top_up(extra) if extra else [])]
        groups = self.carry + fresh
        self.calls += 1
        for g in groups:
            for s in g.samples:
                s.call = self.calls
        running = [(g, s) for g in groups for s in g.samples if s.reason is None]
        starts = [len(s.token_ids) for _, s in running]
        self.engine.continue_groups(groups, len(prompts), sampling)
        self._record_rows(running, starts)
        taken = [g for g in groups if g.done][: len(prompts)]
        chosen = {id(g) for g in taken}
        self.carry = [g for g in groups if id(g) not in chosen]
        out = [[self._completion(g.prompt, s) for s in g.samples] for g in taken]
        tokens = [c for group in out for c in group]
        self.last_stats = {
            "generated_tokens": sum(drawn for _, drawn in self.last_rows),
            "trained_tokens": sum(len(c.token_ids) for c in tokens),
            "stale_token_frac": sum(c.stale_tokens for c in tokens)
            / max(1, sum(len(c.token_ids) for c in tokens)),
            "resumed_sample_frac": sum(c.stale_tokens > 0 for c in tokens) / max(1, len(tokens)),
            "groups_in_flight": float(len(self.carry)),
        }
        return out

    def _record_rows(
        self, running: list[tuple[GroupInFlight, SampleInFlight]], starts: list[int]
    ) -> None:
        """What the last call decoded and prefilled: a fresh group's samples share one prefill
        of its prompt; a resumed sample re-prefills its prompt and its earlier tokens."""
        pairs = list(zip(running, starts, strict=True))
        self.last_rows = [
            (len(g.prompt.input_ids) + n0, len(s.token_ids) - n0) for (g, s), n0 in pairs
        ]
        shared = {id(g): len(g.prompt.input_ids) for (g, _), n0 in pairs if not n0}
        resumed = [len(g.prompt.input_ids) + n0 for (g, _), n0 in pairs if n0]
        self.last_prefill = list(shared.values()) + resumed

    def _completion(self, prompt: PromptInputs, sample: SampleInFlight) -> Completion:
        done = self.engine.completion(prompt, sample.token_ids, sample.logprobs, sample.reason)
        done.stale_tokens = sum(c < self.calls for c in sample.drawn_in)
        return done

    def close(self) -> None:
        self.engine.close()

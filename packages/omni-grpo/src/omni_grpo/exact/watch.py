"""The warning of ``rollout.exact_logprobs``: where the rollout's and the trainer's logprobs part.

``train_rollout_logprob_exact_fraction`` (``algo.metrics``) says how many tokens match; with the
option on anything below 1 is a bug or an unsupported path, and the metric alone does not say
where. This names the first step and the modality (the prompt's ``sample.modality``) at which a
completion token's logprob differs, once per modality, so a run log points at the case to fix.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger("omni_grpo.exact")


class ExactnessWatch:
    """Compares a micro-batch's trainer logprobs with its rollout logprobs, bit for bit."""

    def __init__(self) -> None:
        # off with rollout.max_staleness 1: every sample is one policy version old, so its
        # logprobs differ from the trainer's by design (the trainer switches it off)
        self.enabled = True
        self.warned: set[str] = set()
        # per modality [differing, total] tokens since the last clear (benchmarks read it)
        self.totals: dict[str, tuple[int, int]] = {}

    @torch.no_grad()
    def check(self, train_logp: torch.Tensor, mb: Any, step: int) -> dict[str, tuple[int, int]]:
        """Per modality ``(differing, total)`` completion tokens of ``mb``; warns the first time
        a modality has a difference."""
        mask = mb.mask.to(train_logp.device).bool()
        differ = (train_logp.detach().float() != mb.rollout_logp.to(train_logp.device)) & mask
        per_row = torch.stack([differ.sum(-1), mask.sum(-1)], -1).cpu().tolist()
        out: dict[str, tuple[int, int]] = {}
        for prompt, (bad, total) in zip(mb.prompts, per_row, strict=True):
            modality = getattr(prompt.sample, "modality", "text")
            b, t = out.get(modality, (0, 0))
            out[modality] = (b + int(bad), t + int(total))
        for modality, (bad, total) in sorted(out.items()):
            b, t = self.totals.get(modality, (0, 0))
            self.totals[modality] = (b + bad, t + total)
            if bad and self.enabled and modality not in self.warned:
                self.warned.add(modality)
                log.warning(
                    "rollout.exact_logprobs: at step %d, %d of %d %s completion tokens have a "
                    "rollout logprob that differs from the trainer's (exact fraction %.6f); "
                    "the run is not exactly on-policy for %s prompts",
                    step,
                    bad,
                    total,
                    modality,
                    1 - bad / total,
                    modality,
                )
        return out

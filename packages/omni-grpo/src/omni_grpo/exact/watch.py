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
        # (per-row [differing, total] on the device, the rows' prompts, step): :meth:`queue`
        self._pending: list[tuple[torch.Tensor, Any, int]] = []

    @torch.no_grad()
    def queue(
        self,
        train_logp: torch.Tensor,
        mb: Any,
        step: int,
        mask: torch.Tensor | None = None,
        rollout_logp: torch.Tensor | None = None,
    ) -> None:
        """Counts ``mb``'s differing tokens on the device, to be read by :meth:`flush`. Why
        queued: read at once, the host would wait for the forward before queuing the backward,
        and the GPU would idle meanwhile, every micro-batch. ``mask`` / ``rollout_logp``: the
        micro-batch's, already on ``train_logp``'s device (else copied without waiting)."""
        dev = train_logp.device
        mask = (mask if mask is not None else mb.mask.to(dev, non_blocking=True)).bool()
        if rollout_logp is None:
            rollout_logp = mb.rollout_logp.to(dev, non_blocking=True)
        differ = (train_logp.detach().float() != rollout_logp) & mask
        self._pending.append((torch.stack([differ.sum(-1), mask.sum(-1)], -1), mb.prompts, step))

    def flush(self) -> list[dict[str, tuple[int, int]]]:
        """Reads every queued micro-batch's counts (one host read), adds them to ``totals`` and
        warns as :meth:`check` does; per micro-batch, per modality ``(differing, total)``."""
        pending, self._pending = self._pending, []
        if not pending:
            return []
        rows = torch.cat([counts for counts, _, _ in pending]).cpu().tolist()
        out, start = [], 0
        for counts, prompts, step in pending:
            per_row = rows[start : start + counts.shape[0]]
            start += counts.shape[0]
            out.append(self._tally(per_row, prompts, step))
        return out

    def check(self, train_logp: torch.Tensor, mb: Any, step: int) -> dict[str, tuple[int, int]]:
        """Per modality ``(differing, total)`` completion tokens of ``mb``, read now; warns the
        first time a modality has a difference."""
        self.flush()
        self.queue(train_logp, mb, step)
        return self.flush()[0]

    def _tally(
        self, per_row: list[list[int]], prompts: Any, step: int
    ) -> dict[str, tuple[int, int]]:
        out: dict[str, tuple[int, int]] = {}
        for prompt, (bad, total) in zip(prompts, per_row, strict=True):
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

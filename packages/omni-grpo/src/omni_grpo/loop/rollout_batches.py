"""The groups each GRPO step trains on: generated in the step, or one step ahead.

With ``rollout.max_staleness: 1`` step k+1's batch is requested before step k trains, so the
engine generates it while the optimizer runs (``omni_grpo.rollout.overlap``). Two things then
need bookkeeping, and both live here rather than in the loop:

* the batch in flight: requested at the end of one :meth:`RolloutBatches.take`, collected by the
  next; none is requested after the last step of the call (nothing would train on it);
* the data cursor a checkpoint stores (:attr:`RolloutBatches.trained_cursor`): the sampler's
  position after the batch that was *trained*, not after the one drawn ahead — a resume draws
  that batch again instead of skipping its rows;
* with ``rollout.embedded.extra_groups`` (partial rollouts, ``omni_grpo.rollout.partial``) the
  groups in flight, drawn from the same stream; a checkpoint does not keep them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from omni_grpo.loop.data_order import EpochSampler, PromptStream
from omni_grpo.rollout.overlap import AheadEngine

if TYPE_CHECKING:
    from concurrent.futures import Future

    from omni_grpo.data.dataset import OmniDataset
    from omni_grpo.run.checkpoint import DataCursor
    from omni_grpo.types import Completion, PromptInputs, RolloutEngine, SamplingParams


class RolloutBatches:
    """``take`` returns a step's groups: ``n_samples`` completions for each of
    ``prompts_per_step`` prompts drawn by ``sampler``; ``ahead`` turns the overlap on."""

    def __init__(
        self,
        engine: RolloutEngine,
        dataset: OmniDataset,
        sampler: EpochSampler,
        *,
        prompts_per_step: int,
        n_samples: int,
        sampling: SamplingParams,
        ahead: bool,
        extra_groups: int = 0,
    ) -> None:
        self.dataset = dataset
        self.sampler = sampler  # read directly only before the first step (the warm-up)
        # the next step's prompts load while this step generates and trains
        self.prompts = PromptStream(dataset, sampler, ahead=prompts_per_step)
        if extra_groups:  # partial rollouts: groups in flight, topped up from the same stream
            from omni_grpo.rollout.partial import PartialRollouts

            engine = PartialRollouts(
                engine,  # type: ignore[arg-type]
                extra_groups,
                self.prompts.take,
            )
        self.engine = engine
        self.prompts_per_step = prompts_per_step
        self.n_samples = n_samples
        self.sampling = sampling
        self.ahead = AheadEngine(engine) if ahead else None
        self.trained_cursor: DataCursor = sampler.cursor
        self._in_flight: Future[list[list[Completion]]] | None = None

    def _draw(self) -> list[PromptInputs]:
        return self.prompts.take(self.prompts_per_step)

    def take(self, more: bool) -> list[list[Completion]]:
        """This step's groups. With the overlap on and ``more`` steps to come, the next step's
        batch is requested before returning, so it is generated while this one trains."""
        if self._in_flight is None:
            groups = self.engine.generate(self._draw(), self.n_samples, self.sampling)
        else:
            groups = self._in_flight.result()
        self.trained_cursor = self.prompts.cursor
        self._in_flight = None
        if self.ahead is not None and more:
            # The worker draws the prompts too: loading is rollout work, not the trainer's. The
            # prompt stream is not touched here again until the batch is in.
            self._in_flight = self.ahead.submit(self._draw, self.n_samples, self.sampling)
        return groups

    def groups_in_flight(self) -> int:
        """Groups of partial rollouts started but not trained yet (0 without them): a checkpoint
        does not keep them, so a resume starts after their prompts (counted when it does)."""
        return len(getattr(self.engine, "carry", ()))

    def close(self) -> None:
        """Stop the overlap's worker thread (an in-flight batch is cut short where it can be)."""
        if self.ahead is not None:
            self.ahead.close()
        self.prompts.close()

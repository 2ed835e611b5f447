"""Which training rows a step draws: a per-epoch permutation, resumable from a two-number cursor."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from omni_grpo.run.checkpoint import DataCursor

if TYPE_CHECKING:
    from omni_grpo.data.dataset import OmniDataset
    from omni_grpo.types import PromptInputs


class EpochSampler:
    """Indices in a fresh permutation per epoch; the permutation of epoch ``e`` depends only on
    (seed, e), so the cursor (epoch, position) is all a checkpoint needs to store."""

    def __init__(
        self, size: int, seed: int, shuffle: bool = True, cursor: DataCursor | None = None
    ) -> None:
        if size == 0:
            raise ValueError("the training dataset is empty")
        self.size = size
        self.seed = seed
        self.shuffle = shuffle
        self.cursor = cursor or DataCursor()

    def order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.size)
        return np.random.default_rng([self.seed, epoch]).permutation(self.size)

    def next(self) -> int:
        if self.cursor.position >= self.size:
            self.cursor = DataCursor(self.cursor.epoch + 1, 0)
        index = int(self.order(self.cursor.epoch)[self.cursor.position])
        self.cursor = DataCursor(self.cursor.epoch, self.cursor.position + 1)
        return index


def next_prompts(dataset: OmniDataset, sampler: EpochSampler, count: int) -> list[PromptInputs]:
    """``count`` loadable prompts; unreadable rows are skipped and counted by the dataset."""
    prompts: list[PromptInputs] = []
    tries = 0
    while len(prompts) < count:
        item = dataset.load(sampler.next())
        tries += 1
        if item is not None:
            prompts.append(item)
        elif tries > 10 * max(count, len(dataset)):
            raise RuntimeError(f"no loadable rows in the training set ({dataset.stats()})")
    return prompts

"""Which training rows a step draws: a per-epoch permutation, resumable from a two-number cursor,
and the stream that loads them a step ahead."""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
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


class PromptStream:
    """The training prompts in the sampler's order, the next ones loaded while the step runs.

    Why: a prompt's media are decoded and preprocessed on the CPU (PNG, WAV, MP4 frames and
    sound, the mel features): ~0.2-0.4 s for a step of 8 multimodal prompts, which the GPU would
    otherwise wait for at the start of every rollout. One worker thread loads up to ``ahead``
    prompts past those taken, as a data loader's prefetch does. It is the only reader of the
    sampler once the first prompt is taken, and loads in the sampler's order, so the prompts, the
    skipped-and-counted rows and their order are those of loading in the step.

    :attr:`cursor` is the sampler's position after the last prompt *taken*: what a checkpoint
    stores, so a resume loads the prefetched but unused prompts again instead of skipping them.
    ``ahead=0`` loads in the caller's thread (nothing runs in the background).
    """

    def __init__(self, dataset: OmniDataset, sampler: EpochSampler, ahead: int) -> None:
        self.dataset = dataset
        self.sampler = sampler
        self.ahead = ahead
        self.cursor: DataCursor = sampler.cursor
        self._pool: ThreadPoolExecutor | None = None
        self._queue: deque[Future[tuple[PromptInputs, DataCursor]]] = deque()

    def _load_one(self) -> tuple[PromptInputs, DataCursor]:
        (item,) = next_prompts(self.dataset, self.sampler, 1)
        return item, self.sampler.cursor

    def _fill(self, count: int) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="omni-grpo-prompts")
        while len(self._queue) < count:
            self._queue.append(self._pool.submit(self._load_one))

    def take(self, count: int) -> list[PromptInputs]:
        """The next ``count`` loadable prompts (unreadable rows skipped and counted)."""
        if self.ahead <= 0:
            out = next_prompts(self.dataset, self.sampler, count)
            self.cursor = self.sampler.cursor
            return out
        self._fill(count)
        out = []
        for _ in range(count):
            item, self.cursor = self._queue.popleft().result()
            out.append(item)
        self._fill(self.ahead)
        return out

    def close(self) -> None:
        """Stop loading ahead; prompts loaded but not taken are dropped (the cursor keeps them)."""
        for future in self._queue:
            future.cancel()
        self._queue.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

"""A lazily decoded dataset: rows are validated up front (small), media decoded per access.

A row whose media is missing, escapes the root or cannot be decoded is skipped and COUNTED (and
logged once per row), never a crash in the middle of a run; ``counters`` exposes the tallies.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from omni_grpo.data.media import MediaError
from omni_grpo.data.prompt import PromptBuilder
from omni_grpo.data.schema import read_samples
from omni_grpo.types import PromptInputs, Sample

if TYPE_CHECKING:
    from omni_grpo.config import DataConfig

log = logging.getLogger(__name__)


class OmniDataset:
    """``len(ds)`` rows; ``ds.load(i)`` -> PromptInputs or None (skipped, counted)."""

    def __init__(
        self,
        rows: str | os.PathLike[str] | list[Sample],
        root: str | os.PathLike[str] | None,
        builder: PromptBuilder,
    ) -> None:
        if isinstance(rows, list):
            self.samples = rows
            default_root = Path.cwd()
        else:
            self.samples = read_samples(rows)
            default_root = Path(rows).parent
        self.root = Path(root) if root is not None else default_root
        self.builder = builder
        self.counters: Counter[str] = Counter()
        self._logged: set[str] = set()

    @classmethod
    def from_config(
        cls,
        data: DataConfig,
        model_dir: str | os.PathLike[str],
        split: str = "train",
        *,
        builder: PromptBuilder | None = None,
        system_prompt: str | None = None,
    ) -> OmniDataset:
        """The ``train`` or ``eval`` split named in ``data`` (media root ``data.root``, else the file's dir)."""
        path = {"train": data.train, "eval": data.eval}.get(split)
        if path is None:
            raise ValueError(f"data.{split} is not set (expected a jsonl path)")
        builder = builder or PromptBuilder(model_dir, data, system_prompt=system_prompt)
        return cls(path, data.root or Path(path).parent, builder)

    def __len__(self) -> int:
        return len(self.samples)

    def sample(self, index: int) -> Sample:
        return self.samples[index]

    def load(self, index: int) -> PromptInputs | None:
        sample = self.samples[index]
        try:
            item = self.builder.build(sample, self.root)
        except MediaError as err:
            self.counters[f"skipped_{err.reason}"] += 1
            self.counters["skipped"] += 1
            if sample.uid not in self._logged:
                self._logged.add(sample.uid)
                log.warning("skipping row %r: %s", sample.uid, err)
            return None
        self.counters["loaded"] += 1
        return item

    __getitem__ = load

    def load_many(self, indices: Iterable[int]) -> list[PromptInputs]:
        """The loadable ones among ``indices``, in order (skips are counted)."""
        return [x for i in indices if (x := self.load(i)) is not None]

    def __iter__(self) -> Iterator[PromptInputs]:
        for i in range(len(self)):
            if (x := self.load(i)) is not None:
                yield x

    def stats(self) -> dict[str, int]:
        return dict(self.counters)

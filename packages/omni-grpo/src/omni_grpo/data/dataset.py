"""A lazily decoded dataset: rows are validated up front (small), media decoded per access.

Rows come from any source ``omni_grpo.data.sources`` reads (jsonl, parquet, globs and lists of
them, ``save_to_disk`` dirs). A bad row is skipped at load and counted (``skipped_rows``,
``skipped_rows_<reason>``); a row whose media is missing, escapes the root, is over a limit or
cannot be decoded is skipped when it is drawn and COUNTED (``skipped``, ``skipped_<reason>``,
one log line per row), never a crash in the middle of a run; ``stats()`` exposes the tallies,
which the trainer logs as ``data/skipped*``.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from omni_grpo.config import default_media_root as default_root
from omni_grpo.data.media import MediaError
from omni_grpo.data.prompt import PromptBuilder
from omni_grpo.data.sources import LoadedRows, Spec, load_rows
from omni_grpo.types import PromptInputs, Sample

if TYPE_CHECKING:
    from omni_grpo.config import DataConfig

log = logging.getLogger(__name__)


class OmniDataset:
    """``len(ds)`` rows; ``ds.load(i)`` -> PromptInputs or None (skipped, counted)."""

    def __init__(
        self,
        rows: Spec | list[Sample],
        root: str | os.PathLike[str] | None,
        builder: PromptBuilder,
        columns: dict[str, str] | None = None,
    ) -> None:
        self.loaded: LoadedRows | None = None
        if isinstance(rows, list) and (not rows or isinstance(rows[0], Sample)):
            self.samples: list[Sample] = list(rows)  # type: ignore[arg-type]
            default = Path.cwd()
        else:
            if columns is None:
                columns = getattr(getattr(builder, "data", None), "columns", None)
            self.loaded = load_rows(rows, columns)  # type: ignore[arg-type]
            self.samples = self.loaded.samples
            default = default_root(rows)  # type: ignore[arg-type]
        self.root = Path(root) if root is not None else default
        self.builder = builder
        self.counters: Counter[str] = Counter(self.loaded.counters() if self.loaded else {})
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
        """The ``train`` or ``eval`` split named in ``data`` (media root ``data.root``, else the
        file's dir), columns renamed by ``data.columns``."""
        path = {"train": data.train, "eval": data.eval}.get(split)
        if path is None:
            raise ValueError(
                f"data.{split} is not set (expected a jsonl/parquet path or a dataset dir)"
            )
        builder = builder or PromptBuilder(model_dir, data, system_prompt=system_prompt)
        return cls(path, data.root or default_root(path), builder, data.columns)

    def ablated(self, name: str) -> OmniDataset:
        """The same rows with the media of ablation ``name`` replaced by neutral inputs."""
        ds = OmniDataset(self.samples, self.root, self.builder.ablated(name))
        ds.loaded = self.loaded  # the same sources: embedded media are fetched from them
        return ds

    def __len__(self) -> int:
        return len(self.samples)

    def sample(self, index: int) -> Sample:
        return self.samples[index]

    def load(self, index: int) -> PromptInputs | None:
        sample = self.samples[index]
        blobs = self.loaded.fetch if self.loaded is not None else None
        try:
            item = self.builder.build(sample, self.root, blobs)
        except MediaError as err:
            self.counters[f"skipped_{err.reason}"] += 1
            self.counters["skipped"] += 1
            # once per row, and once per cause shared by many rows (an unreadable row group)
            if sample.uid not in self._logged and str(err) not in self._logged:
                self._logged.update((sample.uid, str(err)))
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

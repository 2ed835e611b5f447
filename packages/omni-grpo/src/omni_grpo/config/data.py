"""``data:``: where the rows are and the limits every media item is decoded under."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from omni_grpo.config.base import DatasetSpec, PathField, StrictModel
from omni_grpo.dataset_spec import ROW_FIELDS


class SyntheticDataConfig(StrictModel):
    tasks: list[Literal["image", "audio", "video"]] = Field(
        default_factory=lambda: ["image", "audio", "video"]
    )
    n_train: int = Field(256, ge=1)
    n_eval: int = Field(64, ge=1)
    seed: int | None = Field(None, description="default run.seed")


def default_media_root(spec: Any) -> Path:
    """The media root of a dataset spec when none is configured: the (first) file's directory
    (a glob's too), or the directory itself for a ``datasets.save_to_disk`` dir."""
    first = Path(os.fspath(spec[0] if isinstance(spec, list | tuple) and spec else spec))
    return first if first.is_dir() else first.parent


class DataConfig(StrictModel):
    """Where the rows are and the explicit limits every media item is decoded under.

    ``train`` / ``eval``: a ``.jsonl`` file, a ``.parquet`` file, a glob or a list of them, or a
    ``datasets.save_to_disk`` directory (see ``omni_grpo.data.sources``). A bad row is skipped
    and counted (``data/skipped_rows``); only a split with no usable row is an error.
    """

    train: DatasetSpec | None = None
    eval: DatasetSpec | None = None
    root: PathField | None = Field(
        None,
        description="media root; media paths are confined to it (default: the train file's dir, "
        "or the dataset dir itself)",
    )
    columns: dict[str, str] = Field(
        default_factory=dict,
        description="our row field -> the source's column name, e.g. {label: answer, prompt: problem}",
    )
    video_fps: float = Field(2.0, gt=0)
    max_frames: int = Field(32, ge=2)
    image_min_pixels: int = Field(32 * 32, ge=32 * 32)
    image_max_pixels: int = Field(256 * 32 * 32, ge=32 * 32)
    video_max_pixels: int = Field(128 * 32 * 32, ge=32 * 32, description="per frame")
    max_source_pixels: int = Field(
        64_000_000,
        ge=32 * 32,
        le=2 * 89_478_485,
        description="largest image / video frame accepted, checked from the header before "
        "decoding (larger: skipped as too_large); replaces Pillow's decompression-bomb default "
        "and may not exceed Pillow's hard limit",
    )
    audio_max_seconds: float = Field(30.0, gt=0, description="longer audio is truncated")
    video_max_seconds: float = Field(
        600.0, gt=0, description="frames are sampled from the first this-many seconds"
    )
    use_audio_in_video: bool = Field(
        False,
        description="for rows that do not set use_audio_in_video: every video's own sound track "
        "(decoded with PyAV, truncated like audio) is interleaved with its frames in one block, "
        "as the Omni processor's use_audio_in_video; a video without a sound track skips its row",
    )
    shuffle: bool = True
    synthetic: SyntheticDataConfig | None = None

    @model_validator(mode="after")
    def _synthetic_or_files(self) -> DataConfig:
        """``data.synthetic`` writes the train/eval files itself: a ``train``/``eval`` given as
        well would be ignored without a word, so say which one wins instead."""
        given = [k for k in ("train", "eval") if getattr(self, k) is not None]
        if self.synthetic is not None and given:
            raise ValueError(
                f"data.synthetic generates the dataset, so data.{'/'.join(given)} would be "
                "ignored; set one or the other (data.synthetic: null to train on your files)"
            )
        return self

    @model_validator(mode="after")
    def _pixels_ordered(self) -> DataConfig:
        if self.image_min_pixels > self.image_max_pixels:
            raise ValueError(
                f"image_min_pixels ({self.image_min_pixels}) must be <= image_max_pixels ({self.image_max_pixels})"
            )
        return self

    def default_root(self) -> Path | None:
        """The media root when ``root`` is unset (see ``default_media_root``)."""
        return default_media_root(self.train) if self.train is not None else None

    @field_validator("columns")
    @classmethod
    def _known_fields(cls, v: dict[str, str]) -> dict[str, str]:
        if not v:
            return v
        unknown = sorted(set(v) - set(ROW_FIELDS))
        if unknown:
            raise ValueError(f"unknown row field(s) {unknown}; the fields are {list(ROW_FIELDS)}")
        return v

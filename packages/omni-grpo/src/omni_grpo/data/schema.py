"""The dataset row format (one JSON object per line) and its validation.

A row::

    {"id": "avqa-183", "prompt": "<audio>\\nWhat happened?\\nA. ...", "label": "B",
     "media": [{"type": "audio", "path": "wav/x.wav"}], "choices": ["...", "..."],
     "reward": "mcq", "modality": "audio", "metadata": {...}}

``prompt`` carries one ``<image>``/``<video>``/``<audio>`` placeholder per media item, in order;
``media`` paths are relative to the dataset root. ``uid`` is accepted as an alias of ``id``.
``modality`` defaults to the media's single type ("text" with none, "mixed" with several).
Errors name the file and the 1-based line.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, model_validator

from omni_grpo.types import Sample

MediaType = Literal["image", "video", "audio"]
PLACEHOLDER = re.compile(r"<(image|video|audio)>")


class DataError(ValueError):
    """A dataset file or row is invalid; the message names the file and row."""


class MediaRef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: MediaType
    path: str = Field(min_length=1)


class DatasetRow(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    id: str = Field(validation_alias=AliasChoices("id", "uid"), min_length=1)
    prompt: str
    label: str
    media: list[MediaRef] = Field(default_factory=list)
    choices: list[str] | None = None
    reward: str = "mcq"
    modality: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _id_as_string(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key in ("id", "uid"):
                if isinstance(data.get(key), int):
                    data = {**data, key: str(data[key])}
        return data

    @model_validator(mode="after")
    def _placeholders_match_media(self) -> DatasetRow:
        in_prompt = PLACEHOLDER.findall(self.prompt)
        in_media = [m.type for m in self.media]
        if in_prompt != in_media:
            raise ValueError(
                f"prompt placeholders {in_prompt} do not match media types {in_media} (one <type> per item, in order)"
            )
        if self.modality is None:
            kinds = sorted(set(in_media))
            self.modality = "text" if not kinds else kinds[0] if len(kinds) == 1 else "mixed"
        return self

    def to_sample(self) -> Sample:
        return Sample(
            uid=self.id,
            prompt=self.prompt,
            label=self.label,
            media=[m.model_dump() for m in self.media],
            choices=self.choices,
            reward=self.reward,
            modality=self.modality or "text",
            metadata=self.metadata,
        )


def _format_errors(err: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in e['loc']) or 'row'}: {e['msg']}" for e in err.errors()
    )


def parse_row(obj: Any, where: str) -> DatasetRow:
    """Validate one decoded JSON value; ``where`` ("file.jsonl:12") prefixes every error."""
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    try:
        return DatasetRow.model_validate(obj)
    except ValidationError as err:
        raise DataError(f"{where}: {_format_errors(err)}") from None


def iter_rows(path: str | os.PathLike[str]) -> Iterator[DatasetRow]:
    """Stream validated rows from a jsonl file (blank lines skipped); raises DataError on the first bad row."""
    file = Path(path)
    if not file.is_file():
        raise DataError(f"dataset file not found: {file}")
    with file.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(
                    f"{file}:{lineno}: not valid JSON: {err.msg} (column {err.colno})"
                ) from None
            yield parse_row(obj, f"{file}:{lineno}")


def read_samples(path: str | os.PathLike[str]) -> list[Sample]:
    """All rows of a jsonl file as Samples (media NOT decoded); duplicate ids are an error."""
    samples: list[Sample] = []
    seen: dict[str, int] = {}
    for i, row in enumerate(iter_rows(path)):
        if row.id in seen:
            raise DataError(
                f"{path}: duplicate id {row.id!r} (rows {seen[row.id] + 1} and {i + 1})"
            )
        seen[row.id] = i
        samples.append(row.to_sample())
    return samples


def write_rows(path: str | os.PathLike[str], rows: Iterable[DatasetRow | dict[str, Any]]) -> int:
    """Write rows atomically (temp file in the same directory, then rename); returns the count.

    Dict rows are validated first, so a preparer can never write a file the loader would refuse.
    """
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    n = 0
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for i, row in enumerate(rows):
                r = row if isinstance(row, DatasetRow) else parse_row(row, f"{out} (row {i + 1})")
                f.write(json.dumps(r.model_dump(exclude_none=True), ensure_ascii=False) + "\n")
                n += 1
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return n

"""The dataset row format (one JSON object per line) and its validation.

A row::

    {"id": "avqa-183", "prompt": "<audio>\\nWhat happened?\\nA. ...", "label": "B",
     "media": [{"type": "audio", "path": "wav/x.wav"}], "choices": ["...", "..."],
     "reward": "mcq", "modality": "audio", "metadata": {...}}

``prompt`` carries one ``<image>``/``<video>``/``<audio>`` placeholder per media item, in order;
``media`` paths are relative to the dataset root. ``uid`` is accepted as an alias of ``id``.
``modality`` defaults to the media's single type ("text" with none, "mixed" with several).
``use_audio_in_video: true`` says every ``<video>`` brings its own sound track, interleaved with
its frames in one block (the Omni processor's layout); a row that says so without a video is
refused, and an absent value defers to ``data.use_audio_in_video``.
``label`` may not be empty, and with ``choices`` it must name one of them: an option letter
(``A``.. for the number of choices, as the mcq reward reads it) or, for other rewards, the text
of a choice. A label that can never score is refused at load, not trained on forever at 0.
Errors name the file and the 1-based line; the lenient loader (``omni_grpo.data.sources``)
skips and counts a bad row by its ``reason`` (the pydantic error type for our own checks).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

# Defined a floor down, where the config reads them too (``omni_grpo.dataset_spec``); served here.
from omni_grpo.dataset_spec import ROW_FIELDS as ROW_FIELDS
from omni_grpo.dataset_spec import DataError as DataError
from omni_grpo.types import Sample

MediaType = Literal["image", "video", "audio"]
PLACEHOLDER = re.compile(r"<(image|video|audio)>")
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
# list column -> media type of its items
MEDIA_COLUMNS: dict[str, MediaType] = {"images": "image", "audios": "audio", "videos": "video"}


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
    reward: str | None = Field(
        None, description="reward entry-point name; None: rewards.by_modality, then rewards.default"
    )
    modality: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    use_audio_in_video: bool | None = Field(
        None,
        description="every <video> of the prompt brings its own sound track, interleaved with "
        "its frames; None: data.use_audio_in_video decides",
    )

    @model_validator(mode="before")
    @classmethod
    def _id_as_string(cls, data: Any) -> Any:
        """Integer ids, and numeric labels (a math answer ``42`` written as a number, an int
        column of a table), are taken as their text; booleans are not numbers here."""
        if isinstance(data, dict):
            for key in ("id", "uid", "label"):
                value = data.get(key)
                if isinstance(value, int | float) and not isinstance(value, bool):
                    if not math.isfinite(value):  # NaN / inf from a table: no answer, no id
                        raise PydanticCustomError(
                            "bad_label" if key == "label" else "invalid",
                            "{key} is {value}, not a value",
                            {"key": key, "value": str(value)},
                        )
                    data = {**data, key: str(value)}
        return data

    @model_validator(mode="after")
    def _placeholders_match_media(self) -> DatasetRow:
        in_prompt = PLACEHOLDER.findall(self.prompt)
        in_media = [m.type for m in self.media]
        if in_prompt != in_media:
            raise PydanticCustomError(
                "placeholder_mismatch",
                "prompt placeholders {p} do not match media types {m} (one <type> per item, in order)",
                {"p": str(in_prompt), "m": str(in_media)},
            )
        if self.use_audio_in_video and "video" not in in_media:
            raise PydanticCustomError(
                "audio_in_video_without_video",
                "use_audio_in_video is true but the prompt has no <video> to take the audio from",
            )
        check_label(self.label, self.choices, self.reward)
        if self.modality is None:
            kinds = sorted(set(in_media))
            self.modality = "text" if not kinds else kinds[0] if len(kinds) == 1 else "mixed"
        return self

    @model_validator(mode="before")
    @classmethod
    def _metadata_json(cls, data: Any) -> Any:
        """A table stores ``metadata`` as a JSON string (its keys differ per row)."""
        if isinstance(data, dict) and isinstance(data.get("metadata"), str):
            with contextlib.suppress(json.JSONDecodeError):  # else the field's own error names it
                data = {**data, "metadata": json.loads(data["metadata"])}
        return data

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
            use_audio_in_video=self.use_audio_in_video,
        )


def check_label(label: str, choices: list[str] | None, reward: str | None) -> None:
    """Refuse a label that can never be scored right (see the module docstring)."""
    if not label.strip():
        raise PydanticCustomError("bad_label", "label is empty")
    if choices is None:
        return
    if not choices:
        raise PydanticCustomError("bad_label", "choices is an empty list (omit it instead)")
    texts = [c.strip() for c in choices]
    if len(set(texts)) != len(texts):  # two letters for one answer: neither can be told apart
        dup = next(t for t in texts if texts.count(t) > 1)
        raise PydanticCustomError("bad_label", "choices repeat {dup}", {"dup": repr(dup)})
    letters = LETTERS[: len(choices)]
    if label.strip().strip("()").upper() in letters:
        return
    if reward != "mcq" and label.strip() in (c.strip() for c in choices):
        return
    raise PydanticCustomError(
        "bad_label",
        "label {label} is not among the {n} choices (expected an option letter {first}-{last}"
        "{text})",
        {
            "label": repr(label),
            "n": len(choices),
            "first": letters[0],
            "last": letters[-1],
            "text": "" if reward == "mcq" else " or the text of a choice",
        },
    )


def error_reason(err: ValidationError) -> str:
    """The skip counter key of a row's first validation error: our own check's name
    (``bad_label``, ``placeholder_mismatch``), ``missing_field``, else ``invalid``."""
    kind = err.errors()[0]["type"]
    return {"missing": "missing_field"}.get(kind, kind if kind in ROW_CHECKS else "invalid")


ROW_CHECKS = frozenset({"bad_label", "placeholder_mismatch", "audio_in_video_without_video"})


def _format_errors(err: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in e['loc']) or 'row'}: {e['msg']}" for e in err.errors()
    )


def parse_row(obj: Any, where: str) -> DatasetRow:
    """Validate one decoded JSON value; ``where`` ("file.jsonl:12") prefixes every error."""
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}", "not_object")
    try:
        return DatasetRow.model_validate(obj)
    except ValidationError as err:
        raise DataError(f"{where}: {_format_errors(err)}", error_reason(err)) from None


PARQUET_ROW_GROUP = 64  # rows per row group: random access reads one group (see sources.py)


def write_rows(path: str | os.PathLike[str], rows: Iterable[DatasetRow | dict[str, Any]]) -> int:
    """Write rows atomically (temp file in the same directory, then rename); returns the count.

    jsonl, or parquet when ``path`` ends in ``.parquet`` (our fields as columns, ``metadata`` as a
    JSON string since its keys differ per row). Dict rows are validated first, so a preparer can
    never write a file the loader would refuse.
    """
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    n = 0
    try:
        valid = (
            r if isinstance(r, DatasetRow) else parse_row(r, f"{out} (row {i + 1})")
            for i, r in enumerate(rows)
        )
        if out.suffix.lower() == ".parquet":
            os.close(fd)
            n = _write_parquet(Path(tmp), valid)
        else:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                for r in valid:
                    f.write(json.dumps(r.model_dump(exclude_none=True), ensure_ascii=False) + "\n")
                    n += 1
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return n


def _write_parquet(path: Path, rows: Iterable[DatasetRow]) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema(
        [
            ("id", pa.string()),
            ("prompt", pa.string()),
            ("label", pa.string()),
            ("media", pa.list_(pa.struct([("type", pa.string()), ("path", pa.string())]))),
            ("choices", pa.list_(pa.string())),
            ("reward", pa.string()),
            ("modality", pa.string()),
            ("metadata", pa.string()),
            ("use_audio_in_video", pa.bool_()),
        ]
    )
    n = 0
    with pq.ParquetWriter(str(path), schema) as writer:
        batch: list[dict[str, Any]] = []
        for r in rows:
            d = r.model_dump()
            d["metadata"] = json.dumps(d["metadata"], ensure_ascii=False)
            batch.append(d)
            if len(batch) == PARQUET_ROW_GROUP:
                writer.write_table(pa.Table.from_pylist(batch, schema))
                n, batch = n + len(batch), []
        if batch or n == 0:
            writer.write_table(pa.Table.from_pylist(batch, schema))
            n += len(batch)
    return n

"""Rows -> a parquet file with the media EMBEDDED, in the hub's layout.

The list columns ``images`` / ``audios`` / ``videos`` hold the ``datasets`` feature struct
``{bytes, path}`` per item (what ``datasets.Image`` / ``Audio`` / ``Video`` store), so the file
loads in ``datasets`` as well as here, and one file can be shipped instead of a hundred thousand
small ones. The bytes are the files' own bytes (no re-encoding), so a row trains identically from
the file and from the table. Written streaming, one row group at a time — at most ``row_group`` rows and
``EMBED_ROW_GROUP_BYTES`` of media, since a reader fetching one row's media reads its whole row
group's column chunk — atomically (temp file, then rename).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from omni_grpo.data.media import MediaError, resolve_media
from omni_grpo.data.schema import MEDIA_COLUMNS
from omni_grpo.types import Sample

# media type -> its list column
COLUMN_OF: dict[str, str] = {t: c for c, t in MEDIA_COLUMNS.items()}
EMBED_ROW_GROUP = 64
EMBED_ROW_GROUP_BYTES = 16 << 20


def embedded_schema() -> Any:
    import pyarrow as pa

    item = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    return pa.schema(
        [
            ("id", pa.string()),
            ("prompt", pa.string()),
            ("label", pa.string()),
            ("choices", pa.list_(pa.string())),
            ("reward", pa.string()),
            ("modality", pa.string()),
            ("metadata", pa.string()),
            ("use_audio_in_video", pa.bool_()),
            *((c, pa.list_(item)) for c in MEDIA_COLUMNS),
        ]
    )


def writer_options() -> dict[str, Any]:
    """``ParquetWriter`` options: media bytes stored plain (already compressed formats; snappy and
    a dictionary attempt on megabyte values only cost time on both sides), text snappy with
    dictionaries."""
    text = ["id", "prompt", "label", "choices.list.element", "reward", "modality", "metadata"]
    paths = [f"{c}.list.element.path" for c in MEDIA_COLUMNS]
    media = [f"{c}.list.element.bytes" for c in MEDIA_COLUMNS]
    return {
        "compression": {**dict.fromkeys(text + paths, "SNAPPY"), **dict.fromkeys(media, "NONE")},
        "use_dictionary": text,
    }


def embedded_record(sample: Sample, root: Path) -> dict[str, Any]:
    """One table row: the sample's fields, its media files' bytes in the per-type columns (a file
    that is missing or escapes the root is refused: the table would silently lose it)."""
    rec: dict[str, Any] = {
        "id": sample.uid,
        "prompt": sample.prompt,
        "label": sample.label,
        "choices": sample.choices,
        "reward": sample.reward,
        "modality": sample.modality,
        "metadata": json.dumps(sample.metadata, ensure_ascii=False),
        "use_audio_in_video": sample.use_audio_in_video,
        **{c: [] for c in MEDIA_COLUMNS},
    }
    for item in sample.media:
        path = resolve_media(root, item["path"])
        rec[COLUMN_OF[item["type"]]].append({"bytes": path.read_bytes(), "path": item["path"]})
    return rec


def write_embedded_parquet(
    samples: Iterable[Sample],
    root: str | os.PathLike[str],
    out: str | os.PathLike[str],
    row_group: int = EMBED_ROW_GROUP,
) -> int:
    """Write ``samples`` with their media embedded to the parquet file ``out``; returns the count."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out_p, root_p = Path(out), Path(root)
    out_p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out_p.name}.", suffix=".tmp", dir=out_p.parent)
    os.close(fd)
    schema = embedded_schema()
    n = 0
    try:
        with pq.ParquetWriter(tmp, schema, **writer_options()) as writer:
            batch: list[dict[str, Any]] = []
            size = 0
            for s in samples:
                try:
                    rec = embedded_record(s, root_p)
                except MediaError as err:
                    raise MediaError(err.reason, f"row {s.uid!r}: {err}") from None
                batch.append(rec)
                size += sum(len(it["bytes"]) for c in MEDIA_COLUMNS for it in rec[c])
                if len(batch) == row_group or size >= EMBED_ROW_GROUP_BYTES:
                    writer.write_table(pa.Table.from_pylist(batch, schema))
                    n, batch, size = n + len(batch), [], 0
            if batch or n == 0:
                writer.write_table(pa.Table.from_pylist(batch, schema))
                n += len(batch)
        os.replace(tmp, out_p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return n

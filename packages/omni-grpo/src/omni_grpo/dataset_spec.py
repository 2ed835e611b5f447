"""A dataset spec (``data.train`` / ``data.eval``): the files it names, the row fields its columns
map onto, and the columns its tables carry, read from headers alone.

A floor below both the config and the data: the config's validation (``data.columns`` names
only row fields) and pre-flight check (``omni_grpo.config.check_paths``: a renamed column that a
table lacks is refused before the model is made) need exactly this much, and the config is the
ground floor, so none of it may sit in ``omni_grpo.data``, whose loader reaches the rewards, which
take their config section. It imports nothing of omni_grpo. ``omni_grpo.data.schema`` and
``omni_grpo.data.spec`` serve these names where the data always had them.
"""

from __future__ import annotations

import glob as globlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

# Every field a row may carry; ``data.columns`` renames source columns onto these. The list
# columns ``images``/``audios``/``videos`` (TRL / verl convention) are the alternative to ``media``.
ROW_FIELDS: tuple[str, ...] = (
    "id",
    "prompt",
    "label",
    "media",
    "images",
    "audios",
    "videos",
    "choices",
    "reward",
    "modality",
    "metadata",
    "use_audio_in_video",
)


class DataError(ValueError):
    """A dataset file or row is invalid; the message names the file and row. ``reason`` is the
    skip counter key when the lenient loader skips the row instead."""

    def __init__(self, message: str, reason: str = "invalid") -> None:
        super().__init__(message)
        self.reason = reason


# One path (file, glob, ``save_to_disk`` dir) or a list of them.
Spec = str | os.PathLike[str] | list[str | os.PathLike[str]] | list[Path]
PARQUET_MAGIC = b"PAR1"


def expand_spec(spec: Spec) -> list[Path]:
    """The files / dirs a ``data.train`` value names (globs expanded, sorted), in order."""
    items = spec if isinstance(spec, list) else [spec]
    out: list[Path] = []
    for it in items:
        s = os.fspath(it)
        if globlib.has_magic(s):
            hits = sorted(globlib.glob(s))
            if not hits:
                raise DataError(f"no dataset file matches {s}")
            out.extend(Path(h) for h in hits)
        else:
            out.append(Path(s))
    if not out:
        raise DataError("no dataset file given (an empty list)")
    return out


def arrow_files(path: Path) -> list[Path]:
    """The Arrow shards of a ``datasets.save_to_disk`` directory, in ``state.json``'s order."""
    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        raise DataError(
            f"{path} is a DatasetDict with splits {splits}; point data.train / data.eval "
            f"at one split's directory (e.g. {path / (splits[0] if splits else 'train')})"
        )
    state = path / "state.json"
    files = sorted(path.glob("*.arrow"))
    if state.is_file():
        try:
            files = [path / f["filename"] for f in json.loads(state.read_text())["_data_files"]]
        except (ValueError, KeyError, TypeError) as err:
            raise DataError(f"{state}: not a datasets state.json ({err!r})") from None
    if not files:
        raise DataError(f"{path}: a directory without state.json or *.arrow files")
    return files


def missing_column_error(where: Path, fld: str, column: str, have: Iterable[str]) -> DataError:
    """``data.columns`` maps ``fld`` onto ``column`` but ``where`` has no such column."""
    names = ", ".join(sorted(have)) or "none"
    return DataError(
        f"{where}: data.columns.{fld} names the column {column!r}, which it does not have "
        f"(its columns: {names}); fix the mapping or remove data.columns.{fld}",
        "config",
    )


def table_schemas(path: Path) -> list[tuple[Path, Any]]:
    """(file, Arrow schema) of each table a dataset path holds, read from headers and footers
    only; a jsonl / json file, or one that cannot be read (the loader names it), gives none."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if path.is_dir():
            files = arrow_files(path)
        elif path.suffix.lower() in (".arrow", ".feather"):
            files = [path]
        else:
            with path.open("rb") as f:
                parquet = path.suffix.lower() in (".parquet", ".pq") or f.read(4) == PARQUET_MAGIC
            return [(path, pq.read_schema(str(path)))] if parquet else []
        out = []
        for f in files:
            try:
                schema = pa.ipc.open_stream(str(f)).schema
            except pa.ArrowInvalid:
                schema = pa.ipc.open_file(str(f)).schema
            out.append((f, schema))
        return out
    except Exception:  # noqa: BLE001 - unreadable: load_rows reports it in its own words
        return []


def check_columns(spec: Spec, columns: dict[str, str]) -> list[str]:
    """Every ``data.columns`` entry whose source column a table of ``spec`` lacks, one message
    each (before a run starts: the loader would refuse the same later, after the model is made)."""
    renamed = {fld: col for fld, col in columns.items() if col != fld}
    if not renamed:
        return []
    problems = []
    for path in expand_spec(spec):
        for where, schema in table_schemas(path):
            problems += [
                str(missing_column_error(where, fld, col, schema.names))
                for fld, col in renamed.items()
                if col not in schema.names
            ]
    return problems

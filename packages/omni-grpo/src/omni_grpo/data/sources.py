"""Where rows come from: jsonl files, parquet files and ``datasets.save_to_disk`` directories.

``data.train`` / ``data.eval`` name a ``.jsonl`` file, a ``.parquet`` file, a glob or a list of
them, or a ``save_to_disk`` directory. Every source yields the same row fields (``id`` optional:
``<file stem>-<row index>``); media come either as ``media`` (our ``{type, path}`` list) or in the
list columns ``images`` / ``audios`` / ``videos`` (the TRL / verl convention), whose items are
paths or the ``datasets`` feature structs ``{bytes, path}``; they are matched to the prompt's
placeholders in order, per type. ``columns`` (``data.columns``) renames source columns onto our
fields, e.g. ``{label: answer, prompt: problem}``.

Rows are validated up front, WITHOUT reading media bytes: parquet is read by row group and only
the ``path`` leaf of a media struct column is read (parquet stores it as its own column chunk),
and a ``save_to_disk`` directory's Arrow files are memory-mapped (zero copy: the bytes stay on
disk until a row's media is decoded). A bad row — not UTF-8, bad JSON, not an object, a missing
or invalid field, a label outside its choices, placeholders that do not match the media, a
duplicate id — is skipped, counted by reason (``skipped_rows``, ``skipped_rows_<reason>``) and
logged (the first few per file, then a summary line); only a file with no usable row is an error,
one line that names it. A UTF-8 BOM at the start of a line is tolerated (Windows editors write
one at the start of a file, ``cat`` puts them mid-file).

Extra columns of a table (parquet / Arrow) are ignored, listed once in the log: published tables
carry many columns we do not use. Extra keys in a jsonl row stay an error (a typo there is local).

Damage inside a file costs the rows it holds, never the run: a parquet row group that cannot be
read (a corrupt page, a bad page header) is a counted skip of all its rows
(``skipped_rows_unreadable_row_group``), named once in the log with its file and row range; the
same group's embedded media found unreadable only when a row is drawn is that row's skip
(``skipped_unreadable_row_group``), again logged once per group. Every Arrow shard of a
``save_to_disk`` directory is read by its own schema (a shard written with other columns is named
once; its rows are validated like any other). A ``data.columns`` entry whose source column a file
does not have is an error naming the field and the file: ignoring it would silently drop the
table's own column of that name. What a spec names and the columns its tables carry (read from
headers alone, for the config's pre-flight check as well) are ``omni_grpo.dataset_spec``'s.
"""

from __future__ import annotations

import bisect
import json
import logging
import mmap
import os
from collections import Counter, OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omni_grpo.data.media import MediaError
from omni_grpo.data.schema import (
    MEDIA_COLUMNS,
    PLACEHOLDER,
    ROW_FIELDS,
    DataError,
    DatasetRow,
    parse_row,
)
from omni_grpo.data.spec import (
    PARQUET_MAGIC,
    Spec,
    arrow_files,
    expand_spec,
    missing_column_error,
)
from omni_grpo.types import Sample

log = logging.getLogger(__name__)

BOM = b"\xef\xbb\xbf"
LOGGED_PER_FILE = 5  # skipped rows logged one by one per file; the rest go into the summary line
# Bytes of (row group, media column) reads a parquet source keeps (the newest one always): parquet
# reads a column chunk whole, so a sequential pass reads each group once, and a shuffled one
# re-reads groups it has evicted. Write tables with small row groups (``tables.py`` bounds them).
ROW_GROUP_CACHE_BYTES = 64 << 20
OPEN_SOURCES = 8  # parquet files kept open (with their cache) while fetching media


@dataclass
class RawRecord:
    """One row as read, before validation: ``obj`` or a ``problem`` = (reason, message)."""

    where: str
    index: int  # row index within its file (0-based; the jsonl line number - 1)
    obj: dict[str, Any] | None = None
    problem: tuple[str, str] | None = None
    # media columns of a table: column -> per item (path, present); bytes stay unread until needed
    embedded: dict[str, list[tuple[str | None, bool]]] = field(default_factory=dict)
    rows: int = 1  # how many rows a ``problem`` stands for (a whole unreadable row group)


# ------------------------------------------------------------------------------------------ jsonl
def jsonl_records(path: Path) -> Iterator[RawRecord]:
    """Lines of a jsonl file as records; a line that is not UTF-8, not JSON or not an object is a
    record with a ``problem`` naming the file and the 1-based line."""
    if not path.is_file():
        raise DataError(f"dataset file not found: {path}")
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            raw = raw.removeprefix(BOM)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                bad = raw[err.start : err.start + 4]
                yield RawRecord(
                    where,
                    lineno - 1,
                    problem=("not_utf8", f"{where}: not UTF-8 (byte {err.start}: {bad!r})"),
                )
                continue
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                yield RawRecord(
                    where,
                    lineno - 1,
                    problem=(
                        "bad_json",
                        f"{where}: not valid JSON: {err.msg} (column {err.colno})",
                    ),
                )
                continue
            except RecursionError:  # nesting deeper than the decoder's stack
                yield RawRecord(
                    where, lineno - 1, problem=("bad_json", f"{where}: JSON nested too deeply")
                )
                continue
            if not isinstance(obj, dict):
                yield RawRecord(
                    where,
                    lineno - 1,
                    problem=(
                        "not_object",
                        f"{where}: expected a JSON object, got {type(obj).__name__}",
                    ),
                )
                continue
            yield RawRecord(where, lineno - 1, obj=obj)


def _one_line(err: BaseException) -> str:
    """An exception's message on one line (pyarrow's span several)."""
    text = "; ".join(line.strip() for line in str(err).splitlines() if line.strip())
    return text or type(err).__name__


class JsonlSource:
    """A jsonl file; media are files (no embedded bytes)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.name = path.stem

    def records(self, columns: dict[str, str]) -> Iterator[RawRecord]:
        """The file's records; a renamed column that no row of the file carries is an error
        (raised after the last row: a jsonl file has no schema to check up front)."""
        renamed = {fld: col for fld, col in columns.items() if col != fld}
        seen: set[str] = set()
        keys: set[str] = set()
        for rec in self._raw_records():
            if rec.obj is not None and renamed:
                keys.update(rec.obj)
                seen.update(col for col in renamed.values() if col in rec.obj)
            yield rec
        for fld, col in renamed.items():
            if col not in seen and keys:
                raise missing_column_error(self.path, fld, col, keys)

    def _raw_records(self) -> Iterator[RawRecord]:
        return jsonl_records(self.path)

    def fetch(self, row: int, column: str, item: int) -> bytes | None:  # pragma: no cover
        raise DataError(f"{self.path}: jsonl rows have no embedded media")


class JsonListSource(JsonlSource):
    """A ``.json`` file holding one JSON list of row objects (how Video-R1 and many others ship);
    read whole, which is fine for rows whose media are files."""

    def _raw_records(self) -> Iterator[RawRecord]:
        try:
            data = json.loads(self.path.read_bytes().removeprefix(BOM).decode("utf-8"))
        except UnicodeDecodeError as err:
            raise DataError(f"{self.path}: not UTF-8 (byte {err.start})") from None
        except json.JSONDecodeError as err:
            raise DataError(
                f"{self.path}: not valid JSON: {err.msg} (line {err.lineno}, column {err.colno})"
            ) from None
        except RecursionError:
            raise DataError(f"{self.path}: JSON nested too deeply") from None
        if not isinstance(data, list):
            raise DataError(f"{self.path}: expected a JSON list of rows, got {type(data).__name__}")
        for i, obj in enumerate(data):
            where = f"{self.path} item {i}"
            if isinstance(obj, dict):
                yield RawRecord(where, i, obj=obj)
            else:
                msg = f"{where}: expected a JSON object, got {type(obj).__name__}"
                yield RawRecord(where, i, problem=("not_object", msg))


# ------------------------------------------------------------------------------------------ tables
def _media_kind(arrow_type: Any) -> tuple[str, bool] | None:
    """(``list``|``single``, whether its structs carry a ``path`` field) for a column of
    ``{bytes, path}`` structs or a list of them; None for any other column."""
    import pyarrow as pa

    kind, t = "single", arrow_type
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        kind, t = "list", t.value_type
    if pa.types.is_struct(t) and t.get_field_index("bytes") >= 0:
        return kind, t.get_field_index("path") >= 0
    return None


def _paths_from_struct_column(arr: Any, kind: str) -> list[list[tuple[str | None, bool]] | None]:
    """Per row, ``(path, present)`` of each item of a struct / list-of-struct column, no bytes
    touched (``present`` is False for a null item); None for a null cell."""
    if kind == "single":
        structs, lengths = arr, None
    else:
        structs, lengths = arr.flatten(), arr.value_lengths().to_pylist()
    idx = structs.type.get_field_index("path")
    paths = structs.flatten()[idx].to_pylist() if idx >= 0 else [None] * len(structs)
    items = list(zip(paths, structs.is_valid().to_pylist(), strict=True))
    if lengths is None:
        return [[it] if it[1] else None for it in items]
    out: list[list[tuple[str | None, bool]] | None] = []
    pos = 0
    for n in lengths:
        if n is None:
            out.append(None)
            continue
        out.append(items[pos : pos + n])
        pos += n
    return out


class _TableSource:
    """Shared row assembly of parquet and Arrow sources: plain columns as Python values, media
    struct columns as per-item paths with the bytes left where they are."""

    path: Path
    name: str
    schema: Any  # pyarrow.Schema

    def _plan(
        self, columns: dict[str, str], schema: Any = None, where: Path | None = None
    ) -> tuple[list[str], dict[str, tuple[str, bool]]]:
        """(plain columns to read, embedded media column -> its kind) for ``schema`` (default:
        the source's), read from ``where``. A renamed column the schema lacks is an error."""
        schema = self.schema if schema is None else schema
        where = self.path if where is None else where
        for fld, col in columns.items():
            if col != fld and col not in schema.names:
                raise missing_column_error(where, fld, col, schema.names)
        wanted = {columns.get(f, f) for f in ROW_FIELDS} | {"uid"}
        present = [n for n in schema.names if n in wanted]
        unused = [n for n in schema.names if n not in wanted]
        if unused:
            log.info("%s: columns not used: %s", where, ", ".join(unused))
        media_cols = {columns.get(f, f) for f in MEDIA_COLUMNS}
        embedded: dict[str, tuple[str, bool]] = {}
        plain: list[str] = []
        for n in present:
            kind = _media_kind(schema.field(n).type) if n in media_cols else None
            if kind is not None:
                embedded[n] = kind
            else:
                plain.append(n)
        return plain, embedded

    def _records(
        self,
        start: int,
        plain: dict[str, list[Any]],
        media: dict[str, list[Any]],
        n: int,
        label: str = "",
    ) -> Iterator[RawRecord]:
        for i in range(n):
            index = start + i
            obj = {k: v[i] for k, v in plain.items()}
            emb = {k: v[i] for k, v in media.items() if v[i] is not None}
            yield RawRecord(f"{self.path} row {index}{label}", index, obj=obj, embedded=emb)


def schema_difference(first: Any, other: Any) -> str:
    """How ``other`` differs from ``first`` (two Arrow schemas), in a few words."""
    a, b = set(first.names), set(other.names)
    parts = []
    if a - b:
        parts.append(f"missing columns: {', '.join(sorted(a - b))}")
    if b - a:
        parts.append(f"extra columns: {', '.join(sorted(b - a))}")
    retyped = [n for n in sorted(a & b) if first.field(n).type != other.field(n).type]
    if retyped:
        parts.append(f"other types: {', '.join(retyped)}")
    return "; ".join(parts) or "other metadata"


class ParquetSource(_TableSource):
    """A parquet file, read one row group at a time; embedded media read per row on demand."""

    def __init__(self, path: Path) -> None:
        self.path, self.name = path, path.stem
        self._file: Any = None
        self._cache: OrderedDict[tuple[int, str], Any] = OrderedDict()
        # row groups found unreadable: index -> the one-line reason (they are not read again)
        self.bad_groups: dict[int, str] = {}
        meta = self.file.metadata
        self.schema = self.file.schema_arrow
        self.starts = [0]
        for rg in range(meta.num_row_groups):
            self.starts.append(self.starts[-1] + meta.row_group(rg).num_rows)
        self.leaves = [self.file.schema.column(i).path for i in range(meta.num_columns)]

    @property
    def file(self) -> Any:
        """The open ``ParquetFile`` (reopened after ``close``: a glob of many shards must not
        hold a descriptor per shard)."""
        if self._file is None:
            import pyarrow.parquet as pq

            try:
                # Plain reads, not a memory map: mapped pages would count in RSS as the file is
                # streamed; read buffers are freed with the row group. pre_buffer coalesces a
                # column chunk into one read (20x faster on large binary chunks than the stream).
                self._file = pq.ParquetFile(str(self.path), memory_map=False, pre_buffer=True)
            except Exception as err:
                raise DataError(f"{self.path}: not a readable parquet file: {err}") from None
        return self._file

    def close(self) -> None:
        """Drop the file handle and the cached row groups (reopened on the next fetch)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        self._cache.clear()

    def _leaf(self, column: str, field_name: str) -> str | None:
        for leaf in self.leaves:
            if leaf.startswith(column + ".") and leaf.rsplit(".", 1)[-1] == field_name:
                return leaf
        return None

    def group_rows(self, rg: int) -> str:
        """``rows a-b`` of row group ``rg`` (0-based, inclusive), for messages."""
        return f"rows {self.starts[rg]}-{self.starts[rg + 1] - 1}"

    def _bad_group(self, rg: int, err: BaseException, what: str) -> str:
        """Mark row group ``rg`` unreadable (it is not read again); returns the one message that
        names it, which the caller logs once (the dataset logs each distinct skip message once)."""
        return self.bad_groups.setdefault(
            rg,
            f"{self.path}: row group {rg} ({self.group_rows(rg)}) is unreadable ({what}: "
            f"{_one_line(err)}); its rows are skipped",
        )

    def records(self, columns: dict[str, str]) -> Iterator[RawRecord]:
        plain, embedded = self._plan(columns)
        for rg in range(len(self.starts) - 1):
            n = self.starts[rg + 1] - self.starts[rg]
            try:
                cols = list(plain)
                for c, (_, has_path) in embedded.items():
                    cols.append(self._leaf(c, "path") if has_path else c)
                table = self.file.read_row_group(rg, columns=cols)
                values = {c: table.column(c).to_pylist() for c in plain}
                media = {
                    c: _paths_from_struct_column(table.column(c).combine_chunks(), kind)
                    for c, (kind, _) in embedded.items()
                }
            except Exception as err:  # a corrupt page / page header: the group's rows, not the run
                message = self._bad_group(rg, err, "reading its rows")
                log.warning("%s", message)
                yield RawRecord(
                    f"{self.path} row group {rg}",
                    self.starts[rg],
                    problem=("unreadable_row_group", message),
                    rows=n,
                )
                continue
            yield from self._records(self.starts[rg], values, media, table.num_rows)

    def fetch(self, row: int, column: str, item: int) -> bytes | None:
        rg = bisect.bisect_right(self.starts, row) - 1
        if rg in self.bad_groups:
            raise MediaError("unreadable_row_group", self.bad_groups[rg])
        key = (rg, column)
        col = self._cache.get(key)
        if col is None:
            leaf = self._leaf(column, "bytes") or column
            try:
                col = self.file.read_row_group(rg, columns=[leaf]).column(0)
            except DataError:
                raise
            except Exception as err:  # found only now: the media column is read on demand
                message = self._bad_group(rg, err, f"reading {leaf}")
                raise MediaError("unreadable_row_group", message) from None
            self._cache[key] = col
            while len(self._cache) > 1 and (
                sum(c.nbytes for c in self._cache.values()) > ROW_GROUP_CACHE_BYTES
            ):
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return _item_bytes(col[row - self.starts[rg]], item)


def _item_bytes(cell: Any, item: int) -> bytes | None:
    """The ``bytes`` of item ``item`` of a list-of-struct cell (or of a single struct cell)."""
    import pyarrow as pa

    if isinstance(cell, pa.ListScalar | pa.LargeListScalar):
        cell = cell.values[item]
    value = cell["bytes"] if isinstance(cell, pa.StructScalar) else cell
    return value.as_py()


def _map_arrow(path: Path) -> tuple[mmap.mmap, Any]:
    """``path`` memory-mapped and read as an Arrow IPC stream (what ``datasets`` writes) or file
    (feather v2), zero copy: the table's buffers are slices of the mapping."""
    import pyarrow as pa

    try:
        with path.open("rb") as fh:
            mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        buf = pa.py_buffer(mapped)
        try:
            table = pa.ipc.open_stream(pa.BufferReader(buf)).read_all()
        except pa.ArrowInvalid:
            table = pa.ipc.open_file(pa.BufferReader(buf)).read_all()
    except Exception as err:
        raise DataError(f"{path}: not a readable Arrow stream or file: {err}") from None
    return mapped, table


class ArrowDirSource(_TableSource):
    """A ``datasets.save_to_disk`` directory: its Arrow IPC stream files, memory-mapped (Python's
    ``mmap``, so the pages a fetch touched can be released with ``madvise``)."""

    def __init__(self, path: Path) -> None:
        self.path, self.name = path, path.stem if path.is_file() else path.name
        files = [path] if path.is_file() else arrow_files(path)
        self.files = files
        self.tables = []
        self.maps: list[mmap.mmap] = []
        for f in files:
            mapped, table = _map_arrow(f)
            self.tables.append(table)
            self.maps.append(mapped)
        self.schema = self.tables[0].schema
        self.starts = [0]
        for t in self.tables:
            self.starts.append(self.starts[-1] + t.num_rows)

    def records(self, columns: dict[str, str]) -> Iterator[RawRecord]:
        """Every shard by its own schema: ``datasets`` writes one schema for all of them, but a
        directory assembled from shards of different saves may not (named once in the log)."""
        for k, (t, start) in enumerate(zip(self.tables, self.starts, strict=False)):
            where = self.files[k]
            if k and not t.schema.equals(self.schema):
                log.warning(
                    "%s: another schema than %s (%s): its rows are read and checked by its own schema",
                    where,
                    self.files[0].name,
                    schema_difference(self.schema, t.schema),
                )
            plain, embedded = self._plan(columns, t.schema, where)
            label = f" ({where.name})" if len(self.files) > 1 else ""
            for batch in t.to_batches(max_chunksize=1024):
                values = {c: batch.column(c).to_pylist() for c in plain}
                media = {
                    c: _paths_from_struct_column(batch.column(c), kind)
                    for c, (kind, _) in embedded.items()
                }
                yield from self._records(start, values, media, batch.num_rows, label)
                start += batch.num_rows

    def fetch(self, row: int, column: str, item: int) -> bytes | None:
        k = bisect.bisect_right(self.starts, row) - 1
        data = _item_bytes(self.tables[k].column(column)[row - self.starts[k]], item)
        # The item is copied out; let go of the mapped pages it touched, or the process's RSS
        # would grow to the file's size over an epoch (they stay in the page cache).
        if hasattr(mmap, "MADV_DONTNEED"):
            self.maps[k].madvise(mmap.MADV_DONTNEED)
        return data


# --------------------------------------------------------------------------------------- opening
def open_source(path: Path) -> JsonlSource | ParquetSource | ArrowDirSource:
    """The reader for one path: a directory is a ``save_to_disk`` dataset, ``.parquet`` (or a file
    starting with parquet's magic) is parquet, ``.arrow`` / ``.feather`` one Arrow file (e.g. a
    ``datasets`` cache file), a ``.json`` file starting with ``[`` a JSON list of rows, anything
    else is read as jsonl."""
    if path.is_dir():
        return ArrowDirSource(path)
    if not path.is_file():
        raise DataError(f"dataset file not found: {path}")
    if path.suffix.lower() in (".parquet", ".pq"):
        return ParquetSource(path)
    if path.suffix.lower() in (".arrow", ".feather"):
        return ArrowDirSource(path)
    with path.open("rb") as f:
        head = f.read(4)
    if head == PARQUET_MAGIC:
        return ParquetSource(path)
    if path.suffix.lower() == ".json" and head.removeprefix(BOM[:3]).lstrip()[:1] == b"[":
        return JsonListSource(path)
    return JsonlSource(path)


# ---------------------------------------------------------------------------------- normalising
def _media_items(value: Any, column: str) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, list | tuple) else [value]


def normalise(rec: RawRecord, columns: dict[str, str], source_name: str) -> tuple[dict, list]:
    """Our row dict from a raw record, plus per media item its blob address ``(column, k)`` or
    None (a file). Raises DataError(reason) for what cannot be a row."""
    obj = dict(rec.obj or {})
    for fld, col in columns.items():  # rename source columns onto our fields
        if col in obj and col != fld:
            obj[fld] = obj.pop(col)
    for optional in ("media", "metadata"):  # a table's null cell means "not given"
        if optional in obj and obj[optional] is None:
            del obj[optional]
    if obj.get("id") is None:  # absent or null: the uid alias, else ``<file stem>-<row index>``
        obj.pop("id", None)
        if obj.get("uid") is None:
            obj.pop("uid", None)
            obj["id"] = f"{source_name}-{rec.index}"
    present = {f: col for f in MEDIA_COLUMNS if (col := columns.get(f, f)) in rec.embedded}
    lists = {f: obj.pop(f) for f in MEDIA_COLUMNS if f in obj}
    blobs: list[tuple[str, int] | None] = []
    if not lists and not present:
        media = obj.get("media")
        return obj, [None] * (len(media) if isinstance(media, list) else 0)
    if obj.get("media"):
        raise DataError(
            f"{rec.where}: both media and images/audios/videos given; use one", "invalid"
        )
    # per type, its items in order: (path or None, blob address or None)
    queue: dict[str, list[tuple[Any, tuple[str, int] | None]]] = {}
    for f, kind in MEDIA_COLUMNS.items():
        items: list[tuple[Any, tuple[str, int] | None]] = []
        if f in present:
            col = present[f]
            for k, (path, ok) in enumerate(rec.embedded[col]):
                if not ok:
                    raise DataError(f"{rec.where}: {col}[{k}] is null", "invalid")
                items.append((path, (col, k)))
        elif f in lists:
            for k, it in enumerate(_media_items(lists[f], f)):
                path = it.get("path") if isinstance(it, dict) else it
                if isinstance(it, dict) and it.get("bytes") is not None:
                    raise DataError(f"{rec.where}: {f}[{k}] has bytes; jsonl media are files")
                if not isinstance(path, str) or not path:
                    raise DataError(f"{rec.where}: {f}[{k}] is not a media path: {it!r}")
                items.append((path, None))
        queue[kind] = items
    wanted = PLACEHOLDER.findall(str(obj.get("prompt", "")))
    have = {t: len(v) for t, v in queue.items() if v}
    need = dict(Counter(wanted))
    if have != need:
        raise DataError(
            f"{rec.where}: prompt placeholders {need or {}} do not match media items {have or {}}",
            "placeholder_mismatch",
        )
    media: list[dict[str, str]] = []
    cursor = dict.fromkeys(queue, 0)
    for t in wanted:
        path, blob = queue[t][cursor[t]]
        cursor[t] += 1
        name = path if isinstance(path, str) and path else f"{blob[0]}[{blob[1]}]"
        media.append({"type": t, "path": name})
        blobs.append(blob)
    obj["media"] = media
    return obj, blobs


# ------------------------------------------------------------------------------------- loading
@dataclass
class LoadedRows:
    """The usable rows of a split, what was skipped, and how to fetch embedded media."""

    samples: list[Sample]
    skipped: Counter[str]
    sources: list[Any]
    _open: OrderedDict[int, None] = field(default_factory=OrderedDict)  # sources with a handle

    def counters(self) -> dict[str, int]:
        """``skipped_rows`` and ``skipped_rows_<reason>`` (only when something was skipped)."""
        total = sum(self.skipped.values())
        if not total:
            return {}
        return {"skipped_rows": total, **{f"skipped_rows_{k}": v for k, v in self.skipped.items()}}

    def fetch(self, item: dict[str, Any]) -> bytes | None:
        """The bytes of an embedded item; a read that fails is that row's ``MediaError`` (the
        dataset skips and counts it), whatever the reader raised."""
        src, row, column, k = item["blob"]
        self._open[src] = None
        self._open.move_to_end(src)
        while len(self._open) > OPEN_SOURCES:
            old, _ = self._open.popitem(last=False)
            getattr(self.sources[old], "close", lambda: None)()
        source = self.sources[src]
        try:
            return source.fetch(row, column, k)
        except MediaError:
            raise
        except Exception as err:  # a file changed or damaged since it was validated
            raise MediaError(
                "unreadable", f"{source.path} row {row}: {column}[{k}] unreadable: {_one_line(err)}"
            ) from None


@dataclass
class _FileTally:
    """Skips of one file: counted by reason, the first few logged, the first one kept for the
    error when nothing in the file is usable."""

    path: Path
    strict: bool
    skips: Counter[str] = field(default_factory=Counter)
    first: str | None = None
    kept: int = 0

    def skip(self, reason: str, message: str, rows: int = 1) -> None:
        """Count ``rows`` skipped rows; a multi-row skip (a row group) was logged by its reader."""
        if self.strict:
            raise DataError(message, reason)
        self.skips[reason] += rows
        self.first = self.first or message
        if rows == 1 and self.skipped <= LOGGED_PER_FILE:
            log.warning("skipping row (%s): %s", reason, message)

    @property
    def skipped(self) -> int:
        return sum(self.skips.values())

    def detail(self) -> str:
        return ", ".join(f"{k} {v}" for k, v in sorted(self.skips.items()))

    def finish(self) -> None:
        """One line for the file: an error when no row is usable, else a summary of the skips."""
        if self.kept == 0:
            why = f"{self.skipped} skipped: {self.detail()}; first: {self.first}"
            raise DataError(f"{self.path}: no usable row ({why if self.skipped else 'empty'})")
        if self.skipped:
            log.warning(
                "%s: %d rows used, %d skipped (%s)",
                self.path,
                self.kept,
                self.skipped,
                self.detail(),
            )


def load_rows(
    spec: Spec, columns: dict[str, str] | None = None, strict: bool = False
) -> LoadedRows:
    """Read and validate every row of ``spec`` (see the module docstring); media not decoded.
    ``strict``: the first bad row raises its DataError instead of being skipped."""
    from omni_grpo.rewards import available_rewards

    columns = dict(columns or {})
    known: list[frozenset[str]] = []

    def rewards_known() -> frozenset[str]:  # read once, and only if a row names a reward
        if not known:
            known.append(frozenset(available_rewards()))
        return known[0]

    samples: list[Sample] = []
    skipped: Counter[str] = Counter()
    seen: dict[str, str] = {}
    sources: list[Any] = []
    for src_index, path in enumerate(expand_spec(spec)):
        source = open_source(path)
        sources.append(source)
        tally = _FileTally(path, strict)
        for rec in source.records(columns):
            if rec.problem is not None:
                tally.skip(*rec.problem, rows=rec.rows)
                continue
            try:
                obj, blobs = normalise(rec, columns, source.name)
                row = parse_row(obj, rec.where)
            except DataError as err:
                tally.skip(err.reason, str(err))
                continue
            if row.reward is not None and row.reward not in rewards_known():
                # Else the first draw of this row would end the run with UnknownPluginError.
                tally.skip(
                    "unknown_reward",
                    f"{rec.where}: reward {row.reward!r} is not a registered reward "
                    f"(known: {', '.join(sorted(rewards_known()))})",
                )
                continue
            if row.id in seen:
                tally.skip(
                    "duplicate_id",
                    f"{rec.where}: duplicate id {row.id!r} (first at {seen[row.id]})",
                )
                continue
            seen[row.id] = rec.where
            sample = row.to_sample()
            for item, blob in zip(sample.media, blobs, strict=True):
                if blob is not None:
                    item["blob"] = (src_index, rec.index, blob[0], blob[1])
            samples.append(sample)
            tally.kept += 1
        getattr(source, "close", lambda: None)()  # reopened when a row's media is fetched
        tally.finish()
        skipped.update(tally.skips)
    return LoadedRows(samples, skipped, sources)


def iter_rows(path: str | os.PathLike[str]) -> Iterator[DatasetRow]:
    """Stream validated rows from a jsonl file, STRICTLY: the first bad row raises DataError.

    For checking a file a tool wrote; training reads through the lenient ``read_samples``.
    """
    for rec in jsonl_records(Path(path)):
        if rec.problem is not None:
            raise DataError(rec.problem[1], rec.problem[0])
        yield parse_row(rec.obj, rec.where)


def read_samples(
    path: str | os.PathLike[str] | list[str | os.PathLike[str]],
    columns: dict[str, str] | None = None,
    strict: bool = False,
) -> list[Sample]:
    """All usable rows of a dataset (jsonl, parquet, glob, list, datasets dir) as Samples, media
    NOT decoded. Bad rows are skipped and counted (``strict``: the first one raises); a file
    with no usable row raises. See :func:`load_rows`."""
    return load_rows(path, columns, strict=strict).samples

"""Damaged inputs as they occur in practice, for fault tests: a parquet file with one corrupt data
page (a bad sector, a partial upload patched by a sync tool), a file cut short (a copy or a save
interrupted by a kill), a ``save_to_disk`` directory whose shards were written by saves with
different columns."""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def corrupt_parquet_page(src: Path, dst: Path, row_group: int, column: str) -> Path:
    """``src`` copied to ``dst`` with the first data page header of ``column`` (a leaf path such
    as ``prompt`` or ``images.list.element.bytes``) in ``row_group`` overwritten with garbage:
    pyarrow then fails on that column chunk with ``Couldn't deserialize thrift``, as it does on
    a real corrupt page; every other row group still reads."""
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(str(src)).metadata
    group = meta.row_group(row_group)
    chunks = [group.column(c) for c in range(group.num_columns)]
    chunk = next((c for c in chunks if c.path_in_schema == column), None)
    if chunk is None:
        have = [c.path_in_schema for c in chunks]
        raise ValueError(f"{src}: no column {column!r} in row group {row_group} (have {have})")
    data = bytearray(Path(src).read_bytes())
    offset = chunk.data_page_offset
    data[offset : offset + 16] = b"\xff" * 16
    Path(dst).write_bytes(bytes(data))
    return Path(dst)


def truncate_file(path: Path, keep: float = 0.5) -> Path:
    """Cut ``path`` to ``keep`` of its size in place (what an interrupted copy leaves)."""
    size = Path(path).stat().st_size
    with open(path, "r+b") as f:
        f.truncate(int(size * keep))
    return Path(path)


def merge_save_to_disk(first: Path, second: Path, dst: Path) -> Path:
    """One ``save_to_disk`` directory holding ``first``'s Arrow shards then ``second``'s, with
    ``first``'s ``state.json`` / ``dataset_info.json``: the layout of a dataset assembled from
    the shards of two saves (whose schemas may differ)."""
    dst.mkdir(parents=True, exist_ok=True)
    names = []
    for k, shard in enumerate([*sorted(first.glob("*.arrow")), *sorted(second.glob("*.arrow"))]):
        name = f"data-{k:05d}.arrow"
        shutil.copy(shard, dst / name)
        names.append(name)
    for side in ("dataset_info.json",):
        if (first / side).is_file():
            shutil.copy(first / side, dst / side)
    state = json.loads((first / "state.json").read_text())
    state["_data_files"] = [{"filename": n} for n in names]
    (dst / "state.json").write_text(json.dumps(state))
    return dst

"""Hub-format data damage (issue 30): a corrupt parquet page costs the rows of its row group —
skipped, counted, the file and row group named once in the log — whether it is found while the
rows are validated or only when a row's embedded media is read; a ``save_to_disk`` directory
whose shards carry different schemas is read shard by shard; a ``data.columns`` entry naming a
column a file lacks is a one-line error naming the field and the file, never a silent rename
that drops the table's own column."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from omni_grpo.config import ConfigError, load_config
from omni_grpo.data.dataset import OmniDataset
from omni_grpo.data.media import MediaError
from omni_grpo.data.prompt import PromptBuilder
from omni_grpo.data.schema import DataError
from omni_grpo.data.sources import load_rows
from omni_grpo.testing.damage import corrupt_parquet_page, merge_save_to_disk

ITEM = pa.struct([("bytes", pa.binary()), ("path", pa.string())])


def _rows(n: int, start: int = 0) -> list[dict[str, Any]]:
    return [
        {
            "id": f"r{i}",
            "prompt": f"<image> question {i}",
            "label": "A",
            "choices": ["x", "y"],
            "images": [{"bytes": f"img{i}".encode() * 50, "path": None}],
        }
        for i in range(start, start + n)
    ]


def _parquet(path: Path, rows: list[dict[str, Any]], group: int = 4) -> Path:
    schema = pa.schema(
        [
            ("id", pa.string()),
            ("prompt", pa.string()),
            ("label", pa.string()),
            ("choices", pa.list_(pa.string())),
            ("images", pa.list_(ITEM)),
        ]
    )
    pq.write_table(pa.Table.from_pylist(rows, schema), path, row_group_size=group)
    return path


def test_a_corrupt_page_skips_and_counts_its_row_group(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    good = _parquet(tmp_path / "good.parquet", _rows(12))
    bad = corrupt_parquet_page(good, tmp_path / "bad.parquet", 1, "prompt")
    with caplog.at_level(logging.WARNING):
        loaded = load_rows(bad)
    assert [s.uid for s in loaded.samples] == [f"r{i}" for i in (0, 1, 2, 3, 8, 9, 10, 11)]
    assert loaded.counters() == {"skipped_rows": 4, "skipped_rows_unreadable_row_group": 4}
    named = [r.message for r in caplog.records if "row group 1" in r.message]
    assert len(named) == 1 and str(bad) in named[0] and "rows 4-7" in named[0], caplog.text
    with pytest.raises(DataError, match="row group 1"):  # strict readers still stop on it
        load_rows(bad, strict=True)


class _MediaOnlyBuilder:
    """Stands in for ``PromptBuilder``: reads each embedded item's bytes, as ``build`` does."""

    data = None

    def build(self, sample: Any, root: Path, blobs: Any) -> Any:
        return [PromptBuilder.source(item, root, blobs) for item in sample.media]


def test_a_corrupt_media_page_found_when_drawn_is_a_counted_skip(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    good = _parquet(tmp_path / "good.parquet", _rows(12))
    bad = corrupt_parquet_page(good, tmp_path / "bad.parquet", 2, "images.list.element.bytes")
    ds = OmniDataset(bad, tmp_path, _MediaOnlyBuilder())  # type: ignore[arg-type]
    assert len(ds) == 12  # validation never reads the bytes column
    with caplog.at_level(logging.WARNING):
        loaded = [ds.load(i) for i in range(12)]
    assert [i for i, x in enumerate(loaded) if x is None] == [8, 9, 10, 11]
    assert loaded[0] == [b"img0" * 50]
    assert ds.stats()["skipped_unreadable_row_group"] == 4 and ds.stats()["loaded"] == 8
    named = [r.message for r in caplog.records if "row group 2" in r.message]
    assert len(named) == 1 and str(bad) in named[0] and "rows 8-11" in named[0], caplog.text
    with pytest.raises(MediaError, match="row group 2"):  # not read again, the same message
        ds.loaded.fetch(ds.samples[9].media[0])  # type: ignore[union-attr]


def test_save_to_disk_shards_with_another_schema_are_read_shard_by_shard(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    datasets = pytest.importorskip("datasets")
    plain = [{k: v for k, v in r.items() if k != "images"} for r in _rows(6)]
    for r in plain:
        r["prompt"] = r["prompt"].removeprefix("<image> ")
    datasets.Dataset.from_list(plain[:3]).save_to_disk(str(tmp_path / "a"))
    renamed = [{"answer" if k == "label" else k: v for k, v in r.items()} for r in plain[3:]]
    datasets.Dataset.from_list(renamed).save_to_disk(str(tmp_path / "b"))
    mixed = merge_save_to_disk(tmp_path / "a", tmp_path / "b", tmp_path / "mixed")
    with caplog.at_level(logging.WARNING):
        loaded = load_rows(mixed)
    assert [s.uid for s in loaded.samples] == ["r0", "r1", "r2"]
    assert loaded.counters() == {"skipped_rows": 3, "skipped_rows_missing_field": 3}
    assert "missing columns: label; extra columns: answer" in caplog.text
    assert "data-00001.arrow" in caplog.text  # the odd shard is named
    # with data.columns mapping label onto `answer`, the FIRST shard lacks it: named, one line
    with pytest.raises(DataError) as info:
        load_rows(mixed, {"label": "answer"})
    assert "data-00000.arrow: data.columns.label names the column 'answer'" in str(info.value)
    # a shard that only adds a column loses nothing
    extra = [{**r, "note": "x"} for r in plain[3:]]
    datasets.Dataset.from_list(extra).save_to_disk(str(tmp_path / "c"))
    wider = merge_save_to_disk(tmp_path / "a", tmp_path / "c", tmp_path / "wider")
    assert len(load_rows(wider).samples) == 6


def test_a_renamed_column_the_file_lacks_is_one_line_naming_the_field(tmp_path: Path) -> None:
    table = _parquet(tmp_path / "t.parquet", _rows(2))
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text(
        "".join(
            json.dumps({"prompt": "q", "label": "A", "choices": ["x", "y"]}) + "\n" for _ in "ab"
        )
    )
    for path in (table, jsonl):
        with pytest.raises(DataError) as info:
            load_rows(path, {"choices": "options"})
        msg = str(info.value)
        assert msg.startswith(f"{path}: data.columns.choices names the column 'options'"), msg
        assert "remove data.columns.choices" in msg and "\n" not in msg
    # the config check refuses it before the run prepares anything
    with pytest.raises(ConfigError, match=r"data\.columns\.choices names the column 'options'"):
        from omni_grpo.config import check_paths

        check_paths(
            load_config(
                None,
                [
                    f"run.dir={tmp_path / 'run'}",
                    "data.synthetic=null",
                    f"data.train={table}",
                    "data.columns={choices: options}",
                    "model.make_tiny={}",
                ],
            )
        )

"""Row sources: parquet (file, glob, list), ``save_to_disk`` dirs and jsonl give the same rows;
media as ``media`` or as ``images``/``audios``/``videos`` lists of ``{bytes, path}`` matched to the
placeholders in order per type; ``data.columns`` renames; bad rows skipped and counted exactly as
for jsonl; only a file with no usable row is an error, one line naming it."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from omni_grpo.config import DataConfig
from omni_grpo.data.schema import DataError
from omni_grpo.data.sources import load_rows

ITEM = pa.struct([("bytes", pa.binary()), ("path", pa.string())])


def _table(rows: list[dict], media_cols: tuple[str, ...] = ("images", "audios")) -> pa.Table:
    fields = [
        (k, pa.list_(ITEM) if k in media_cols else None)
        for k in dict.fromkeys(k for r in rows for k in r)
    ]
    schema = pa.schema(
        [
            (
                k,
                t
                if t is not None
                else pa.Table.from_pylist([{k: r.get(k)} for r in rows]).schema.field(k).type,
            )
            for k, t in fields
        ]
    )
    return pa.Table.from_pylist(rows, schema)


def _parquet(path: Path, rows: list[dict], row_group_size: int = 2) -> Path:
    pq.write_table(_table(rows), path, row_group_size=row_group_size)
    return path


ROWS = [
    {
        "prompt": "<audio> then <image> and <image>",
        "label": "B",
        "choices": ["x", "y"],
        "images": [{"bytes": b"img0", "path": "a.png"}, {"bytes": b"img1", "path": None}],
        "audios": [{"bytes": b"aud0", "path": "a.wav"}],
    },
    {"prompt": "text only", "label": "A", "choices": ["x", "y"], "images": [], "audios": []},
    {
        "prompt": "<image>",
        "label": "A",
        "choices": ["x", "y"],
        "images": [{"bytes": None, "path": "files/on_disk.png"}],
        "audios": None,
    },
]


def test_parquet_embedded_media_matched_in_order_and_fetched(tmp_path: Path) -> None:
    loaded = load_rows(_parquet(tmp_path / "d.parquet", ROWS))
    a, b, c = loaded.samples
    assert [s.uid for s in loaded.samples] == ["d-0", "d-1", "d-2"]  # <file stem>-<row index>
    assert [m["type"] for m in a.media] == ["audio", "image", "image"]
    assert [loaded.fetch(m) for m in a.media] == [b"aud0", b"img0", b"img1"]
    assert a.media[2]["path"] == "images[1]" and a.modality == "mixed"
    assert b.media == [] and b.modality == "text"
    assert loaded.fetch(c.media[0]) is None and c.media[0]["path"] == "files/on_disk.png"
    assert not loaded.counters()


def test_glob_list_and_duplicate_ids_across_files(tmp_path: Path) -> None:
    rows = [{**r, "id": f"r{i}"} for i, r in enumerate(ROWS)]
    _parquet(tmp_path / "part-0.parquet", rows[:2])
    _parquet(tmp_path / "part-1.parquet", [rows[2], rows[0]])  # r0 again
    for spec in (
        str(tmp_path / "part-*.parquet"),
        [tmp_path / "part-0.parquet", tmp_path / "part-1.parquet"],
    ):
        loaded = load_rows(spec)
        assert [s.uid for s in loaded.samples] == ["r0", "r1", "r2"]
        assert loaded.counters() == {"skipped_rows": 1, "skipped_rows_duplicate_id": 1}
        third = loaded.samples[2].media[0]
        assert loaded.fetch(third) is None  # file 1, row 0: bytes null -> its path is used
    with pytest.raises(DataError, match="no dataset file matches"):
        load_rows(str(tmp_path / "nope-*.parquet"))


def test_save_to_disk_dir_with_hf_features(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    rows = ROWS[:2]  # save_to_disk embeds local files: it would look for ROWS[2]'s
    ds = datasets.Dataset(_table(rows))
    features = ds.features.copy()
    features["images"] = datasets.List(datasets.Image())
    features["audios"] = datasets.List(datasets.Audio())
    ds.cast(features).save_to_disk(str(tmp_path / "hf"))
    from_dir = load_rows(tmp_path / "hf")
    from_pq = load_rows(_parquet(tmp_path / "hf.parquet", rows))
    assert [s.media for s in from_dir.samples] == [s.media for s in from_pq.samples]
    assert [from_dir.fetch(m) for m in from_dir.samples[0].media] == [b"aud0", b"img0", b"img1"]
    dd = datasets.DatasetDict({"train": ds, "test": ds})
    dd.save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match="DatasetDict with splits .*train.*dd/train"):
        load_rows(tmp_path / "dd")


def test_columns_rename(tmp_path: Path) -> None:
    rows = [
        {
            "problem": "<image> q",
            "answer": "A",
            "options": ["x", "y"],
            "pics": [{"bytes": b"i", "path": "p"}],
            "extra": 1,
        }
    ]
    path = tmp_path / "renamed.parquet"
    pq.write_table(_table(rows, media_cols=("pics",)), path)
    columns = {"prompt": "problem", "label": "answer", "choices": "options", "images": "pics"}
    (s,) = load_rows(path, columns).samples
    assert (s.prompt, s.label, s.choices) == ("<image> q", "A", ["x", "y"])
    assert s.media[0]["type"] == "image"
    cfg = DataConfig(train=path, columns=columns)
    assert cfg.columns == columns and cfg.root == path.parent if cfg.root else True
    with pytest.raises(ValueError, match="unknown row field"):
        DataConfig(columns={"lable": "answer"})
    jsonl = tmp_path / "renamed.jsonl"
    jsonl.write_text(json.dumps({"problem": "2+2", "answer": "4", "reward": "math"}) + "\n")
    assert load_rows(jsonl, {"prompt": "problem", "label": "answer"}).samples[0].label == "4"


BAD_PARQUET_ROWS: list[tuple[dict, str]] = [
    ({"label": None}, "invalid"),
    ({"prompt": "<image><image>"}, "placeholder_mismatch"),
    ({"label": "C"}, "bad_label"),
    ({"label": ""}, "bad_label"),
    ({"id": "same"}, "duplicate_id"),
    ({"images": [None]}, "invalid"),
    ({"images": None}, "placeholder_mismatch"),
]


@pytest.mark.parametrize(("change", "reason"), BAD_PARQUET_ROWS)
def test_bad_parquet_row_skipped_and_counted(tmp_path: Path, change: dict, reason: str) -> None:
    good = {
        "id": "same",
        "prompt": "<image>",
        "label": "A",
        "choices": ["x", "y"],
        "images": [{"bytes": b"i", "path": None}],
        "audios": [],
    }
    rows = [good, {**good, "id": "bad", **change}, {**good, "id": "last"}]
    loaded = load_rows(_parquet(tmp_path / "b.parquet", rows))
    assert [s.uid for s in loaded.samples] == ["same", "last"]
    assert loaded.counters() == {"skipped_rows": 1, f"skipped_rows_{reason}": 1}


def test_parquet_with_no_usable_row_or_unreadable_is_one_line(tmp_path: Path) -> None:
    p = _parquet(
        tmp_path / "none.parquet", [{"prompt": "<image>", "label": "A", "images": [], "audios": []}]
    )
    with pytest.raises(DataError) as ei:
        load_rows(p)
    assert str(ei.value).startswith(f"{p}: no usable row (1 skipped: placeholder_mismatch 1")
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"PAR1 this is not really parquet")
    with pytest.raises(DataError, match="not a readable parquet file") as ei:
        load_rows(broken)
    assert "\n" not in str(ei.value) and str(broken) in str(ei.value)
    # a parquet file under a .jsonl name is still read as parquet (by its magic bytes)
    disguised = tmp_path / "disguised.jsonl"
    _parquet(disguised, ROWS)
    assert len(load_rows(disguised).samples) == 3


def test_jsonl_media_lists_of_paths(tmp_path: Path) -> None:
    row = {
        "id": "j",
        "prompt": "<image><audio>",
        "label": "4",
        "images": ["i.png"],
        "audios": [{"path": "a.wav"}],
    }
    p = tmp_path / "l.jsonl"
    p.write_text(
        json.dumps(row)
        + "\n"
        + json.dumps({**row, "id": "k", "images": [{"bytes": "x", "path": "i"}]})
        + "\n"
    )
    loaded = load_rows(p)
    assert loaded.samples[0].media == [
        {"type": "image", "path": "i.png"},
        {"type": "audio", "path": "a.wav"},
    ]
    assert loaded.counters() == {"skipped_rows": 1, "skipped_rows_invalid": 1}


def test_config_accepts_lists_globs_and_dirs(tmp_path: Path) -> None:
    from omni_grpo.config import load_config

    rows = [{**r, "id": f"r{i}"} for i, r in enumerate(ROWS[:2])]
    _parquet(tmp_path / "a.parquet", rows[:1])
    _parquet(tmp_path / "b.parquet", rows[1:])
    cfg = load_config(None, [f"data.train=[{tmp_path}/a.parquet, {tmp_path}/b.parquet]"])
    assert cfg.data.train == [tmp_path / "a.parquet", tmp_path / "b.parquet"]
    assert cfg.data.root == tmp_path  # the first file's directory
    assert [s.uid for s in load_rows(cfg.data.train).samples] == ["r0", "r1"]
    cfg = load_config(None, [f"data.train={tmp_path}/*.parquet", "data.columns={label: answer}"])
    assert cfg.data.columns == {"label": "answer"} and cfg.data.root == tmp_path
    (tmp_path / "hf").mkdir()
    assert load_config(None, [f"data.train={tmp_path}/hf"]).data.root == tmp_path / "hf"


def test_many_shards_keep_few_files_open(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import omni_grpo.data.sources as sources

    monkeypatch.setattr(sources, "OPEN_SOURCES", 2)
    for k in range(5):
        _parquet(tmp_path / f"shard-{k}.parquet", [{**ROWS[0], "id": f"s{k}"}])
    loaded = load_rows(str(tmp_path / "shard-*.parquet"))
    assert all(src._file is None for src in loaded.sources)  # closed after the scan
    for s in [*loaded.samples, *reversed(loaded.samples)]:
        assert loaded.fetch(s.media[0]) == b"aud0"
        assert sum(src._file is not None for src in loaded.sources) <= 2


def test_broken_save_to_disk_dir_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "state.json").write_text('{"nope": 1}')
    with pytest.raises(DataError, match="not a datasets state.json"):
        load_rows(tmp_path / "d")
    (tmp_path / "e").mkdir()
    with pytest.raises(DataError, match="without state.json or \\*.arrow"):
        load_rows(tmp_path / "e")
    (tmp_path / "f").mkdir()
    (tmp_path / "f" / "data.arrow").write_bytes(b"not arrow")
    with pytest.raises(DataError, match="not a readable Arrow stream or file"):
        load_rows(tmp_path / "f")


def test_single_arrow_files_stream_and_file_format(tmp_path: Path) -> None:
    table = _table(ROWS[:2])
    with (
        pa.OSFile(str(tmp_path / "s.arrow"), "wb") as sink,
        pa.ipc.new_stream(sink, table.schema) as w,
    ):
        w.write_table(table)
    with (
        pa.OSFile(str(tmp_path / "f.feather"), "wb") as sink,
        pa.ipc.new_file(sink, table.schema) as w,
    ):
        w.write_table(table)
    for name in ("s.arrow", "f.feather"):
        loaded = load_rows(tmp_path / name)
        assert [s.uid for s in loaded.samples] == [
            f"{name.split('.')[0]}-0",
            f"{name.split('.')[0]}-1",
        ]
        assert loaded.fetch(loaded.samples[0].media[2]) == b"img1"


def test_json_list_file(tmp_path: Path) -> None:
    rows = [
        {"id": "a", "prompt": "2+2", "label": 4, "reward": "math"},
        7,
        {"prompt": "x", "label": "y"},
    ]
    p = tmp_path / "rows.json"
    p.write_text(json.dumps(rows, indent=2))
    loaded = load_rows(p)
    assert [s.uid for s in loaded.samples] == ["a", "rows-2"]
    assert loaded.counters() == {"skipped_rows": 1, "skipped_rows_not_object": 1}
    p.write_text("[{broken")
    with pytest.raises(DataError, match="rows.json: not valid JSON"):
        load_rows(p)

"""Row format validation: errors name the file and line; atomic writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omni_grpo.data.schema import DataError, iter_rows, read_samples, write_rows


def _jsonl(tmp_path: Path, rows: list) -> Path:
    p = tmp_path / "rows.jsonl"
    p.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return p


GOOD = {
    "id": "a",
    "prompt": "<image> what?",
    "label": "A",
    "media": [{"type": "image", "path": "x.png"}],
    "choices": ["x", "y"],
}


def test_good_rows_and_defaults(tmp_path: Path) -> None:
    p = _jsonl(
        tmp_path,
        [
            GOOD,
            {
                "uid": 7,
                "prompt": "<audio><video>",
                "label": "B",
                "media": [{"type": "audio", "path": "a.wav"}, {"type": "video", "path": "v.mp4"}],
            },
            "",
            {"id": "t", "prompt": "2+2", "label": "4", "reward": "math"},
        ],
    )
    s = read_samples(p)
    assert [x.uid for x in s] == ["a", "7", "t"]
    assert [x.modality for x in s] == ["image", "mixed", "text"]
    assert s[0].media == [{"type": "image", "path": "x.png"}] and s[0].reward == "mcq"


@pytest.mark.parametrize(
    ("row", "fragment"),
    [
        ({**GOOD, "prompt": "what?"}, "placeholders [] do not match media types ['image']"),
        ({**GOOD, "prompt": "<audio>"}, "placeholders ['audio'] do not match"),
        ({**GOOD, "media": [{"type": "gif", "path": "x"}]}, "media.0.type"),
        ({**GOOD, "media": [{"type": "image"}]}, "media.0.path: Field required"),
        ({k: v for k, v in GOOD.items() if k != "label"}, "label: Field required"),
        ({**GOOD, "labels": "A"}, "labels: Extra inputs are not permitted"),
        ([1, 2], "expected a JSON object, got list"),
        ('{"id": "x", ', "not valid JSON"),
    ],
)
def test_bad_row_names_file_and_line(tmp_path: Path, row, fragment: str) -> None:
    p = _jsonl(tmp_path, [GOOD | {"id": "first"}, row])
    with pytest.raises(DataError) as ei:
        list(iter_rows(p))
    msg = str(ei.value)
    assert f"{p}:2:" in msg and fragment in msg


def test_duplicate_ids_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="duplicate id 'a' \\(rows 1 and 2\\)"):
        read_samples(_jsonl(tmp_path, [GOOD, GOOD]))
    with pytest.raises(DataError, match="not found"):
        read_samples(tmp_path / "none.jsonl")


def test_write_rows_atomic(tmp_path: Path) -> None:
    out = tmp_path / "sub" / "out.jsonl"
    assert write_rows(out, [GOOD]) == 1
    before = out.read_text()
    with pytest.raises(DataError, match="row 2"):
        write_rows(out, [GOOD, {**GOOD, "prompt": "no placeholder"}])
    assert out.read_text() == before  # the old file is untouched
    assert [p.name for p in out.parent.iterdir()] == ["out.jsonl"]  # no temp file left behind

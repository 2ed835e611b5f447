"""Row format validation: errors name the file and line; a bad row is skipped and counted by
reason, only a file with no usable row is an error; labels outside their choices are refused;
atomic writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omni_grpo.data import DataError, iter_rows, read_samples, write_rows
from omni_grpo.data.sources import load_rows


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
    assert s[0].media == [{"type": "image", "path": "x.png"}]
    # rows that name no reward leave it to rewards.by_modality / rewards.default
    assert [x.reward for x in s] == [None, None, "math"]


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
    loaded = load_rows(_jsonl(tmp_path, [GOOD, GOOD | {"label": "B"}]))
    assert [s.label for s in loaded.samples] == ["A"]  # the first one is kept
    assert loaded.counters() == {"skipped_rows": 1, "skipped_rows_duplicate_id": 1}
    with pytest.raises(DataError, match="duplicate id 'a'"):
        read_samples(_jsonl(tmp_path, [GOOD, GOOD]), strict=True)
    with pytest.raises(DataError, match="not found"):
        read_samples(tmp_path / "none.jsonl")


BAD_ROWS: list[tuple[object, str]] = [
    ({k: v for k, v in GOOD.items() if k != "label"}, "missing_field"),
    ('{"id": "x", ', "bad_json"),
    ([1, 2], "not_object"),
    ({**GOOD, "prompt": "no placeholder"}, "placeholder_mismatch"),
    ({**GOOD, "label": "C"}, "bad_label"),  # two choices: A or B
    ({**GOOD, "label": "  "}, "bad_label"),
    ({**GOOD, "label": "x", "reward": "mcq"}, "bad_label"),  # mcq scores letters only
    ({**GOOD, "choices": []}, "bad_label"),
    ({**GOOD, "labels": "A"}, "invalid"),
    ({**GOOD, "id": "dup"}, "duplicate_id"),
    # re-probed (issue 15, item 8/9): other bad rows
    ({**GOOD, "choices": ["x", " x"]}, "bad_label"),  # two letters, one answer
    ({**GOOD, "reward": "no-such-reward"}, "unknown_reward"),  # would end the run when drawn
    ('{"id": "n", "prompt": "<image> q", "label": NaN, "media": []}', "bad_label"),
    ({**GOOD, "id": float("inf")}, "invalid"),
    ("[" * 50_000 + "]" * 50_000, "bad_json"),  # nested past the decoder's stack
]


@pytest.mark.parametrize(("row", "reason"), BAD_ROWS)
def test_one_bad_row_is_skipped_and_counted(tmp_path: Path, row: object, reason: str) -> None:
    """Every class of bad row costs that row only: counted by reason, the rest loads."""
    good = [GOOD | {"id": "dup"}, GOOD | {"id": "b", "label": "B"}]
    loaded = load_rows(_jsonl(tmp_path, [good[0], row, good[1]]))
    assert [s.uid for s in loaded.samples] == ["dup", "b"]
    assert loaded.counters() == {"skipped_rows": 1, f"skipped_rows_{reason}": 1}


def test_labels_among_choices_accepted(tmp_path: Path) -> None:
    rows = [
        GOOD | {"id": "1", "label": "(b)"},  # the forms the mcq reward normalises
        GOOD | {"id": "2", "label": "y", "reward": "answer_tag"},  # a choice's text
        {"id": "3", "prompt": "2+2", "label": "4", "reward": "math"},
        {"id": "4", "prompt": "2+2", "label": 4, "reward": "math"},  # a number is its text
    ]
    loaded = load_rows(_jsonl(tmp_path, rows))
    assert [s.label for s in loaded.samples][2:] == ["4", "4"]


def test_bom_tolerated_and_ids_default(tmp_path: Path) -> None:
    p = tmp_path / "bom.jsonl"
    body = json.dumps({k: v for k, v in GOOD.items() if k != "id"})
    p.write_bytes(b"\xef\xbb\xbf" + body.encode() + b"\n\xef\xbb\xbf" + body.encode() + b"\n")
    loaded = load_rows(p)
    assert [s.uid for s in loaded.samples] == ["bom-0", "bom-1"] and not loaded.counters()
    null_id = _jsonl(tmp_path, [GOOD | {"id": None}])
    assert read_samples(null_id)[0].uid == "rows-0"


def test_not_utf8_names_file_and_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    p = tmp_path / "latin1.jsonl"
    p.write_bytes(
        json.dumps(GOOD).encode()
        + b"\n"
        + json.dumps(GOOD | {"id": "\u00e9"}).encode("latin-1").replace(b"\\u00e9", b"\xe9")
        + b"\n"
    )
    loaded = load_rows(p)
    assert loaded.counters() == {"skipped_rows": 1, "skipped_rows_not_utf8": 1}
    assert f"{p}:2: not UTF-8" in caplog.text
    whole = tmp_path / "utf16.jsonl"
    whole.write_text(json.dumps(GOOD) + "\n", encoding="utf-16")
    with pytest.raises(DataError) as ei:
        load_rows(whole)
    msg = str(ei.value)
    assert msg.startswith(f"{whole}: no usable row") and "\n" not in msg and ":1:" in msg


def test_file_with_no_usable_row_is_one_line(tmp_path: Path) -> None:
    p = _jsonl(tmp_path, [{"id": "x"}, '{"broken'])
    with pytest.raises(DataError) as ei:
        load_rows(p)
    msg = str(ei.value)
    assert msg.startswith(f"{p}: no usable row (2 skipped: bad_json 1, missing_field 1; first:")
    assert "\n" not in msg
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataError, match="no usable row \\(empty\\)"):
        load_rows(empty)


def test_write_rows_atomic(tmp_path: Path) -> None:
    out = tmp_path / "sub" / "out.jsonl"
    assert write_rows(out, [GOOD]) == 1
    before = out.read_text()
    with pytest.raises(DataError, match="row 2"):
        write_rows(out, [GOOD, {**GOOD, "prompt": "no placeholder"}])
    assert out.read_text() == before  # the old file is untouched
    assert [p.name for p in out.parent.iterdir()] == ["out.jsonl"]  # no temp file left behind

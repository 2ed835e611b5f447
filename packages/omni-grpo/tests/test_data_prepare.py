"""prepare-data avqa / video-r1 on small files in the real layouts (R1-AQA jsonl, Video-R1 json)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from omni_grpo.cli import main
from omni_grpo.data import DataError, read_samples
from omni_grpo.data.prepare import prepare_avqa, prepare_video_r1

# R1-AQA's documented record layout (AVQA fields + dataset_name + audio_path); answer is a 0-based index.
AVQA = [
    {
        "id": 183,
        "video_name": "-HG3Omg_89c_000030",
        "video_id": 341,
        "question_text": "What happened in the video?",
        "multi_choice": ["motorboat", "Yacht consignment", "Sailboat set sail", "Consignment car"],
        "answer": 1,
        "question_relation": "View",
        "question_type": "Happening",
        "dataset_name": "AVQA",
        "audio_path": "wav/-HG3Omg_89c_30.wav",
    },
    {
        "id": 184,
        "video_name": "abc_000010",
        "video_id": 342,
        "question_text": "Which instrument is heard in the video?",
        "multi_choice": ["piano", "violin", "drum", "flute"],
        "answer": 3,
        "question_relation": "Both",
        "question_type": "Which",
        "dataset_name": "AVQA",
        "audio_path": "wav/abc_10.wav",
    },
    {
        "id": 185,
        "video_name": "gone_000000",
        "video_id": 343,
        "question_text": "What is it?",
        "multi_choice": ["a", "b", "c", "d"],
        "answer": 0,
        "question_relation": "View",
        "question_type": "What",
        "dataset_name": "AVQA",
        "audio_path": "wav/gone.wav",
    },
]

# Video-R1-260k's record layout.
VIDEO_R1 = [
    {
        "problem_id": 1,
        "problem": "Based on the figure, what role does the quartz cylinder play?",
        "data_type": "image",
        "problem_type": "multiple choice",
        "options": [
            "A) It focuses the laser",
            "B) It is the weight",
            "C) It insulates",
            "D) A medium",
        ],
        "solution": "<answer>D</answer>",
        "path": "./Knowledge/ArxivQA/images/1702.04756_0.jpg",
        "data_source": "",
    },
    {
        "problem_id": 2,
        "problem": "What appears on the screen during the ascent?",
        "data_type": "video",
        "problem_type": "multiple choice",
        "options": ["A. A notification", "B. A command", "C. A warning", "D. A weather update"],
        "solution": "<answer>A</answer>",
        "path": "./LLaVA-Video-178K/videos/ytb_7nRmsEw7nsE.mp4",
        "data_source": "LLaVA-Video-178K/30_60_s_youtube_v0_1",
    },
    {
        "problem_id": 3,
        "problem": "How many cars pass by?",
        "data_type": "video",
        "problem_type": "numerical",
        "options": [],
        "solution": "<think>count</think><answer>3</answer>",
        "path": "./CLEVRER/video_1.mp4",
        "data_source": "CLEVRER",
    },
    {
        "problem_id": 4,
        "problem": "What is the woman wearing?",
        "data_type": "image",
        "problem_type": "free-form",
        "options": [],
        "solution": "<answer>Wetsuit</answer>",
        "path": "./Spatial/Spacellava/image_11755.png",
        "data_source": "Spacellava",
    },
    {
        "problem_id": 5,
        "problem": "Missing video",
        "data_type": "video",
        "problem_type": "numerical",
        "options": [],
        "solution": "<answer>2</answer>",
        "path": "./CLEVRER/absent.mp4",
        "data_source": "CLEVRER",
    },
    {
        "problem_id": 6,
        "problem": "No tag",
        "data_type": "video",
        "problem_type": "numerical",
        "options": [],
        "solution": "2",
        "path": "./CLEVRER/video_1.mp4",
        "data_source": "CLEVRER",
    },
]


def _touch(root: Path, *rels: str) -> None:
    for rel in rels:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"")


@pytest.fixture
def avqa_src(tmp_path: Path) -> Path:
    _touch(tmp_path, "wav/-HG3Omg_89c_30.wav", "wav/abc_10.wav")
    src = tmp_path / "train_r1aqa.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in AVQA))
    return src


@pytest.fixture
def video_r1_src(tmp_path: Path) -> Path:
    _touch(
        tmp_path,
        "Knowledge/ArxivQA/images/1702.04756_0.jpg",
        "LLaVA-Video-178K/videos/ytb_7nRmsEw7nsE.mp4",
        "CLEVRER/video_1.mp4",
        "Spatial/Spacellava/image_11755.png",
    )
    src = tmp_path / "Video-R1-260k.json"
    src.write_text(json.dumps(VIDEO_R1, indent=2))
    return src


def test_avqa(avqa_src: Path, tmp_path: Path) -> None:
    out = tmp_path / "out" / "avqa.jsonl"
    stats = prepare_avqa(avqa_src, out)
    assert stats == {"kept": 2, "written": 2, "dropped_missing_media": 1}
    rows = read_samples(out)
    r = rows[0]
    assert r.uid == "avqa-183" and r.label == "B" and r.modality == "audio" and r.reward == "mcq"
    assert r.media == [{"type": "audio", "path": "wav/-HG3Omg_89c_30.wav"}]
    assert r.prompt.startswith(
        "<audio>\nWhat happened in the audio?\nA. motorboat\nB. Yacht consignment\n"
    )
    assert r.choices == AVQA[0]["multi_choice"] and r.metadata["choices"] == AVQA[0]["multi_choice"]
    assert (
        r.metadata["answer_text"] == "Yacht consignment"
        and r.metadata["question_type"] == "Happening"
    )
    assert rows[1].label == "D"
    assert prepare_avqa(avqa_src, tmp_path / "all.jsonl", check_media=False)["written"] == 3


def test_avqa_bad_answer_names_record(avqa_src: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({**AVQA[0], "answer": 4}) + "\n")
    out = tmp_path / "o.jsonl"
    with pytest.raises(
        DataError, match="record 1 \\(id 183\\): answer 4 is not an index into 4 choices"
    ):
        prepare_avqa(bad, out)
    assert not out.exists()


def test_avqa_absolute_paths_outside_root(avqa_src: Path, tmp_path: Path) -> None:
    src = tmp_path / "abs.jsonl"
    rec = {**AVQA[0], "audio_path": str(tmp_path / "wav/-HG3Omg_89c_30.wav")}
    src.write_text(
        json.dumps(rec)
        + "\n"
        + json.dumps({**rec, "id": 9, "audio_path": "/elsewhere/x.wav"})
        + "\n"
    )
    stats = prepare_avqa(src, tmp_path / "o.jsonl")
    assert stats["kept"] == 1 and stats["dropped_outside_root"] == 1
    assert read_samples(tmp_path / "o.jsonl")[0].media[0]["path"] == "wav/-HG3Omg_89c_30.wav"


def test_video_r1(video_r1_src: Path, tmp_path: Path) -> None:
    out = tmp_path / "vr1.jsonl"
    stats = prepare_video_r1(video_r1_src, out)
    assert stats == {
        "kept": 4,
        "written": 4,
        "dropped_missing_media": 1,
        "dropped_no_answer_tag": 1,
    }
    rows = {r.uid: r for r in read_samples(out)}
    img = rows["video-r1-1"]
    assert img.modality == "image" and img.label == "D" and img.reward == "mcq"
    assert img.media == [{"type": "image", "path": "Knowledge/ArxivQA/images/1702.04756_0.jpg"}]
    assert img.choices == ["It focuses the laser", "It is the weight", "It insulates", "A medium"]
    assert "Options:\nA) It focuses the laser" in img.prompt and img.prompt.startswith("<image>\n")
    num = rows["video-r1-3"]
    assert (
        num.label == "3"
        and num.reward == "answer_tag"
        and num.prompt.startswith("<video>\nHow many")
    )
    assert "<answer> </answer>" in num.prompt and num.metadata["data_source"] == "CLEVRER"
    assert rows["video-r1-4"].label == "Wetsuit"


def test_video_r1_filters(video_r1_src: Path, tmp_path: Path) -> None:
    s = prepare_video_r1(
        video_r1_src,
        tmp_path / "v.jsonl",
        data_types=["video"],
        source_prefixes=["LLaVA-Video", "CLEVRER"],
    )
    assert s["kept"] == 2 and s["dropped_data_type_image"] == 2
    assert {r.uid for r in read_samples(tmp_path / "v.jsonl")} == {"video-r1-2", "video-r1-3"}
    s = prepare_video_r1(video_r1_src, tmp_path / "m.jsonl", problem_types=["multiple choice"])
    assert s["kept"] == 2 and s["dropped_problem_type"] == 4


def test_cli_prepare_data(video_r1_src: Path, avqa_src: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    res = runner.invoke(main, ["prepare-data", "--help"])
    assert res.exit_code == 0 and "avqa" in res.output and "video-r1" in res.output
    out = tmp_path / "cli.jsonl"
    res = runner.invoke(
        main, ["prepare-data", "video-r1", str(video_r1_src), str(out), "--data-type", "video"]
    )
    assert res.exit_code == 0, res.output
    assert f"wrote 2 rows to {out}" in res.output and "dropped_missing_media: 1" in res.output
    res = runner.invoke(main, ["prepare-data", "avqa", str(avqa_src), str(tmp_path / "a.jsonl")])
    assert res.exit_code == 0 and "wrote 2 rows" in res.output
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": 1}) + "\n")
    res = runner.invoke(main, ["prepare-data", "avqa", str(bad), str(tmp_path / "b.jsonl")])
    assert res.exit_code == 1 and "missing field(s)" in res.output


def _avqa_file(tmp_path: Path, records: list) -> Path:
    src = tmp_path / "records.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    return src


def test_avqa_bad_records_dropped_and_counted(avqa_src: Path, tmp_path: Path) -> None:
    """Duplicate ids, null ids, bad answers, escaping paths: each costs its record, counted by
    reason; the usable ones are written."""
    good, other = AVQA[0], AVQA[1]
    src = _avqa_file(
        tmp_path,
        [
            good,
            {**good, "question_text": "again?"},  # duplicate id 183
            {**other, "id": None},  # never "avqa-None"
            {**other, "id": 7, "answer": 9},
            {**other, "id": 8, "audio_path": "../outside.wav"},  # escapes, existing or not
            other,
        ],
    )
    (tmp_path.parent / "outside.wav").write_bytes(b"")
    problems: dict[str, str] = {}
    stats = prepare_avqa(src, tmp_path / "o.jsonl", check_media=False, problems=problems)
    assert stats == {
        "kept": 2,
        "written": 2,
        "dropped_duplicate_id": 1,
        "dropped_missing_field": 1,
        "dropped_bad_answer": 1,
        "dropped_outside_root": 1,
    }
    assert [r.uid for r in read_samples(tmp_path / "o.jsonl")] == ["avqa-183", "avqa-184"]
    assert "outside the root" in problems["outside_root"] and "'id'" in problems["missing_field"]


@pytest.mark.parametrize(
    "choices", ['["motorboat", "yacht", "sail", "car"]', "['motorboat', 'yacht', 'sail', 'car']"]
)
def test_avqa_string_choices_parsed_not_split(tmp_path: Path, choices: str) -> None:
    (tmp_path / "wav").mkdir()
    src = _avqa_file(tmp_path, [{**AVQA[0], "multi_choice": choices}])
    prepare_avqa(src, tmp_path / "o.jsonl", check_media=False)
    (row,) = read_samples(tmp_path / "o.jsonl")
    assert row.choices == ["motorboat", "yacht", "sail", "car"] and row.label == "B"
    bad = _avqa_file(tmp_path, [{**AVQA[0], "multi_choice": "motorboat"}])
    with pytest.raises(DataError, match="no usable record.*choices are not a non-empty list"):
        prepare_avqa(bad, tmp_path / "b.jsonl", check_media=False)
    assert not (tmp_path / "b.jsonl").exists()  # nothing written for nothing usable


def test_prepare_reads_and_writes_parquet(avqa_src: Path, tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    src = tmp_path / "avqa.parquet"
    pq.write_table(pa.Table.from_pylist(AVQA), src)
    out = tmp_path / "rows.parquet"
    stats = prepare_avqa(src, out)
    assert stats == {"kept": 2, "written": 2, "dropped_missing_media": 1}
    from_jsonl = tmp_path / "rows.jsonl"
    prepare_avqa(avqa_src, from_jsonl)
    assert read_samples(out) == read_samples(from_jsonl)  # same Samples either way
    assert pq.ParquetFile(out).schema_arrow.field("media").type.value_type.names == ["type", "path"]


def test_cli_parquet_embeds_media(tmp_path: Path) -> None:
    from omni_grpo.data.sources import load_rows

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "a.wav").write_bytes(b"RIFF fake wav")
    rows = [
        {
            "id": "a",
            "prompt": "<audio>",
            "label": "A",
            "media": [{"type": "audio", "path": "m/a.wav"}],
        },
        {"id": "a", "prompt": "dup", "label": "A"},
    ]
    src = tmp_path / "rows.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.parquet"
    res = CliRunner().invoke(main, ["prepare-data", "parquet", str(src), str(out)])
    assert res.exit_code == 0, res.output
    assert f"wrote 1 rows to {out}" in res.output and "skipped_rows_duplicate_id: 1" in res.output
    loaded = load_rows(out)
    (s,) = loaded.samples
    assert s.media[0]["path"] == "m/a.wav" and loaded.fetch(s.media[0]) == b"RIFF fake wav"
    src.write_text(json.dumps({**rows[0], "media": [{"type": "audio", "path": "../x.wav"}]}) + "\n")
    res = CliRunner().invoke(main, ["prepare-data", "parquet", str(src), str(out)])
    assert res.exit_code == 1 and "outside the dataset root" in res.output
    assert "Traceback" not in res.output


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"audio_path": "wav/a.wav\x00"}, "bad_path"),  # was: the whole conversion failed
        ({"id": {"x": 1}}, "bad_id"),  # never an id like "avqa-{'x': 1}"
        ({"id": [1]}, "bad_id"),
        ({"id": True}, "bad_id"),
        ({"question_text": ["what?"]}, "bad_field"),  # never "['what?']" in the prompt
        ({"question_text": "   "}, "bad_field"),
        ({"audio_path": ["wav/a.wav"]}, "bad_field"),
        ({"multi_choice": [None, "cat", "dog", "cow"]}, "bad_choices"),  # never "A. None"
        ({"multi_choice": ["", "cat", "dog", "cow"]}, "bad_choices"),
        ({"multi_choice": ["cat", "cat", "dog", "cow"]}, "bad_label"),  # two letters, one answer
    ],
)
def test_avqa_other_bad_records_are_dropped_and_counted(
    tmp_path: Path, change: dict, reason: str
) -> None:
    other = {**AVQA[1], "id": 999}
    src = _avqa_file(tmp_path, [{**AVQA[0], **change}, other])
    stats = prepare_avqa(src, tmp_path / "o.jsonl", check_media=False)
    assert stats == {"kept": 1, "written": 1, f"dropped_{reason}": 1}


def test_video_r1_non_text_fields_are_dropped_not_a_crash(
    video_r1_src: Path, tmp_path: Path
) -> None:
    records = json.loads(video_r1_src.read_text())
    records[0] = {**records[0], "data_type": ["video"]}  # was: unhashable type 'list'
    src = tmp_path / "v.json"
    src.write_text(json.dumps(records))
    stats = prepare_video_r1(src, tmp_path / "o.jsonl", check_media=False)
    assert stats["dropped_bad_field"] == 1 and stats["written"] >= 1


def test_prepare_counts_the_records_of_an_unreadable_row_group(tmp_path: Path) -> None:
    """Issue 30: a corrupt parquet page drops its row group's records, counted, file and group
    named; the records after it keep their numbers."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from omni_grpo.testing.damage import corrupt_parquet_page

    records = [{**AVQA[k % 2], "id": k} for k in range(9)]
    records[7]["answer"] = 9  # a bad record after the damaged group: still named by its number
    good = tmp_path / "good.parquet"
    pq.write_table(pa.Table.from_pylist(records), good, row_group_size=3)
    bad = corrupt_parquet_page(good, tmp_path / "bad.parquet", 1, "question_text")
    problems: dict[str, str] = {}
    stats = prepare_avqa(bad, tmp_path / "rows.jsonl", check_media=False, problems=problems)
    assert stats == {
        "kept": 5,
        "written": 5,
        "dropped_unreadable_row_group": 3,
        "dropped_bad_answer": 1,
    }
    assert f"{bad}: row group 1 (records 4-6) is unreadable" in problems["unreadable_row_group"]
    assert problems["bad_answer"].startswith("AVQA record 8 ")
    assert [r.uid for r in read_samples(tmp_path / "rows.jsonl")] == [
        f"avqa-{k}" for k in (0, 1, 2, 6, 8)
    ]


@pytest.mark.parametrize("command", ["avqa", "video-r1", "parquet"])
def test_prepare_refuses_an_output_over_its_source(
    avqa_src: Path, tmp_path: Path, command: str
) -> None:
    """Issue 30: OUT equal to SRC (also through a symlink), or inside a SRC directory, is refused
    in one line and the source is untouched."""
    original = avqa_src.read_bytes()
    link = tmp_path / "link.jsonl"
    link.symlink_to(avqa_src)
    cases = [([str(avqa_src)], avqa_src), ([str(avqa_src)], link)]
    if command == "parquet":  # SRC as a glob, and a SRC directory with OUT inside it
        cases += [([str(tmp_path / "*.jsonl")], avqa_src), ([str(tmp_path)], tmp_path / "o.pq")]
    for srcs, out in cases:
        res = CliRunner().invoke(main, ["prepare-data", command, *srcs, str(out)])
        assert res.exit_code == 1, res.output
        assert "Traceback" not in res.output and len(res.output.strip().splitlines()) == 1
        assert f"OUT {out}" in res.output and "choose another OUT" in res.output, res.output
    assert avqa_src.read_bytes() == original and not (tmp_path / "o.pq").exists()

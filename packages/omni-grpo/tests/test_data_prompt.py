"""PromptBuilder and OmniDataset against a tiny Omni checkpoint: placeholder expansion to the
processor's counts, tensors per MM_TENSOR_KEYS, lazy decoding, skipped rows counted."""

from __future__ import annotations

import json
from pathlib import Path

import av
import numpy as np
import pytest
import soundfile as sf
import torch
from omni_grpo.config import DataConfig
from omni_grpo.data.dataset import OmniDataset
from omni_grpo.data.prompt import ModelTokens, PromptBuilder
from omni_grpo.types import MM_TENSOR_KEYS, Sample
from PIL import Image


@pytest.fixture(scope="module")
def media_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("media")
    Image.fromarray(np.full((64, 96, 3), 200, np.uint8)).save(root / "img.png")
    t = np.arange(48000) / 48000  # 1 s at 48 kHz -> 100 mel frames at 16 kHz -> 13 tokens
    sf.write(root / "tone.wav", 0.3 * np.sin(2 * np.pi * 300 * t), 48000)
    with av.open(str(root / "clip.mp4"), "w") as out:
        vs = out.add_stream("mpeg4", rate=8)
        vs.width, vs.height, vs.pix_fmt = 64, 64, "yuv420p"
        for k in range(16):
            img = np.zeros((64, 64, 3), np.uint8)
            img[:, 4 * k : 4 * k + 8] = 255
            for pkt in vs.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                out.mux(pkt)
        for pkt in vs.encode():
            out.mux(pkt)
    (root / "broken.png").write_bytes(b"nope")
    return root


@pytest.fixture(scope="module")
def builder(tiny_omni_dir: Path) -> PromptBuilder:
    return PromptBuilder(tiny_omni_dir, DataConfig(video_fps=2.0, max_frames=8))


def _cfg(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())["thinker_config"]


def test_tokens_from_config(tiny_omni_dir: Path) -> None:
    tc = _cfg(tiny_omni_dir)
    toks = ModelTokens.from_dir(tiny_omni_dir)
    assert (toks.image_token_id, toks.video_token_id, toks.audio_token_id) == (
        tc["image_token_id"],
        tc["video_token_id"],
        tc["audio_token_id"],
    )


def test_mixed_prompt_expansion(
    builder: PromptBuilder, media_root: Path, tiny_omni_dir: Path
) -> None:
    tc = _cfg(tiny_omni_dir)
    s = Sample(
        uid="m1",
        prompt="<audio>Listen. <image> then <video>\nWhich?",
        label="A",
        media=[
            {"type": "audio", "path": "tone.wav"},
            {"type": "image", "path": "img.png"},
            {"type": "video", "path": "clip.mp4"},
        ],
    )
    p = builder.build(s, media_root)
    ids = torch.tensor(p.input_ids)
    # image 64x96 -> grid (1, 4, 6) -> 6 tokens; video 2 s @ 2 fps = 4 frames of 64x64 -> (2, 4, 4) -> 8;
    # audio 1 s -> 100 mel frames -> 13 tokens
    assert p.mm["image_grid_thw"].tolist() == [[1, 4, 6]]
    assert p.mm["video_grid_thw"].tolist() == [[2, 4, 4]]
    assert int((ids == tc["image_token_id"]).sum()) == 6
    assert int((ids == tc["video_token_id"]).sum()) == 8
    assert p.mm["feature_attention_mask"].sum().item() == 100
    assert int((ids == tc["audio_token_id"]).sum()) == 13
    assert p.mm["pixel_values"].shape == (24, 1536) and p.mm["pixel_values_videos"].shape == (
        32,
        1536,
    )
    assert p.mm["input_features"].shape == (1, 128, 100)
    torch.testing.assert_close(p.mm["video_second_per_grid"], torch.tensor([1.0]))  # 2 / 2 fps
    assert set(p.mm) <= set(MM_TENSOR_KEYS)
    # order: audio block before image block before video block, each wrapped by its start/end ids
    first = {
        k: int((ids == tc[k]).nonzero()[0])
        for k in ("audio_token_id", "image_token_id", "video_token_id")
    }
    assert first["audio_token_id"] < first["image_token_id"] < first["video_token_id"]
    a0 = first["audio_token_id"]
    assert (
        p.input_ids[a0 - 1] == tc["audio_start_token_id"]
        and p.input_ids[a0 + 13] == tc["audio_end_token_id"]
    )
    i0 = first["image_token_id"]
    assert (
        p.input_ids[i0 - 1] == tc["vision_start_token_id"]
        and p.input_ids[i0 + 6] == tc["vision_end_token_id"]
    )
    # text survives and the prompt ends with the generation prompt
    text = builder.tokenizer.decode(p.input_ids)
    assert "Listen." in text and "Which?" in text and text.rstrip().endswith("assistant")


def test_expansion_matches_omni_processor_audio_image(
    builder: PromptBuilder, media_root: Path, tiny_omni_dir: Path
) -> None:
    """The reference: transformers' Omni processor cannot be built here (no torchvision), so we check the
    pieces it would use — WhisperFeatureExtractor on the same 16 kHz wave and the modeling module's
    output-length function — give the same features and count."""
    from omni_grpo.data.media import load_audio
    from transformers import WhisperFeatureExtractor
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        _get_feat_extract_output_lengths,
    )

    s = Sample(uid="a", prompt="<audio>", label="A", media=[{"type": "audio", "path": "tone.wav"}])
    p = builder.build(s, media_root)
    fe = WhisperFeatureExtractor(feature_size=128)
    ref = fe(
        load_audio(media_root / "tone.wav"),
        sampling_rate=16000,
        padding=True,
        truncation=False,
        return_attention_mask=True,
        return_tensors="pt",
    )
    torch.testing.assert_close(p.mm["input_features"], ref["input_features"])
    n = int(_get_feat_extract_output_lengths(ref["attention_mask"].sum(-1)).item())
    assert p.input_ids.count(_cfg(tiny_omni_dir)["audio_token_id"]) == n


def test_dataset_lazy_and_counts_skips(
    builder: PromptBuilder, media_root: Path, tmp_path: Path
) -> None:
    rows = [
        {
            "id": "ok",
            "prompt": "<image> colour?",
            "label": "A",
            "media": [{"type": "image", "path": "img.png"}],
        },
        {
            "id": "missing",
            "prompt": "<image>",
            "label": "A",
            "media": [{"type": "image", "path": "nope.png"}],
        },
        {
            "id": "broken",
            "prompt": "<image>",
            "label": "A",
            "media": [{"type": "image", "path": "broken.png"}],
        },
        {
            "id": "escape",
            "prompt": "<audio>",
            "label": "A",
            "media": [{"type": "audio", "path": "../x.wav"}],
        },
        {"id": "text", "prompt": "2+2?", "label": "4", "reward": "math"},
    ]
    f = tmp_path / "rows.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = OmniDataset(f, media_root, builder)
    assert len(ds) == 5 and ds.stats() == {}  # nothing decoded yet
    loaded = ds.load_many(range(5))
    assert [p.sample.uid for p in loaded] == ["ok", "text"]
    assert ds.stats() == {
        "loaded": 2,
        "skipped": 3,
        "skipped_missing": 1,
        "skipped_unreadable": 1,
        "skipped_escape": 1,
    }
    assert loaded[1].mm == {} and ds.sample(4).modality == "text"


def test_template_pad_mismatch_is_named(builder: PromptBuilder, media_root: Path) -> None:
    s = Sample(uid="bad", prompt="<image>", label="A", media=[{"type": "image", "path": "img.png"}])
    with pytest.raises(ValueError, match="sample 'bad'.*pad tokens"):
        builder.expand([1, 2, 3], s, [6])


def test_dataset_from_config(tiny_omni_dir: Path, media_root: Path, tmp_path: Path) -> None:
    f = tmp_path / "train.jsonl"
    f.write_text(
        json.dumps(
            {
                "id": "x",
                "prompt": "<image>?",
                "label": "A",
                "media": [{"type": "image", "path": "img.png"}],
            }
        )
        + "\n"
    )
    ds = OmniDataset.from_config(DataConfig(train=f, root=media_root), tiny_omni_dir)
    assert ds.load(0) is not None and ds.root == media_root
    with pytest.raises(ValueError, match="data.eval is not set"):
        OmniDataset.from_config(DataConfig(train=f), tiny_omni_dir, "eval")


def test_builder_on_extracted_vl_dir_real_vocab(
    tiny_omni_real_vocab_dir: Path, media_root: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The trainer builds prompts from omni-extract's ``vl`` output: ids come from its omni_sideband
    and must be the released ones with the real Qwen3 tokenizer."""
    from omni_extract import extract
    from omni_extract.tokens import REAL_IDS

    vl = tmp_path_factory.mktemp("vl") / "vl"
    extract(tiny_omni_real_vocab_dir, vl, variant="vl")
    b = PromptBuilder(vl, DataConfig())
    toks = ModelTokens.from_dir(vl)
    assert (toks.image_token_id, toks.video_token_id, toks.audio_token_id) == (
        151655,
        151656,
        151675,
    )
    s = Sample(
        uid="r",
        prompt="<audio><image>Which?",
        label="A",
        media=[{"type": "audio", "path": "tone.wav"}, {"type": "image", "path": "img.png"}],
    )
    p = b.build(s, media_root)
    assert (
        p.input_ids.count(toks.audio_token_id) == 13 and p.input_ids.count(toks.image_token_id) == 6
    )
    assert p.input_ids[:1] == [REAL_IDS["im_start_token_id"]]
    assert b.tokenizer.decode(p.input_ids).endswith("Which?<|im_end|>\n<|im_start|>assistant\n")


def test_every_media_failure_is_a_counted_skip(
    builder: PromptBuilder, media_root: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Media that used to crash training (a 160-sample clip inside torch.stft, an image past
    Pillow's bomb limit, an image too elongated to resize) cost their row, counted, one line."""
    import struct
    import zlib
    from io import BytesIO

    root = tmp_path / "m"
    root.mkdir()
    sf.write(root / "short.wav", np.full(160, 0.1, np.float32), 16000)
    buf = BytesIO()
    Image.new("RGB", (1, 1)).save(buf, format="PNG")
    png = bytearray(buf.getvalue())
    ihdr = struct.pack(">II", 30_000, 30_000) + bytes(png[24:29])  # 900 Mpx claimed
    png[16:29], png[29:33] = ihdr, struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    (root / "bomb.png").write_bytes(bytes(png))
    Image.fromarray(np.zeros((2, 500, 3), np.uint8)).save(root / "thin.png")
    Image.fromarray(np.full((64, 64, 3), 90, np.uint8)).save(root / "ok.png")
    rows = [
        ("short", "audio", "short.wav"),
        ("bomb", "image", "bomb.png"),
        ("thin", "image", "thin.png"),
        ("ok", "image", "ok.png"),
    ]
    f = tmp_path / "rows.jsonl"
    f.write_text(
        "".join(
            json.dumps(
                {"id": i, "prompt": f"<{t}>", "label": "A", "media": [{"type": t, "path": p}]}
            )
            + "\n"
            for i, t, p in rows
        )
    )
    ds = OmniDataset(f, root, builder)
    assert [p.sample.uid for p in ds.load_many(range(4))] == ["ok"]
    assert ds.load(0) is None  # a second draw is counted again but not logged again
    assert ds.stats() == {
        "loaded": 1,
        "skipped": 4,
        "skipped_too_short": 2,
        "skipped_too_large": 1,
        "skipped_unreadable": 1,
    }
    lines = [r for r in caplog.records if "skipping row" in r.getMessage()]
    assert len(lines) == 3 and all("\n" not in r.getMessage() for r in lines)


@pytest.mark.parametrize("name", ["audio", "image", "video", "all"])
def test_ablation_blanks_only_its_modality_and_keeps_every_shape(
    builder: PromptBuilder, media_root: Path, name: str
) -> None:
    """An ablated prompt has the same tokens and tensor shapes; only the ablated media's content
    is gone (mid-grey pixels, silent audio), the rest is bit-identical."""
    from omni_grpo.data.ablation import ABLATIONS

    s = Sample(
        uid="m1",
        prompt="<audio>Listen. <image> then <video>\nWhich?",
        label="A",
        media=[
            {"type": "audio", "path": "tone.wav"},
            {"type": "image", "path": "img.png"},
            {"type": "video", "path": "clip.mp4"},
        ],
    )
    plain = builder.build(s, media_root)
    ablated = builder.ablated(name).build(s, media_root)
    assert ablated.input_ids == plain.input_ids
    assert {k: v.shape for k, v in ablated.mm.items()} == {k: v.shape for k, v in plain.mm.items()}
    grey = builder.ablated("image").build(
        Sample(uid="g", prompt="<image>", label="A", media=[{"type": "image", "path": "img.png"}]),
        media_root,
    )
    tensor_of = {
        "image": "pixel_values",
        "video": "pixel_values_videos",
        "audio": "input_features",
    }
    for media_type, key in tensor_of.items():
        same = torch.equal(ablated.mm[key], plain.mm[key])
        assert same is (media_type not in ABLATIONS[name]), (media_type, key)
        if media_type in ABLATIONS[name]:
            x = ablated.mm[key]
            assert float(x.max() - x.min()) < 1e-6, key  # constant: no content left
    # mid-grey is the same constant for images and video frames
    if "video" in ABLATIONS[name]:
        v = float(ablated.mm["pixel_values_videos"][0, 0])
        assert v == pytest.approx(float(grey.mm["pixel_values"][0, 0]), abs=1e-6)
    assert builder.ablate == frozenset()  # the original builder is unchanged


def test_unknown_ablation_is_named(builder: PromptBuilder) -> None:
    with pytest.raises(ValueError, match="unknown ablation 'text'"):
        builder.ablated("text")


def test_ablation_names_match_the_config() -> None:
    import typing

    from omni_grpo.config import AblationName
    from omni_grpo.data.ablation import ABLATIONS

    assert set(typing.get_args(AblationName)) == set(ABLATIONS)


def test_embedded_rows_build_as_files_and_ablate(
    builder: PromptBuilder, media_root: Path, tmp_path: Path
) -> None:
    """A parquet row with embedded bytes builds exactly the inputs of the same row with files;
    a corrupt embedded image is a counted skip; ablation keeps reading the embedded bytes."""
    from omni_grpo.data.tables import write_embedded_parquet

    rows = [
        Sample(
            uid="mix",
            prompt="<audio> hear, <image> see, <video> watch",
            label="A",
            media=[
                {"type": "audio", "path": "tone.wav"},
                {"type": "image", "path": "img.png"},
                {"type": "video", "path": "clip.mp4"},
            ],
        ),
        Sample(
            uid="bad", prompt="<image>", label="A", media=[{"type": "image", "path": "broken.png"}]
        ),
    ]
    parquet = tmp_path / "rows.parquet"
    write_embedded_parquet(rows, media_root, parquet)
    files = OmniDataset(rows, media_root, builder)
    table = OmniDataset(parquet, None, builder)
    a, b = files.load(0), table.load(0)
    assert a is not None and b is not None and a.input_ids == b.input_ids
    assert a.mm.keys() == b.mm.keys() and all(torch.equal(a.mm[k], b.mm[k]) for k in a.mm)
    assert table.load(1) is None and table.stats()["skipped_unreadable"] == 1
    blank = table.ablated("image").load(0)
    assert blank is not None and blank.input_ids == b.input_ids
    assert not torch.equal(blank.mm["pixel_values"], b.mm["pixel_values"])
    assert torch.equal(blank.mm["input_features"], b.mm["input_features"])

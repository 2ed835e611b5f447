"""Audio-in-video prompts (a video whose own sound track is interleaved with its frames) against
transformers' Qwen3-Omni reference, and through the embedded engine and the torch trainer.

The reference is ``Qwen3OmniMoeProcessor`` (chat template, tokenizer, Whisper features, the
processor's audio-in-video interleave) and ``Qwen3OmniMoeThinkerForConditionalGeneration``
(``get_rope_index`` and the logits) on a tiny checkpoint built here. Two stand-ins, both
outside what is compared: torchvision is not installed, so the processor's video processor is
our own frame processor (its pixels are ours by construction; ``process_frames`` has its own
test), and torchcodec is not installed, so the processor is handed the sound track that our
PyAV decoder read (its ``audio_from_video_indices`` path for pre-decoded tracks); that track is
checked against the samples written into the file (pcm in mkv: exact up to 16-bit rounding).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from omni_extract import extract
from omni_extract.tiny import PROCESSOR_TOKEN_ATTRS
from omni_grpo.config import DataConfig
from omni_grpo.data.collate import repeat_mm
from omni_grpo.data.dataset import OmniDataset
from omni_grpo.data.media import MediaError, load_audio, load_video, load_video_audio
from omni_grpo.data.prompt import PromptBuilder
from omni_grpo.data.schema import parse_row
from omni_grpo.data.synthetic import write_video_with_sound
from omni_grpo.data.vision import VisionProcessorConfig, process_frames
from omni_grpo.types import PromptInputs, Sample

RATE = 16_000
FPS = 2.0
DATA = DataConfig(video_fps=FPS)
PROMPT = "<image>Listen: <audio> then watch <video> and <video>\nWhat is heard?"


def _sweep(seconds: float, f0: float) -> np.ndarray:
    t = np.arange(int(seconds * RATE)) / RATE
    return (0.4 * np.sin(2 * np.pi * (f0 + 150 * t) * t)).astype(np.float32)


def _frames(n: int, h: int, w: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, h, w, 3)).astype(np.uint8)


@pytest.fixture(scope="module")
def world(tiny_omni_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The extracted checkpoint and a media root: two videos with sound (pcm in mkv, aac in
    mp4), a silent video, a wav and a png."""
    import soundfile as sf
    from PIL import Image

    root = tmp_path_factory.mktemp("aiv")
    extract(tiny_omni_dir, root / "vl", variant="vl")
    extract(tiny_omni_dir, root / "audio", variant="audio")
    media = root / "media"
    media.mkdir()
    write_video_with_sound(
        media / "a.mkv", _frames(10, 64, 96, 0), FPS, _sweep(5.3, 300), audio_codec="pcm_s16le"
    )
    write_video_with_sound(media / "b.mp4", _frames(12, 64, 64, 1), 4.0, _sweep(3.1, 900))
    write_video_with_sound(media / "silent.mp4", _frames(4, 64, 64, 2), FPS, np.zeros(0))
    sf.write(media / "tone.wav", _sweep(1.7, 2000), RATE)
    Image.fromarray(_frames(1, 64, 64, 3)[0]).save(media / "pic.png")
    return {"omni": tiny_omni_dir, "vl": root / "vl", "audio": root / "audio", "media": media}


def _sample(uid: str = "aiv", flag: bool | None = True) -> Sample:
    kinds = [("image", "pic.png"), ("audio", "tone.wav"), ("video", "a.mkv"), ("video", "b.mp4")]
    media = [{"type": t, "path": p} for t, p in kinds]
    return Sample(uid=uid, prompt=PROMPT, label="A", media=media, use_audio_in_video=flag)


def _reference_processor(omni: Path, video_cfg: VisionProcessorConfig) -> Any:
    """``Qwen3OmniMoeProcessor`` with its real tokenizer, chat template, image processor and
    Whisper feature extractor; the video processor is ours (no torchvision here)."""
    import transformers.video_processing_utils as vpu
    from transformers import (
        AutoTokenizer,
        Qwen2VLImageProcessorPil,
        Qwen3OmniMoeProcessor,
        WhisperFeatureExtractor,
    )

    class Frames(vpu.BaseVideoProcessor):  # BaseVideoProcessor's own __init__ needs torchvision
        def __init__(self) -> None:
            self.temporal_patch_size = video_cfg.temporal_patch_size
            self.merge_size = video_cfg.merge_size

        def __call__(self, videos: Any, **_: Any) -> dict[str, torch.Tensor]:
            done = [process_frames(v, video_cfg, max_pixels=DATA.video_max_pixels) for v in videos]
            return {
                "pixel_values_videos": torch.cat([pv for pv, _ in done]),
                "video_grid_thw": torch.stack([g for _, g in done]),
            }

    class Reference(Qwen3OmniMoeProcessor):
        def check_argument_for_proper_class(self, name: str, arg: Any) -> Any:
            if name == "video_processor":  # the class check looks torchvision's classes up
                return type(arg)
            return super().check_argument_for_proper_class(name, arg)

    tok = AutoTokenizer.from_pretrained(str(omni))
    for attr, token in PROCESSOR_TOKEN_ATTRS.items():
        setattr(tok, attr, token)
    video = Frames.__new__(Frames)
    video.__init__()
    return Reference(
        image_processor=Qwen2VLImageProcessorPil.from_pretrained(str(omni)),
        video_processor=video,
        feature_extractor=WhisperFeatureExtractor.from_pretrained(str(omni)),
        tokenizer=tok,
        chat_template=json.loads((omni / "chat_template.json").read_text())["chat_template"],
    )


def _reference_inputs(world: dict[str, Any], builder: PromptBuilder, sample: Sample) -> Any:
    """What the reference processor makes of the sample (audio slots in prompt order: the wav,
    then each video's own track)."""
    from PIL import Image

    media = world["media"]
    proc = _reference_processor(world["omni"], builder.video_cfg)
    text = proc.apply_chat_template(
        builder.messages(sample), add_generation_prompt=True, tokenize=False
    )
    clips = [load_video(media / n, DATA.video_fps, DATA.max_frames) for n in ("a.mkv", "b.mp4")]
    assert {c.fps for c in clips} == {FPS}  # the processor takes one fps for all videos
    audio = [load_audio(media / "tone.wav", DATA.audio_max_seconds)]
    audio += [load_video_audio(media / n, DATA.audio_max_seconds) for n in ("a.mkv", "b.mp4")]
    return proc(
        text=[text],
        images=[Image.open(media / "pic.png").convert("RGB")],
        videos=[c.frames for c in clips],
        audio=audio,
        audio_from_video_indices=[None, 0, 1],
        load_audio_from_video=True,
        fps=FPS,
        images_kwargs={"max_pixels": DATA.image_max_pixels, "min_pixels": DATA.image_min_pixels},
        return_tensors="pt",
    )


def test_layout_features_and_positions_equal_the_reference(world: dict[str, Any]) -> None:
    from omni_grpo.models import load_thinker
    from transformers import Qwen3OmniMoeThinkerForConditionalGeneration

    builder = PromptBuilder(world["vl"], DATA)
    sample = _sample()
    ours = builder.build(sample, world["media"])
    ref = _reference_inputs(world, builder, sample)
    assert ours.use_audio_in_video
    assert ours.input_ids == ref["input_ids"][0].tolist()
    aiv_blocks = sum(
        1
        for a, b in zip(ours.input_ids, ours.input_ids[1:], strict=False)
        if (a, b)
        == (builder.rope_config.vision_start_token_id, builder.rope_config.audio_start_token_id)
    )
    assert aiv_blocks == 2
    print(
        ours.mm["feature_attention_mask"].sum(-1),
        ref["feature_attention_mask"].sum(-1),
        ours.mm["feature_attention_mask"].shape,
        ref["feature_attention_mask"].shape,
    )
    for key in ("feature_attention_mask", "video_grid_thw", "image_grid_thw"):
        assert torch.equal(ours.mm[key], ref[key].to(ours.mm[key].dtype)), key
    # one extractor call for the prompt's three audios, as the processor makes it: the padded
    # frames too, and the shorter waves' mel frame counts (a partial hop counts in a batch)
    assert torch.equal(ours.mm["input_features"], ref["input_features"])
    assert torch.equal(ours.mm["video_second_per_grid"], ref["video_second_per_grid"].float())
    assert torch.allclose(ours.mm["pixel_values"], ref["pixel_values"], atol=1e-5)

    reference = Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(
        world["omni"], dtype=torch.float32
    ).eval()
    ids = torch.tensor([ours.input_ids])
    mm = repeat_mm(ours.mm, 1)
    thinker = load_thinker(world["vl"], audio_dir=world["audio"], dtype="float32")
    pos, delta = thinker.compute_position_ids(
        ids,
        None,
        mm["image_grid_thw"],
        mm["video_grid_thw"],
        mm["video_second_per_grid"],
        mm["feature_attention_mask"],
    )
    ref_pos, ref_delta = reference.get_rope_index(
        ref["input_ids"],
        ref["image_grid_thw"],
        ref["video_grid_thw"],
        ref["attention_mask"],
        use_audio_in_video=True,
        audio_seqlens=ref["feature_attention_mask"].sum(-1),
        second_per_grids=ref["video_second_per_grid"],
    )
    assert torch.equal(pos, ref_pos.to(pos.dtype)) and torch.equal(delta, ref_delta.to(delta.dtype))
    with torch.no_grad():  # the audio rows and the frame rows, filled in their interleaved order
        theirs = reference(**ref, use_audio_in_video=True).logits
        mine = thinker(input_ids=ids, **mm).logits
    assert (theirs - mine).abs().max().item() <= 1e-5


def test_the_sound_track_is_the_files(world: dict[str, Any]) -> None:
    track = load_video_audio(world["media"] / "a.mkv", 30.0)
    written = np.round(_sweep(5.3, 300) * 32767) / 32767
    assert track.shape == written.shape
    assert np.abs(track - written).max() < 1e-4  # int16 -> float scaling
    short = load_video_audio(world["media"] / "a.mkv", 2.0)
    assert short.size == 2 * RATE


def test_a_video_without_sound_is_one_line_naming_it(world: dict[str, Any]) -> None:
    media = [{"type": "video", "path": "silent.mp4"}]
    sample = Sample(uid="s", prompt="<video>?", label="A", media=media, use_audio_in_video=True)
    builder = PromptBuilder(world["vl"], DATA)
    with pytest.raises(MediaError) as err:
        builder.build(sample, world["media"])
    assert err.value.reason == "no_audio_track"
    assert "silent.mp4" in str(err.value) and "\n" not in str(err.value)
    ds = OmniDataset([sample, _sample()], world["media"], builder)
    assert ds.load(0) is None and ds.load(1) is not None
    assert ds.stats()["skipped_no_audio_track"] == 1
    plain = PromptBuilder(world["vl"], DATA).build(
        Sample(uid="s", prompt="<video>?", label="A", media=media), world["media"]
    )
    assert not plain.use_audio_in_video and "input_features" not in plain.mm


def test_row_field_and_config_default(world: dict[str, Any]) -> None:
    base = {"id": "r", "prompt": "<video>?", "label": "A"}
    row = parse_row({**base, "media": [{"type": "video", "path": "a.mkv"}]}, "f.jsonl:1")
    assert row.to_sample().use_audio_in_video is None
    on = parse_row(
        {**base, "media": [{"type": "video", "path": "a.mkv"}], "use_audio_in_video": True}, "x"
    )
    assert on.to_sample().use_audio_in_video is True
    with pytest.raises(ValueError, match=r"f\.jsonl:2: .*use_audio_in_video is true but"):
        parse_row({**base, "prompt": "?", "use_audio_in_video": True}, "f.jsonl:2")
    default_on = PromptBuilder(world["vl"], DataConfig(video_fps=FPS, use_audio_in_video=True))
    assert default_on.audio_in_video(row.to_sample())
    off = parse_row({**base, "media": on.model_dump()["media"], "use_audio_in_video": False}, "y")
    assert not default_on.audio_in_video(off.to_sample())  # the row's own word wins
    audio_only = Sample(
        uid="a", prompt="<audio>", label="A", media=[{"type": "audio", "path": "x"}]
    )
    assert not default_on.audio_in_video(
        audio_only
    )  # the default never touches a row without video


def test_ablating_audio_silences_the_track_and_keeps_the_layout(world: dict[str, Any]) -> None:
    builder = PromptBuilder(world["vl"], DATA)
    sample = _sample()
    full = builder.build(sample, world["media"])
    quiet = builder.ablated("audio").build(sample, world["media"])
    assert quiet.input_ids == full.input_ids
    assert not torch.equal(quiet.mm["input_features"], full.mm["input_features"])
    assert torch.equal(quiet.mm["pixel_values_videos"], full.mm["pixel_values_videos"])


@pytest.fixture(scope="module")
def rollouts(world: dict[str, Any]) -> dict[str, Any]:
    from omni_grpo.models import load_thinker

    builder = PromptBuilder(world["vl"], DATA)
    prompts = [builder.build(_sample(f"p{i}"), world["media"]) for i in range(2)]
    eos = int(builder.tokenizer.convert_tokens_to_ids("<|im_end|>"))
    model = load_thinker(world["vl"], audio_dir=world["audio"], dtype="float32")
    return {"prompts": prompts, "eos": eos, "model": model}


def _recompute(model: torch.nn.Module, prompt: PromptInputs, tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt.input_ids + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids, **repeat_mm(prompt.mm, 1)).logits
    z = torch.log_softmax(logits[0, len(prompt.input_ids) - 1 : -1].float(), -1)
    return z.gather(-1, torch.tensor(tokens)[:, None])[:, 0]


@pytest.mark.parametrize("batching", ["static", "continuous"])
def test_embedded_rollout_logprobs_equal_the_full_forward(rollouts: dict, batching: str) -> None:
    from omni_grpo.config import SamplingParams
    from omni_grpo.rollout.embedded import EmbeddedEngine
    from omni_grpo.trainer import media_token_ids

    model = rollouts["model"]
    engine = EmbeddedEngine(
        model, [rollouts["eos"]], banned_token_ids=media_token_ids(model), batching=batching
    )
    torch.manual_seed(0)
    groups = engine.generate(rollouts["prompts"], 3, SamplingParams(max_new_tokens=5))
    for prompt, group in zip(rollouts["prompts"], groups, strict=True):
        for c in group:
            ref = _recompute(model, prompt, c.token_ids)
            assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-4), (c.logprobs, ref)


def test_a_grpo_step_on_audio_in_video_prompts(rollouts: dict) -> None:
    import copy

    from omni_grpo.backends.torch_backend import TorchBackend
    from omni_grpo.config import AlgoConfig, SamplingParams, TrainerConfig
    from omni_grpo.rollout.embedded import EmbeddedEngine
    from omni_grpo.trainer import media_token_ids
    from omni_grpo.types import GRPOBatch

    model = copy.deepcopy(rollouts["model"])
    model.set_frozen(visual=True)
    engine = EmbeddedEngine(model, [rollouts["eos"]], banned_token_ids=media_token_ids(model))
    torch.manual_seed(1)
    groups = engine.generate(rollouts["prompts"], 4, SamplingParams(max_new_tokens=4))
    backend = TorchBackend(
        model, TrainerConfig(device="cpu", lr=1e-2), AlgoConfig(), pad_token_id=rollouts["eos"]
    )
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]] * len(groups))
    metrics = backend.step(GRPOBatch(groups, adv))
    assert metrics["train_rollout_logprob_abs_diff"] < 1e-4
    assert metrics["skipped_step"] == 0 and metrics["grad_norm"] > 0


def test_the_flag_and_the_track_survive_an_embedded_parquet(
    world: dict[str, Any], tmp_path: Path
) -> None:
    """jsonl + files -> ``prepare-data parquet`` (media bytes in the table) -> the same prompt."""
    from omni_grpo.data.schema import write_rows
    from omni_grpo.data.sources import read_samples
    from omni_grpo.data.tables import write_embedded_parquet

    media = world["media"]
    row = {"id": "r", "prompt": "<video>?", "label": "A", "use_audio_in_video": True}
    row["media"] = [{"type": "video", "path": "b.mp4"}]
    write_rows(media / "rows.jsonl", [row])
    write_embedded_parquet(read_samples(media / "rows.jsonl"), media, tmp_path / "rows.parquet")
    builder = PromptBuilder(world["vl"], DATA)
    from_files = OmniDataset(media / "rows.jsonl", media, builder).load(0)
    from_table = OmniDataset(tmp_path / "rows.parquet", tmp_path, builder).load(0)
    assert from_table is not None and from_table.sample.use_audio_in_video is True
    assert from_table.input_ids == from_files.input_ids
    for key, value in from_files.mm.items():
        assert torch.equal(from_table.mm[key], value), key

"""Acceptance: the composed thinker equals transformers' Qwen3-Omni thinker, logit for logit.

Factory Omni checkpoint -> omni-extract ``vl`` + ``audio`` -> ``load_thinker``; the reference is
``Qwen3OmniMoeThinkerForConditionalGeneration`` loaded from the original checkpoint. Batches mix
audio, image, video and text inside the same sample, with and without ``use_audio_in_video``, left
and right padded, fp32; compared over valid positions.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omni_extract import extract
from omni_grpo.models import load_thinker
from omni_grpo.testing.models import Ids, build_batch

TOL = 1e-5
TXT = [5, 6, 7]


def _extract(src: Path, root: Path) -> Path:
    extract(src, root / "vl", variant="vl")
    extract(src, root / "audio", variant="audio")
    return root / "vl"


@pytest.fixture(scope="module")
def vl_dir(tiny_omni_dir, tmp_path_factory) -> Path:
    return _extract(tiny_omni_dir, tmp_path_factory.mktemp("thinker-extract"))


@pytest.fixture(scope="module")
def reference(tiny_omni_dir):
    from transformers import Qwen3OmniMoeThinkerForConditionalGeneration

    return Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(
        tiny_omni_dir, dtype=torch.float32
    ).eval()


def _ids(vl_dir: Path) -> Ids:
    side = json.loads((vl_dir / "config.json").read_text())["omni_sideband"]
    gen = json.loads((vl_dir / "generation_config.json").read_text())
    return Ids.from_sideband(side, pad=gen["pad_token_id"])


def mixed_samples(audio_in_video: bool) -> list[list[tuple]]:
    """Three samples; the first and third hold audio, image, video and text together."""
    video = "av" if audio_in_video else "video"
    return [
        [
            ("text", TXT),
            ("image", (1, 4, 4)),
            ("audio", 300),
            (video, (2, 4, 4), 1.0, 120),
            ("text", TXT),
        ],
        [("text", TXT[:1]), ("audio", 150), ("text", TXT)],
        [
            ("text", TXT),
            (video, (3, 4, 4), 0.75, 250),
            ("audio", 101),
            ("image", (1, 4, 8)),
            ("text", [9]),
        ],
    ]


def _compare(reference, thinker, batch, **kw) -> float:
    with torch.no_grad():
        ref = reference(**batch, **kw).logits
        ours = thinker(**batch, **kw).logits
    valid = batch["attention_mask"].bool()
    assert ours.shape == ref.shape
    return (ref - ours)[valid].abs().max().item()


CASES = [("default", aiv, side) for aiv in (False, True) for side in ("left", "right")] + [
    ("eager", True, "left")
]


@pytest.mark.parametrize(("impl", "audio_in_video", "padding_side"), CASES)
def test_logit_parity_mixed_batches(
    vl_dir, reference, tiny_omni_dir, impl, audio_in_video, padding_side
):
    """sdpa + grouped_mm (transformers' defaults) on both sides, and eager attention + experts."""
    kwargs = (
        {}
        if impl == "default"
        else {"attn_implementation": "eager", "experts_implementation": "eager"}
    )
    thinker = load_thinker(vl_dir, dtype="float32", **kwargs)
    ref = reference
    if impl != "default":
        from transformers import Qwen3OmniMoeThinkerForConditionalGeneration

        ref = Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(
            tiny_omni_dir, dtype=torch.float32, **kwargs
        ).eval()
    batch = build_batch(mixed_samples(audio_in_video), _ids(vl_dir), padding_side, seed=1)
    diff = _compare(ref, thinker, batch, use_audio_in_video=audio_in_video)
    assert diff <= TOL, f"max |logit diff| {diff}"
    with torch.no_grad():  # deterministic: a second forward is bit-identical
        again = thinker(**batch, use_audio_in_video=audio_in_video).logits
        first = thinker(**batch, use_audio_in_video=audio_in_video).logits
    assert torch.equal(again, first)


def test_parity_audio_and_text_only(vl_dir, reference):
    """No image/video grid: the reference's sequential-position branch."""
    thinker = load_thinker(vl_dir, dtype="float32")
    samples = [
        [("text", TXT), ("audio", 300), ("text", TXT)],
        [("audio", 99), ("audio", 1000), ("text", [8])],
    ]
    for side in ("left", "right"):
        batch = build_batch(samples, _ids(vl_dir), side, seed=2)
        assert _compare(reference, thinker, batch) <= TOL


def test_parity_loss_with_labels(vl_dir, reference):
    thinker = load_thinker(vl_dir, dtype="float32")
    batch = build_batch(mixed_samples(False), _ids(vl_dir), "right", seed=3)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    with torch.no_grad():
        ref = reference(**batch, labels=labels).loss
        ours = thinker(**batch, labels=labels).loss
    assert abs(ref.item() - ours.item()) <= TOL


def test_parity_real_vocabulary_ids(tiny_omni_real_vocab_dir, tmp_path):
    """Released token ids (151655, 151675, ...) and the real vocabulary size, nothing hard-coded."""
    from transformers import Qwen3OmniMoeThinkerForConditionalGeneration

    vl = _extract(tiny_omni_real_vocab_dir, tmp_path)
    thinker = load_thinker(vl, dtype="float32")
    ref = Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(
        tiny_omni_real_vocab_dir
    ).eval()
    batch = build_batch(mixed_samples(True), _ids(vl), "left", seed=4)
    assert _compare(ref, thinker, batch, use_audio_in_video=True) <= TOL


def test_mixed_audio_in_video_batch_detected_per_video(vl_dir, reference):
    """One video with its audio track and one without, in the same batch.

    transformers cannot position this (one flag for the whole batch); with the default
    ``use_audio_in_video=None`` we read it per video. Each row equals the reference run on that
    sample alone with the right flag.
    """
    thinker = load_thinker(vl_dir, dtype="float32")
    ids = _ids(vl_dir)
    samples = [mixed_samples(True)[0], mixed_samples(False)[2]]
    batch = build_batch(samples, ids, "left", seed=5)
    with torch.no_grad():
        both = thinker(**batch).logits
    for row, flag in enumerate((True, False)):
        single = build_batch([samples[row]], ids, "left", seed=5, first_index=row)
        with torch.no_grad():
            ref = reference(**single, use_audio_in_video=flag).logits[0]
        ours = both[row][batch["attention_mask"][row].bool()]
        assert (ours - ref).abs().max() <= TOL

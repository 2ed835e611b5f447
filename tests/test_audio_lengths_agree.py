"""omni-rope and omni-audio-inject count audio tokens with two formulas; they must agree.

omni-rope (``audio_output_length``, positions and placeholder expansion in ``data/audio.py``)
follows transformers and multiplies full chunks by its hard-coded 13 tokens; omni-audio-inject
(``audio_output_lengths``, the count the thinker checks before the tower runs) derives the per-chunk
count from the tower's conv strides. A disagreement on any length would make a prompt's placeholder
count differ from what the tower emits, so every length from 1 to 10,000 mel frames (100 s of
audio) is compared, on ints and on a tensor, for the window the released thinker and the tiny
factory use.
"""

from __future__ import annotations

import json

import torch
from omni_audio_inject import audio_output_lengths
from omni_rope import audio_output_length

LENGTHS = range(1, 10_001)
RELEASED_N_WINDOW = 50


def test_every_length_agrees_on_ints() -> None:
    rope = [audio_output_length(n, RELEASED_N_WINDOW) for n in LENGTHS]
    inject = [audio_output_lengths(n, RELEASED_N_WINDOW) for n in LENGTHS]
    bad = [(n, a, b) for n, a, b in zip(LENGTHS, rope, inject, strict=True) if a != b]
    assert not bad, f"first disagreements (frames, omni-rope, omni-audio-inject): {bad[:5]}"
    assert rope[99] == 13 and rope[299] == 39  # 100 frames -> 13 tokens, 300 -> 39


def test_every_length_agrees_on_a_tensor() -> None:
    frames = torch.arange(1, 10_001)
    assert torch.equal(
        audio_output_length(frames, RELEASED_N_WINDOW),
        audio_output_lengths(frames, RELEASED_N_WINDOW),
    )


def test_factory_checkpoint_uses_the_compared_window(tiny_omni_dir) -> None:
    cfg = json.loads((tiny_omni_dir / "config.json").read_text())
    assert cfg["thinker_config"]["audio_config"]["n_window"] == RELEASED_N_WINDOW

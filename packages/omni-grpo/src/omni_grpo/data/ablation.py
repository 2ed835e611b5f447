"""Modality ablation: a sample's media replaced by a neutral input of the same shape.

Omni benchmarks are full of modality shortcuts (OmniClean kept 8,551 of 16,968 queries after
removing those a vision-only model answers), so a gain claimed for a modality is only shown when
the same evaluation with that modality's media blanked falls back to chance. The neutral input
keeps the decoded shape — same image size, same frame count and fps, same number of audio
samples — so the prompt has exactly the same tokens and positions; only the content is gone.
The replacement happens after decoding and before the processor, so normalisation, patching and
the mel front end see it as they would any real input.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from omni_grpo.data.media import VideoClip

MID_GREY = 128


def _grey_image(image: Any) -> Any:
    from PIL import Image

    return Image.new("RGB", image.size, (MID_GREY, MID_GREY, MID_GREY))


def _grey_video(clip: VideoClip) -> VideoClip:
    return VideoClip(frames=np.full_like(clip.frames, MID_GREY), fps=clip.fps)


def _silence(wave: np.ndarray) -> np.ndarray:
    return np.zeros_like(wave)


# media type -> the neutral stand-in for a decoded item of that type
NEUTRAL: dict[str, Callable[[Any], Any]] = {
    "image": _grey_image,
    "video": _grey_video,
    "audio": _silence,
}

# ablation name (eval.ablations, `omni-grpo eval --ablate`) -> the media types it blanks
ABLATIONS: dict[str, frozenset[str]] = {
    "audio": frozenset({"audio"}),
    "image": frozenset({"image"}),
    "video": frozenset({"video"}),
    "all": frozenset(NEUTRAL),
}


def neutralise(media_type: str, decoded: Any, ablate: frozenset[str]) -> Any:
    """``decoded`` unchanged unless ``media_type`` is ablated, else its neutral stand-in."""
    return NEUTRAL[media_type](decoded) if media_type in ablate else decoded

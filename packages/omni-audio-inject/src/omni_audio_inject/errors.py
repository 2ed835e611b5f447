"""Errors raised by omni-audio-inject; each names what is wrong, with expected and actual values."""

from __future__ import annotations


class AudioInjectError(ValueError):
    """Base class: bad audio inputs or a bad tower location."""


class PlaceholderCountError(AudioInjectError):
    """The number of ``<|audio_pad|>`` placeholders differs from the number of encoder rows.

    transformers' Omni thinker silently uses the first N rows when there are too few placeholders,
    which misaligns every later audio; we refuse instead.
    """

    def __init__(self, placeholders: int, features: int, detail: str = "") -> None:
        self.placeholders = placeholders
        self.features = features
        msg = (
            f"audio placeholder/feature count mismatch: input_ids hold {placeholders} audio "
            f"placeholder tokens but the audio tower produced {features} rows"
        )
        super().__init__(msg + (f" ({detail})" if detail else ""))


class MissingAudioTowerError(AudioInjectError, FileNotFoundError):
    """The given directory has no usable audio-tower weights or config."""

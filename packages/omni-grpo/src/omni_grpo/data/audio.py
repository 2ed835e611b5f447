"""Waveforms -> 128-bin log-mel ``input_features`` and ``feature_attention_mask`` (Whisper features,
as the Omni processor computes them), and the audio placeholder count."""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

# The one definition of the audio tower's output length lives in omni-rope.
from omni_rope import audio_output_length

WHISPER_DEFAULTS: dict[str, Any] = {
    "feature_size": 128,
    "sampling_rate": 16000,
    "hop_length": 160,
    "n_fft": 400,
}


@lru_cache(maxsize=4)
def _extractor(key: tuple[tuple[str, Any], ...]) -> Any:
    from transformers import WhisperFeatureExtractor

    return WhisperFeatureExtractor(**dict(key))


def whisper_kwargs(model_dir: str | os.PathLike[str] | None) -> dict[str, Any]:
    """Feature-extractor settings from the checkpoint's ``preprocessor_config.json`` (else defaults)."""
    kw = dict(WHISPER_DEFAULTS)
    if model_dir is not None and (p := Path(model_dir) / "preprocessor_config.json").is_file():
        raw = json.loads(p.read_text())
        kw.update(
            {
                k: raw[k]
                for k in (
                    "feature_size",
                    "sampling_rate",
                    "hop_length",
                    "n_fft",
                    "chunk_length",
                    "dither",
                )
                if k in raw
            }
        )
    return kw


def audio_features(
    wave: np.ndarray | list[np.ndarray], whisper: dict[str, Any] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mono 16 kHz waveform(s) -> ``input_features [n, 128, frames]``,
    ``feature_attention_mask [n, frames]`` (n = 1 for one wave).

    Called as the Omni processor calls it: no padding to 30 s, no truncation, attention mask on;
    a list is one call, padded to its longest wave, as the processor featurises a prompt's audios.
    """
    kw = whisper or WHISPER_DEFAULTS
    fe = _extractor(tuple(sorted(kw.items())))
    out = fe(
        wave,
        sampling_rate=kw.get("sampling_rate", 16000),
        padding=True,
        truncation=False,
        return_attention_mask=True,
        return_tensors="pt",
    )
    return out["input_features"].float(), out["attention_mask"].long()


def audio_tokens(feature_attention_mask: torch.Tensor, n_window: int) -> int:
    """Placeholder count for one audio = the tower's output length for its valid mel frames."""
    return int(audio_output_length(int(feature_attention_mask.sum().item()), n_window))

"""Audio placeholder tokens per mel-frame count, as transformers' Omni audio tower emits them.

Its own module because both the config (``OmniRopeConfig.audio_output_length``) and the layouts
need it, and the layouts need the config: with the count here, neither imports the other back.
"""

from __future__ import annotations

from typing import Any, overload

import torch

# Tokens one full audio chunk (2 * n_window mel frames) yields after the three stride-2 convolutions.
# transformers hard-codes 13 (100 frames -> 50 -> 25 -> 13), and so do its audio tower and processor;
# we follow it so the placeholder count always matches the tower's output.
TOKENS_PER_FULL_CHUNK = 13


@overload
def audio_output_length(n_mel_frames: int, n_window: int = 50) -> int: ...
@overload
def audio_output_length(n_mel_frames: torch.Tensor, n_window: int = 50) -> torch.Tensor: ...
def audio_output_length(n_mel_frames: Any, n_window: int = 50) -> Any:
    """Audio placeholder tokens for ``n_mel_frames`` valid mel frames (= the audio tower's output length).

    ``n_window`` is ``audio_config.n_window`` (50 in the released thinker); floor division as in
    transformers, so 1 -> 1, 99 -> 13, 100 -> 13, 101 -> 14, 300 -> 39, 3000 -> 390.
    """
    chunk = 2 * n_window
    leave = n_mel_frames % chunk
    f1 = (leave - 1) // 2 + 1
    f2 = (f1 - 1) // 2 + 1
    f3 = (f2 - 1) // 2 + 1
    return f3 + (n_mel_frames // chunk) * TOKENS_PER_FULL_CHUNK

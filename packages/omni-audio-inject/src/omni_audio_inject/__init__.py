"""omni-audio-inject: a frozen Qwen3-Omni audio tower feeding the audio placeholder rows of an LM.

Public API:

* :class:`FrozenAudioTower` — lazy, frozen ``Qwen3OmniMoeAudioEncoder`` from omni-extract's
  ``audio`` output or an Omni checkpoint (reads only the tower's tensors); never a submodule.
* :class:`AudioInjector` — tower + strict scatter; ``attach(embedding)`` hooks an embedding
  module ("embeddings in -> embeddings out, given input_ids + features"); ``feeding(...)`` passes
  the features; ``inject(...)`` is the same step as a plain call (Megatron, SP windows).
* :func:`scatter_audio_embeds`, :func:`scatter_audio_window`, :func:`scatter_audio_rows` — pure
  scatter functions (unsplit, one SP window, one window with a known row offset).
* :func:`pad_audio_features` — micro-batch collation of variable-length features.
* :func:`audio_output_lengths` — tokens per audio for a number of mel frames.
"""

from omni_audio_inject.collate import pad_audio_features
from omni_audio_inject.errors import AudioInjectError, MissingAudioTowerError, PlaceholderCountError
from omni_audio_inject.inject import AudioInjector
from omni_audio_inject.lengths import audio_output_lengths
from omni_audio_inject.scatter import (
    placeholder_mask,
    scatter_audio_embeds,
    scatter_audio_rows,
    scatter_audio_window,
)
from omni_audio_inject.tower import FrozenAudioTower

__all__ = [
    "AudioInjectError",
    "AudioInjector",
    "FrozenAudioTower",
    "MissingAudioTowerError",
    "PlaceholderCountError",
    "audio_output_lengths",
    "pad_audio_features",
    "placeholder_mask",
    "scatter_audio_embeds",
    "scatter_audio_rows",
    "scatter_audio_window",
]

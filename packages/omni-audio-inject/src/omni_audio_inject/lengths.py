"""How many LLM tokens the Qwen3-Omni audio tower emits for a given number of mel frames.

The tower cuts the log-mel input into chunks of ``2 * n_window`` frames and runs three stride-2
convolutions over each; a full 100-frame chunk yields 13 tokens (hence ``position_id_per_seconds``
13). Placeholder expansion, the count check and the position ids all depend on this number, so it
lives here once, as plain integer arithmetic that works on ints and integer tensors alike.
"""

from __future__ import annotations

from typing import TypeVar

import torch

IntOrTensor = TypeVar("IntOrTensor", int, torch.Tensor)

CONV_STRIDES: tuple[int, ...] = (2, 2, 2)  # conv2d1..3, each kernel 3, padding 1


def _after_convs(frames: IntOrTensor) -> IntOrTensor:
    for stride in CONV_STRIDES:
        frames = (frames - 1) // stride + 1
    return frames


def audio_output_lengths(mel_frames: IntOrTensor, n_window: int = 50) -> IntOrTensor:
    """Tokens produced for ``mel_frames`` valid frames (``feature_attention_mask.sum(-1)``).

    Floor division rounds toward minus infinity, exactly like the reference, so a remainder of 0
    contributes 0 tokens and full chunks contribute ``_after_convs(2 * n_window)`` each.
    """
    chunk = 2 * n_window
    per_chunk = _after_convs(chunk)
    return _after_convs(mel_frames % chunk) + (mel_frames // chunk) * per_chunk

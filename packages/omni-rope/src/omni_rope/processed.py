"""Positions straight from the Omni processor's media tensors (the thinker forward's arguments).

Every caller of :func:`omni_rope.get_rope_index` that starts from processed media — the torch
thinker, the Megatron backend, the GPU verification rig — has the same dict of tensors under the
names transformers' Omni processor and thinker forward use, and must translate it the same way:
``video_second_per_grid`` is the core's ``second_per_grids``, and audio lengths are the valid mel
frames, ``feature_attention_mask.sum(-1)``. That translation lives here once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from omni_rope.config import OmniRopeConfig
from omni_rope.positions import get_rope_index


def positions_from_mm(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    mm: Mapping[str, Any],
    config: OmniRopeConfig,
    *,
    use_audio_in_video: bool | None = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``get_rope_index`` for ``input_ids`` and the processor's media tensors ``mm``.

    ``mm`` may hold any of ``image_grid_thw``, ``video_grid_thw``, ``video_second_per_grid`` and
    ``feature_attention_mask`` (other keys, e.g. pixel values, are ignored); a missing key means
    no media of that kind. Returns positions ``[3, B, L]`` and decode deltas ``[B, 1]``.
    """
    mask = mm.get("feature_attention_mask")
    return get_rope_index(
        input_ids,
        attention_mask,
        config,
        image_grid_thw=mm.get("image_grid_thw"),
        video_grid_thw=mm.get("video_grid_thw"),
        second_per_grids=mm.get("video_second_per_grid"),
        audio_seqlens=None if mask is None else mask.sum(-1),
        use_audio_in_video=use_audio_in_video,
    )

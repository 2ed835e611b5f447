"""Collate variable-length audio features into one micro-batch.

Each prompt's processor output has its own ``T`` (mel frames); ``torch.cat`` on dim 0 needs a
common ``T``, so every item is right-padded with zeros to the micro-batch maximum (and its mask
with zeros). The tower only reads the valid frames (``feature_attention_mask``), so padding never
changes its output; it only has to exist for concatenation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def pad_audio_features(
    features: Sequence[torch.Tensor], masks: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad ``[n_i, mel, T_i]`` features and ``[n_i, T_i]`` masks and concatenate on dim 0.

    Items with ``n_i == 0`` are allowed (prompts without audio contribute nothing). Raises with the
    item index when a feature/mask pair disagrees or the mel bins differ.
    """
    if len(features) != len(masks):
        raise ValueError(f"got {len(features)} feature tensors but {len(masks)} masks")
    if not features:
        raise ValueError("pad_audio_features needs at least one item")
    mel = features[0].shape[1]
    for i, (f, m) in enumerate(zip(features, masks, strict=True)):
        if f.ndim != 3 or m.ndim != 2:
            raise ValueError(
                f"item {i}: input_features must be [n, mel, T] and feature_attention_mask [n, T], "
                f"got {tuple(f.shape)} and {tuple(m.shape)}"
            )
        if f.shape[0] != m.shape[0] or f.shape[2] != m.shape[1]:
            raise ValueError(
                f"item {i}: input_features {tuple(f.shape)} and feature_attention_mask "
                f"{tuple(m.shape)} disagree on (n, T)"
            )
        if f.shape[1] != mel:
            raise ValueError(f"item {i}: {f.shape[1]} mel bins, item 0 has {mel}")
    t_max = max(f.shape[2] for f in features)
    feats = torch.cat([F.pad(f, (0, t_max - f.shape[2])) for f in features], dim=0)
    mask = torch.cat([F.pad(m, (0, t_max - m.shape[1])) for m in masks], dim=0)
    return feats, mask

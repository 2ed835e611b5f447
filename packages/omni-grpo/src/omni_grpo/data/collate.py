"""Processed media tensors (``PromptInputs.mm``) stacked for batched forwards.

Shared by the embedded engine and the torch backend (``n`` copies of one prompt) and by the
Megatron backend (a micro-batch of different prompts), so it lives in ``data`` below all three.
The Omni processor's media tensors come in two shapes: audio features are per-audio rows
(``[n_audio, mel, frames]`` with a frame mask), everything else — pixel rows, grids, per-video
seconds — is one block of rows per item, concatenated along dim 0.
"""

from __future__ import annotations

import torch

# Per-audio rows: padded to a common frame count when prompts differ (see ``collate_mm``).
AUDIO_FEATURE_KEYS = ("input_features", "feature_attention_mask")


def repeat_mm(mm: dict[str, torch.Tensor], n: int) -> dict[str, torch.Tensor]:
    """Processed media tensors for ``n`` copies of one prompt (rows concatenated, per-item meta repeated)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in mm.items():
        if key in AUDIO_FEATURE_KEYS:
            out[key] = value.repeat(n, *([1] * (value.dim() - 1)))
        else:  # pixel rows, grids and per-video seconds: one block per copy
            out[key] = torch.cat([value] * n, dim=0)
    return out


def collate_mm(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Media tensors of different prompts as one batch: blocks concatenated, audio features padded."""
    from omni_audio_inject import pad_audio_features

    out: dict[str, torch.Tensor] = {}
    keys = {k for d in items for k in d}
    for k in keys - set(AUDIO_FEATURE_KEYS):
        out[k] = torch.cat([d[k] for d in items if k in d], dim=0)
    feats = [d for d in items if "input_features" in d]
    if feats:
        out["input_features"], out["feature_attention_mask"] = pad_audio_features(
            [d["input_features"] for d in feats], [d["feature_attention_mask"] for d in feats]
        )
    return out

"""The frozen media towers in exact mode: each distinct image, video and audio encoded alone.

Why: the rollout prefills a batch of prompts (every image of the batch in one tower call) while
the trainer's micro-batch holds other rows; a tower's matmuls and convolutions choose kernels by
the batch's size, so an image's embeddings could differ in the last bit between the two and every
later logprob with them. Encoded one item at a time, an item's tower call has the same shapes —
and the same deterministic kernels — in both, so its embeddings are bitwise the same. The KL
reference's forward (``exact.switch.torch_kernels``) encodes the batch at once, as off.
"""

from __future__ import annotations

from types import MethodType
from typing import Any

import torch
from torch import nn

from omni_grpo.exact.switch import torch_kernels_on


def _concat(outs: list[Any]) -> Any:
    """Per-item outputs joined along rows, whatever structure transformers returns."""
    first = outs[0]
    if first is None:
        return None
    if isinstance(first, torch.Tensor):
        return torch.cat(outs)
    if isinstance(first, list | tuple) and not hasattr(first, "keys"):
        joined = [_concat([o[i] for o in outs]) for i in range(len(first))]
        return joined if isinstance(first, list) else type(first)(joined)
    if hasattr(first, "keys"):
        return type(first)(**{k: _concat([o[k] for o in outs]) for k in first})
    raise TypeError(f"exact towers: cannot join tower outputs of type {type(first).__name__}")


def _visual_per_item(
    self: nn.Module, hidden_states: torch.Tensor, grid_thw: torch.Tensor, **kw: Any
) -> Any:
    forward = type(self).forward
    if grid_thw.shape[0] <= 1 or torch_kernels_on():
        return forward(self, hidden_states, grid_thw, **kw)
    from omni_grpo.models.vision_dedup import first_copies

    parts = hidden_states.split(grid_thw.prod(-1).tolist())
    firsts = first_copies(hidden_states, grid_thw)  # a group's rows repeat their prompt's pixels
    pieces = {i: forward(self, parts[i], grid_thw[i : i + 1], **kw) for i in sorted(set(firsts))}
    return _concat([pieces[i] for i in firsts])


def _encode_per_item(
    self: Any,
    input_features: torch.Tensor,
    feature_attention_mask: torch.Tensor | None,
    **kw: Any,
) -> torch.Tensor:
    from omni_audio_inject.tower import same_items

    encode = type(self).encode
    if input_features.ndim != 3 or input_features.shape[0] <= 1 or torch_kernels_on():
        return encode(self, input_features, feature_attention_mask, **kw)
    if feature_attention_mask is None:
        feature_attention_mask = torch.ones(
            input_features.shape[0], input_features.shape[2], dtype=torch.long
        )
    lengths = feature_attention_mask.to(input_features.device).bool().sum(-1)
    firsts = same_items(input_features, lengths)
    pieces = {
        i: encode(self, input_features[i : i + 1], feature_attention_mask[i : i + 1], **kw)
        for i in sorted(set(firsts))
    }
    return torch.cat([pieces[i] for i in firsts])


def encode_towers_per_item(thinker: nn.Module) -> None:
    """Make the vision tower and the audio tower of ``thinker`` encode one item per call."""
    visual = getattr(thinker.model, "visual", None)
    if visual is not None:
        visual.forward = MethodType(_visual_per_item, visual)
    tower = getattr(getattr(thinker, "audio", None), "tower", None)
    if tower is not None:
        tower.encode = MethodType(_encode_per_item, tower)

"""The frozen media towers in exact mode: each distinct image, video and audio encoded alone.

Why: the rollout prefills a batch of prompts (every image of the batch in one tower call) while
the trainer's micro-batch holds other rows; a tower's matmuls and convolutions choose kernels by
the batch's size, so an image's embeddings could differ in the last bit between the two and every
later logprob with them. Encoded one item at a time, an item's tower call has the same shapes —
and the same deterministic kernels — in both, so its embeddings are bitwise the same. The KL
reference's forward encodes (or finds) them the same way: its logprobs are the policy's at the
reference's weights.

Each item's output is also kept (``models.item_cache.ItemCache``) and reused when the same item
comes again:
the rollout's prefill encodes a step's images, videos and audios, and the trainer's forwards of
that step (policy and KL reference) find them instead of running the 27- and 32-layer towers
again — "computed once per prompt and shared by rollout and training", exact by construction
(the same item, the same frozen tower, the same output). Items are matched by exact equality of
their inputs, never by a hash alone; the cache is off while a tower has trainable parameters.
"""

from __future__ import annotations

from functools import partial
from types import MethodType
from typing import Any

import torch
from torch import nn

from omni_grpo.models.item_cache import ItemCache, call_tag, concat_outputs, weights_context


def _ready(cache: ItemCache | None) -> ItemCache | None:
    """``cache`` if it serves this tower call (:meth:`ItemCache.ready`), else None."""
    return cache if cache is not None and cache.ready() else None


def _cached(
    cache: ItemCache | None, inputs: tuple[torch.Tensor, ...], tag: str, encode: Any
) -> Any:
    """``encode()`` for one item, through ``cache`` (None: off; else it answered
    :meth:`ItemCache.ready` for this tower call)."""
    if cache is None:
        return encode()
    out = cache.get(inputs, tag)
    if out is None:
        with torch.no_grad():
            out = encode()
        cache.put(inputs, out, tag)
    return out


def _visual_per_item(
    self: nn.Module, hidden_states: torch.Tensor, grid_thw: torch.Tensor, **kw: Any
) -> Any:
    forward = type(self).forward
    cache = _ready(getattr(self, "omni_item_cache", None))
    tag = call_tag(kw, *weights_context(self))
    parts = hidden_states.split(grid_thw.prod(-1).tolist())
    items = [(parts[i], grid_thw[i]) for i in range(len(parts))]
    from omni_grpo.models.vision_dedup import first_copies

    firsts = first_copies(hidden_states, grid_thw)  # a group's rows repeat their prompt's pixels
    pieces = {
        i: _cached(
            cache,
            items[i],
            tag,
            lambda i=i: forward(self, parts[i], grid_thw[i : i + 1], **kw),
        )
        for i in sorted(set(firsts))
    }
    return pieces[firsts[0]] if len(firsts) == 1 else concat_outputs([pieces[i] for i in firsts])


def _encode_per_item(
    self: Any,
    input_features: torch.Tensor,
    feature_attention_mask: torch.Tensor | None,
    **kw: Any,
) -> torch.Tensor:
    from omni_audio_inject.tower import same_items

    encode = type(self).encode
    if input_features.ndim != 3:
        return encode(self, input_features, feature_attention_mask, **kw)
    cache = _ready(getattr(self, "omni_item_cache", None))
    tag = call_tag(kw)
    single_unmasked = feature_attention_mask is None and input_features.shape[0] == 1
    if feature_attention_mask is None:
        feature_attention_mask = torch.ones(
            input_features.shape[0], input_features.shape[2], dtype=torch.long
        )
    items = [
        (input_features[i : i + 1], feature_attention_mask[i : i + 1])
        for i in range(input_features.shape[0])
    ]
    valid = feature_attention_mask.to(input_features.device).bool()
    lengths = valid.sum(-1)
    firsts = same_items(input_features, lengths)
    # keyed on the valid frames, all that the tower reads: the rollout's batch and a trainer's
    # micro-batch pad an audio to different lengths, and a padded key missed across them
    keys = [(input_features[i][:, valid[i]],) for i in range(input_features.shape[0])]
    pieces = {
        i: _cached(
            cache,
            keys[i],
            tag,
            lambda i=i: encode(self, items[i][0], None if single_unmasked else items[i][1], **kw),
        )
        for i in sorted(set(firsts))
    }
    return torch.cat([pieces[i] for i in firsts])


def encode_towers_per_item(thinker: nn.Module) -> None:
    """Make the vision tower and the audio tower of ``thinker`` encode one item per call."""
    visual = getattr(thinker.model, "visual", None)
    if visual is not None:
        visual.omni_item_cache = ItemCache(visual)
        visual.forward = MethodType(_visual_per_item, visual)
    tower = getattr(getattr(thinker, "audio", None), "tower", None)
    if tower is not None:
        tower.omni_item_cache = ItemCache()  # FrozenAudioTower: frozen by construction
        tower.encode = partial(_encode_per_item, tower)  # a partial pickles, a method not

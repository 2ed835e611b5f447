"""The vision tower encodes each distinct image or video of a forward once.

Why: the trainer's micro-batches hold the rows of GRPO groups, and every row carries its prompt's
image or video — eight copies of the same pixels per group — so the frozen 27-layer tower ran
eight times per item in every training forward (the KL reference's and the policy's). The
tower's output for an item depends on that item alone (its attention never crosses items:
``cu_seqlens`` per item; positions from the item's own grid), so the distinct items are encoded
and their outputs indexed back to every copy: the same values (up to the GEMMs' batch size), a
gradient that sums over the copies when the tower trains, and the tower's cost per prompt, not
per sample. Generation already prefills each prompt once; there nothing repeats and the tower runs
as before.

Items are compared exactly (grid, then ``torch.equal`` of the patches), no hashing. The outputs
are mapped whatever structure transformers returns (a tuple in older releases, a
``BaseModelOutputWithDeepstackFeatures`` now): a tensor over the patches (``t*h*w`` rows per
item) or over the merged tokens (``/ spatial_merge_size**2``) is re-indexed, anything else is
left alone.

With the tower frozen, its outputs are also kept per item (``models.item_cache``, made by
``OmniThinker``): the trainer's forwards find the items the rollout's prefill encoded, and a call
encodes only the distinct items not kept, in one batch, its output cut per item.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from omni_audio_inject.tower import first_equal
from torch import nn

from omni_grpo.models.item_cache import (
    ItemCache,
    call_tag,
    cut_rows,
    through_cache,
    weights_context,
)


def first_copies(pixels: torch.Tensor, grid_thw: torch.Tensor) -> list[int]:
    """For each item, the index of the first item with the same grid and the same patches."""
    return first_equal(pixels.split(grid_thw.prod(-1).tolist()), grid_thw.tolist())


def _copy_index(sizes: list[int], first_of: list[int], device: torch.device) -> torch.Tensor:
    """Rows of the distinct items' output, in the order of every item (copies included)."""
    distinct = sorted(set(first_of))
    offsets, at = {}, 0
    for j in distinct:
        offsets[j] = at
        at += sizes[j]
    parts = [torch.arange(offsets[j], offsets[j] + sizes[i]) for i, j in enumerate(first_of)]
    return torch.cat(parts).to(device)


def _remap(out: Any, by_rows: dict[int, torch.Tensor]) -> Any:
    """``out`` with every tensor whose first dimension is a key of ``by_rows`` re-indexed."""
    if isinstance(out, torch.Tensor):
        index = by_rows.get(out.shape[0]) if out.dim() > 0 else None
        return out if index is None else out.index_select(0, index)
    if isinstance(out, dict):  # transformers' ModelOutput is an OrderedDict
        return type(out)(**{k: _remap(v, by_rows) for k, v in out.items()})
    if isinstance(out, tuple | list):
        return type(out)(_remap(v, by_rows) for v in out)
    return out


def _deduplicated_forward(
    self: nn.Module, hidden_states: torch.Tensor, grid_thw: torch.Tensor, **kwargs: Any
) -> Any:
    """The tower's own forward over the distinct items, its outputs indexed back to all."""
    forward = type(self).forward
    first_of = first_copies(hidden_states, grid_thw)
    cache: ItemCache | None = self.__dict__.get("omni_item_cache")
    if cache is not None and cache.ready():
        out = _through_item_cache(self, cache, hidden_states, grid_thw, first_of, kwargs)
        if out is not None:
            return out
    if len(set(first_of)) == len(first_of):
        return forward(self, hidden_states, grid_thw, **kwargs)
    distinct = sorted(set(first_of))
    sizes = grid_thw.prod(-1).tolist()
    chunks = hidden_states.split(sizes)
    out = forward(self, torch.cat([chunks[j] for j in distinct]), grid_thw[distinct], **kwargs)
    merge = int(getattr(self, "spatial_merge_size", 2)) ** 2
    merged = [n // merge for n in sizes]
    device = hidden_states.device
    by_rows = {
        sum(sizes[j] for j in distinct): _copy_index(sizes, first_of, device),
        sum(merged[j] for j in distinct): _copy_index(merged, first_of, device),
    }
    return _remap(out, by_rows)


def _through_item_cache(
    self: nn.Module,
    cache: ItemCache,
    hidden_states: torch.Tensor,
    grid_thw: torch.Tensor,
    first_of: list[int],
    kwargs: dict[str, Any],
) -> Any | None:
    """The forward with the items kept from earlier calls found (``models.item_cache``): the
    others are encoded in one call as before and their outputs cut per item and kept. None when
    that output cannot be cut: nothing is kept, the cache goes off for this tower, and the caller
    encodes again its own way (once)."""
    forward = type(self).forward
    sizes = grid_thw.prod(-1).tolist()
    merge = int(getattr(self, "spatial_merge_size", 2)) ** 2
    chunks = hidden_states.split(sizes)
    items = [(chunks[i], grid_thw[i]) for i in range(len(sizes))]

    def encode(indices: list[int]) -> list[Any] | None:
        every = len(indices) == len(sizes)  # distinct, sorted: all of them
        rows = hidden_states if every else torch.cat([chunks[j] for j in indices])
        out = forward(self, rows, grid_thw[indices], **kwargs)
        patches = [sizes[j] for j in indices]
        merged = [n // merge for n in patches]
        return cut_rows(out, {sum(patches): patches, sum(merged): merged}, len(indices))

    out = through_cache(cache, items, first_of, call_tag(kwargs, *weights_context(self)), encode)
    if out is None:
        cache.off = True
    return out


def deduplicate_vision_items(visual: nn.Module) -> None:
    """Make ``visual`` (the VL model's vision tower) encode each distinct item once.

    A bound method in the instance's ``forward``: ``copy.deepcopy`` rebinds it to the copy, so a
    frozen reference copy runs its own tower.
    """
    visual.forward = types.MethodType(_deduplicated_forward, visual)

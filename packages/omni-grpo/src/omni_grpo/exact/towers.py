"""The frozen media towers in exact mode: each distinct image, video and audio encoded alone.

Why: the rollout prefills a batch of prompts (every image of the batch in one tower call) while
the trainer's micro-batch holds other rows; a tower's matmuls and convolutions choose kernels by
the batch's size, so an image's embeddings could differ in the last bit between the two and every
later logprob with them. Encoded one item at a time, an item's tower call has the same shapes —
and the same deterministic kernels — in both, so its embeddings are bitwise the same. The KL
reference's forward encodes (or finds) them the same way: its logprobs are the policy's at the
reference's weights.

Each item's output is also kept (:class:`ItemCache`) and reused when the same item comes again:
the rollout's prefill encodes a step's images, videos and audios, and the trainer's forwards of
that step (policy and KL reference) find them instead of running the 27- and 32-layer towers
again — "computed once per prompt and shared by rollout and training", exact by construction
(the same item, the same frozen tower, the same output). Items are matched by exact equality of
their inputs, never by a hash alone; the cache is off while a tower has trainable parameters.
"""

from __future__ import annotations

from collections import OrderedDict
from types import MethodType
from typing import Any

import torch
from torch import nn


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


# Bytes of inputs and outputs the cache keeps (least recently used dropped first): a step's media
# at the benchmark sizes is ~0.3 GiB at 256 rows (32 prompts).
CACHE_BYTES = 2 << 30
_PROBES = 64  # values read back per item to sort items into buckets before the exact comparison


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, list | tuple):
        return sum(_nbytes(o) for o in obj)
    if hasattr(obj, "keys"):
        return sum(_nbytes(obj[k]) for k in obj)
    return 0


def _fresh(obj: Any) -> Any:
    """New containers around the same tensors: transformers rewrites fields of the output it
    gets (``vision_output.pooler_output = torch.split(...)``), which must not reach the cache."""
    if isinstance(obj, torch.Tensor) or obj is None:
        return obj
    if isinstance(obj, list | tuple) and not hasattr(obj, "keys"):
        items = [_fresh(o) for o in obj]
        return items if isinstance(obj, list) else type(obj)(items)
    if hasattr(obj, "keys"):
        return type(obj)(**{k: _fresh(obj[k]) for k in obj})
    return obj


class ItemCache:
    """Tower outputs of recent items, keyed by the item's input tensors (equal inputs, same
    output). A key holds shapes, dtypes and a few probed values; a hit is confirmed by
    ``torch.equal`` on every input, so two items that merely share the probes never mix."""

    def __init__(self, params: list[nn.Parameter], capacity_bytes: int = CACHE_BYTES) -> None:
        self.params = params
        self.capacity = capacity_bytes
        # entry id -> (key, inputs, output, bytes), least recently used first; key -> entry ids
        self.entries: OrderedDict[int, tuple[tuple, tuple[torch.Tensor, ...], Any, int]] = (
            OrderedDict()
        )
        self.buckets: dict[tuple, list[int]] = {}
        self.bytes = 0
        self.hits = self.misses = 0
        self._next_id = 0

    def enabled(self) -> bool:
        """Off while the tower trains (its output for an item changes with every step)."""
        return not any(p.requires_grad for p in self.params)

    @staticmethod
    def _key(inputs: tuple[torch.Tensor, ...], tag: str) -> tuple:
        probes = []
        for x in inputs:
            flat = x.reshape(-1)
            step = max(1, flat.numel() // _PROBES)
            probes.append(flat[::step][:_PROBES])
        sample = [v for p in probes for v in p.float().tolist()]  # inputs may sit on two devices
        meta = tuple((tuple(x.shape), x.dtype, x.device) for x in inputs)
        return tag, meta, tuple(sample)

    def get(self, inputs: tuple[torch.Tensor, ...], tag: str = "") -> Any | None:
        """``tag``: what else the output depends on (the call's other arguments)."""
        for entry_id in self.buckets.get(self._key(inputs, tag), []):
            _, stored, out, _ = self.entries[entry_id]
            if all(torch.equal(a, b) for a, b in zip(stored, inputs, strict=True)):
                self.entries.move_to_end(entry_id)
                self.hits += 1
                return _fresh(out)
        self.misses += 1
        return None

    def put(self, inputs: tuple[torch.Tensor, ...], out: Any, tag: str = "") -> None:
        kept = tuple(x.detach().clone() for x in inputs)  # a view would pin the whole batch
        size = _nbytes(kept) + _nbytes(out)
        if size > self.capacity:
            return
        key, entry_id = self._key(inputs, tag), self._next_id
        self._next_id += 1
        self.entries[entry_id] = (key, kept, _fresh(out), size)
        self.buckets.setdefault(key, []).append(entry_id)
        self.bytes += size
        while self.bytes > self.capacity:
            dropped, (old_key, _, _, old_size) = self.entries.popitem(last=False)
            self.buckets[old_key].remove(dropped)
            if not self.buckets[old_key]:
                del self.buckets[old_key]
            self.bytes -= old_size

    def clear(self) -> None:
        self.entries.clear()
        self.buckets.clear()
        self.bytes = 0


# Keyword arguments transformers passes down to a tower that cannot change its output: the text
# decoder's cache and router switches. The rollout's prefill passes ``use_cache=True``, the
# trainer's forwards ``use_cache=None``; keyed on them, every policy forward missed the items
# the rollout had encoded and ran the towers again, one item per call (measured on the H200:
# ~10x the rollout's tower attention calls in one update).
_IRRELEVANT_KWARGS = frozenset({"use_cache", "output_router_logits"})


def _tag(kw: dict[str, Any]) -> str:
    """What, beside the item's tensors, a cached output depends on: the call's other arguments."""
    return repr(sorted((k, v) for k, v in kw.items() if k not in _IRRELEVANT_KWARGS))


def _cached(
    cache: ItemCache | None, inputs: tuple[torch.Tensor, ...], tag: str, encode: Any
) -> Any:
    """``encode()`` for one item, through ``cache`` when it is on."""
    if cache is None or not cache.enabled():
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
    cache: ItemCache | None = getattr(self, "omni_item_cache", None)
    parts = hidden_states.split(grid_thw.prod(-1).tolist())
    items = [(parts[i], grid_thw[i]) for i in range(len(parts))]
    from omni_grpo.models.vision_dedup import first_copies

    firsts = first_copies(hidden_states, grid_thw)  # a group's rows repeat their prompt's pixels
    pieces = {
        i: _cached(
            cache,
            items[i],
            _tag(kw),
            lambda i=i: forward(self, parts[i], grid_thw[i : i + 1], **kw),
        )
        for i in sorted(set(firsts))
    }
    return pieces[firsts[0]] if len(firsts) == 1 else _concat([pieces[i] for i in firsts])


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
    cache: ItemCache | None = getattr(self, "omni_item_cache", None)
    single_unmasked = feature_attention_mask is None and input_features.shape[0] == 1
    if feature_attention_mask is None:
        feature_attention_mask = torch.ones(
            input_features.shape[0], input_features.shape[2], dtype=torch.long
        )
    items = [
        (input_features[i : i + 1], feature_attention_mask[i : i + 1])
        for i in range(input_features.shape[0])
    ]
    lengths = feature_attention_mask.to(input_features.device).bool().sum(-1)
    firsts = same_items(input_features, lengths)
    pieces = {
        i: _cached(
            cache,
            items[i],
            _tag(kw),
            lambda i=i: encode(self, items[i][0], None if single_unmasked else items[i][1], **kw),
        )
        for i in sorted(set(firsts))
    }
    return torch.cat([pieces[i] for i in firsts])


def encode_towers_per_item(thinker: nn.Module) -> None:
    """Make the vision tower and the audio tower of ``thinker`` encode one item per call."""
    visual = getattr(thinker.model, "visual", None)
    if visual is not None:
        visual.omni_item_cache = ItemCache(list(visual.parameters()))
        visual.forward = MethodType(_visual_per_item, visual)
    tower = getattr(getattr(thinker, "audio", None), "tower", None)
    if tower is not None:
        tower.omni_item_cache = ItemCache([])  # FrozenAudioTower: frozen by construction
        tower.encode = MethodType(_encode_per_item, tower)


def clear_item_caches(thinker: nn.Module) -> int:
    """Empty the towers' item caches; returns how many entries were dropped.

    Why: a benchmark that feeds the same prompts at every step would otherwise find every item
    cached from the step before and time a rollout without towers — in training a step brings
    new prompts, so the benchmarks clear the caches at each step's start and time what a step
    really costs (the rollout encodes its media, the trainer's forwards reuse them).
    """
    dropped = 0
    for module in thinker.modules():  # the audio tower is no submodule: ``<module>.audio.tower``
        for tower in (module, getattr(getattr(module, "audio", None), "tower", None)):
            cache = getattr(tower, "__dict__", {}).get("omni_item_cache")
            if cache is not None and cache.entries:
                dropped += len(cache.entries)
                cache.clear()
    return dropped

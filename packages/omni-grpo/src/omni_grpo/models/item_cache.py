"""Tower outputs kept per media item, so a step encodes each image, video and audio once.

Why: the rollout's prefill encodes a step's media with the frozen 27-layer vision and 32-layer
audio towers, and the trainer's forwards of the same step (the policy's, the KL reference's) would
encode the same items again — "computed once per prompt and shared by rollout and training". A
frozen tower's output is a function of the item, so it is kept (:class:`ItemCache`) and found
again. Items are matched by exact equality of their inputs, never by a hash alone; the cache is
off while a tower has trainable parameters; the least recently used items go past ``CACHE_BYTES``.

Two users. Exact mode encodes each item alone (``exact.towers``: the same shapes in the rollout
and the trainer, so the same bits) and keeps each output. The option-off path keeps its batched
tower calls and cuts their outputs per item (:func:`cut_rows`): an item found again has the values
its first batch gave it — what the option-off numbers mean anyway (the tower's output for that
item, within the rounding its batch's kernels give). :func:`reuse_tower_outputs` turns that on;
``OmniThinker`` does it for every model.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from functools import partial
from typing import Any

import torch
from torch import nn


def concat_outputs(outs: list[Any]) -> Any:
    """Per-item outputs joined along rows, whatever structure transformers returns."""
    first = outs[0]
    if first is None:
        return None
    if isinstance(first, torch.Tensor):
        return torch.cat(outs)
    if isinstance(first, list | tuple) and not hasattr(first, "keys"):
        joined = [concat_outputs([o[i] for o in outs]) for i in range(len(first))]
        return joined if isinstance(first, list) else type(first)(joined)
    if hasattr(first, "keys"):
        return type(first)(**{k: concat_outputs([o[k] for o in outs]) for k in first})
    raise TypeError(f"tower outputs: cannot join tower outputs of type {type(first).__name__}")


# Bytes of inputs and outputs the cache keeps (least recently used dropped first): a step's media
# at the benchmark sizes is ~0.3 GiB at 256 rows (32 prompts).
CACHE_BYTES = 2 << 30
_PROBES = 64  # values read back per item to sort items into buckets before the exact comparison


def nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, list | tuple):
        return sum(nbytes(o) for o in obj)
    if hasattr(obj, "keys"):
        return sum(nbytes(obj[k]) for k in obj)
    return 0


def fresh(obj: Any) -> Any:
    """New containers around the same tensors: transformers rewrites fields of the output it
    gets (``vision_output.pooler_output = torch.split(...)``), which must not reach the cache."""
    if isinstance(obj, torch.Tensor) or obj is None:
        return obj
    if isinstance(obj, list | tuple) and not hasattr(obj, "keys"):
        items = [fresh(o) for o in obj]
        return items if isinstance(obj, list) else type(obj)(items)
    if hasattr(obj, "keys"):
        return type(obj)(**{k: fresh(obj[k]) for k in obj})
    return obj


class ItemCache:
    """Tower outputs of recent items, keyed by the item's input tensors (equal inputs, same
    output). A key holds shapes, dtypes and a few probed values; a hit is confirmed by
    ``torch.equal`` on every input, so two items that merely share the probes never mix.

    Kept outputs belong to the tower's weights as they were: a write to any of ``params`` (a
    weight sync's ``copy_`` into a rollout actor's frozen tower, ``load_state_dict``, an optimizer
    step, ``module.to``) changes its version counter or storage, and the next look-up drops them."""

    def __init__(self, tower: nn.Module | None = None, capacity_bytes: int = CACHE_BYTES) -> None:
        self.tower = tower  # None: a tower frozen by construction (the audio tower)
        self.capacity = capacity_bytes
        # entry id -> (key, inputs, output, bytes), least recently used first; key -> entry ids
        self.entries: OrderedDict[int, tuple[tuple, tuple[torch.Tensor, ...], Any, int]] = (
            OrderedDict()
        )
        self.buckets: dict[tuple, list[int]] = {}
        self.bytes = 0
        self.hits = self.misses = 0
        self.off = False  # set when its tower's output cannot be cut per item
        self._next_id = 0
        self._weights = self._stamp(self.params)

    @property
    def params(self) -> list[nn.Parameter]:
        """The tower's parameters as they are now: adapters injected after the cache was made
        (LoRA on the vision tower) count, and make it trainable."""
        return [] if self.tower is None else list(self.tower.parameters())

    @staticmethod
    def _stamp(params: list[nn.Parameter]) -> tuple[tuple[int, int], ...]:
        return tuple((p._version, p.data_ptr()) for p in params)

    def enabled(self) -> bool:
        """Off while the tower trains (its output for an item changes with every step)."""
        return not self.off and not any(p.requires_grad for p in self.params)

    def ready(self) -> bool:
        """:meth:`enabled`, and the kept items dropped if the weights were written since: once
        per tower call, before its items' :meth:`get` and :meth:`put` (one walk of the tower's
        parameters, ~350 in the vision tower, per call rather than per item)."""
        params = self.params
        if self.off or any(p.requires_grad for p in params):
            return False
        stamp = self._stamp(params)
        if stamp != self._weights:
            self.clear()
            self._weights = stamp
        return True

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
        """``tag``: what else the output depends on (the call's other arguments). Callers ask
        :meth:`ready` first, once per tower call."""
        for entry_id in self.buckets.get(self._key(inputs, tag), []):
            _, stored, out, _ = self.entries[entry_id]
            if all(torch.equal(a, b) for a, b in zip(stored, inputs, strict=True)):
                self.entries.move_to_end(entry_id)
                self.hits += 1
                return fresh(out)
        self.misses += 1
        return None

    def put(self, inputs: tuple[torch.Tensor, ...], out: Any, tag: str = "") -> None:
        kept = tuple(x.detach().clone() for x in inputs)  # a view would pin the whole batch
        size = nbytes(kept) + nbytes(out)
        if size > self.capacity:
            return
        key, entry_id = self._key(inputs, tag), self._next_id
        self._next_id += 1
        self.entries[entry_id] = (key, kept, fresh(out), size)
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
IRRELEVANT_KWARGS = frozenset({"use_cache", "output_router_logits"})


def call_tag(kw: dict[str, Any], *context: Any) -> str:
    """What, beside the item's tensors, a cached output depends on: the call's other arguments,
    the autocast state the tower runs under, and ``context`` (say, its weights' dtype and device,
    which move with ``model.to`` while the cache stays)."""
    autocast = [
        (d, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)
    ]
    kept = sorted((k, v) for k, v in kw.items() if k not in IRRELEVANT_KWARGS)
    return repr((kept, autocast, context))


def weights_context(module: nn.Module) -> tuple[Any, ...]:
    """The dtype and device of ``module``'s weights (a cache tag's context): what its outputs are
    computed in changes with ``module.to(...)``, the cache on it does not."""
    first = next(module.parameters(), None)
    return () if first is None else (first.dtype, first.device)


def cut_rows(out: Any, splits: dict[int, list[int]], n: int) -> list[Any] | None:
    """``out`` of one batched tower call over ``n`` items, as ``n`` per-item outputs.

    ``splits`` maps a row count to the per-item row counts it splits into (a vision output has
    tensors over the patches and over the merged tokens). A tensor whose first dimension is no key,
    or anything but tensors, ``None`` and containers of them: None (the output cannot be cut, so it
    is not kept). Pieces are copies, so an item dropped from the cache frees its rows."""
    if out is None:
        return [None] * n
    if isinstance(out, torch.Tensor):
        sizes = splits.get(out.shape[0]) if out.dim() > 0 else None
        if sizes is None:
            return None
        parts = out.split(sizes)
        return list(parts) if n == 1 else [p.clone() for p in parts]
    if hasattr(out, "keys"):  # transformers' ModelOutput (its None fields are no keys)
        per = {k: cut_rows(out[k], splits, n) for k in out}
        if any(v is None for v in per.values()):
            return None
        return [type(out)(**{k: v[i] for k, v in per.items()}) for i in range(n)]
    if isinstance(out, list | tuple):
        seq = [cut_rows(o, splits, n) for o in out]
        if any(v is None for v in seq):
            return None
        return [type(out)(v[i] for v in seq) for i in range(n)]
    return None


def through_cache(
    cache: ItemCache,
    items: list[tuple[torch.Tensor, ...]],
    first_of: list[int],
    tag: str,
    encode: Any,
) -> Any | None:
    """The joined output for ``items`` (one per row of the call; ``first_of[i]``: the first item
    equal to item ``i``): kept items found, the others encoded in one batched call. ``cache``
    answered :meth:`ItemCache.ready` for this call.

    ``encode(indices)`` encodes the distinct items ``indices`` in one call and returns their
    outputs cut per item (or None when its output cannot be cut: nothing is kept, and this
    returns None so the caller runs its own path)."""
    distinct = sorted(set(first_of))
    found = {j: cache.get(items[j], tag) for j in distinct}
    missing = [j for j in distinct if found[j] is None]
    if missing:
        with torch.no_grad():  # a frozen tower (else the cache is off): no graph to keep
            pieces = encode(missing)
        if pieces is None:
            return None
        for j, piece in zip(missing, pieces, strict=True):
            cache.put(items[j], piece, tag)
            found[j] = fresh(piece)
    if len(first_of) == 1:
        return found[first_of[0]]
    return concat_outputs([found[j] for j in first_of])


def _encode_reusing(
    self: Any,
    input_features: torch.Tensor,
    feature_attention_mask: torch.Tensor | None,
    **kw: Any,
) -> torch.Tensor:
    """``FrozenAudioTower.encode`` through the cache: the audios not kept are encoded in one
    call (the tower's own batching and checks), their outputs cut by each audio's token count.
    An audio is keyed on its valid frames only, which is all the tower reads: the same audio
    padded to another batch's length is found too."""
    from omni_audio_inject.tower import same_items

    encode = type(self).encode
    cache: ItemCache | None = self.__dict__.get("omni_item_cache")
    mask = feature_attention_mask
    if mask is None and input_features.ndim == 3:
        mask = torch.ones(input_features.shape[0], input_features.shape[2], dtype=torch.long)
    if (
        cache is None
        or not cache.ready()
        or input_features.ndim != 3
        or mask.shape != (input_features.shape[0], input_features.shape[2])
    ):
        return encode(self, input_features, feature_attention_mask, **kw)
    valid = mask.to(input_features.device).bool()
    lengths = valid.sum(-1)
    if bool((lengths == 0).any()):
        return encode(self, input_features, feature_attention_mask, **kw)  # its error
    items = [(input_features[i][:, valid[i]],) for i in range(input_features.shape[0])]

    def batch(indices: list[int]) -> list[torch.Tensor]:
        every = len(indices) == len(items)  # distinct, sorted: all of them
        feats, masks = (input_features, mask) if every else (input_features[indices], mask[indices])
        out = encode(self, feats, masks, **kw)
        tokens = self.output_lengths(lengths[indices].cpu()).tolist()
        return cut_rows(out, {out.shape[0]: tokens}, len(indices))

    out = through_cache(cache, items, same_items(input_features, lengths), call_tag(kw), batch)
    return encode(self, input_features, feature_attention_mask, **kw) if out is None else out


def reuse_tower_outputs(thinker: nn.Module) -> None:
    """Keep ``thinker``'s tower outputs per item (the option-off path: batched tower calls).

    The vision tower's deduplicating forward (``models.vision_dedup``) reads its
    ``omni_item_cache``; the audio tower (no ``nn.Module``: shared by a model's copies, and so is
    its cache) encodes through :func:`_encode_reusing`. Exact mode replaces both
    (``exact.towers.encode_towers_per_item``)."""
    visual = getattr(getattr(thinker, "model", None), "visual", None)
    if visual is not None:
        visual.omni_item_cache = ItemCache(visual)
    tower = getattr(getattr(thinker, "audio", None), "tower", None)
    if tower is not None:
        tower.omni_item_cache = ItemCache()  # FrozenAudioTower: frozen by construction
        tower.encode = partial(_encode_reusing, tower)  # a partial pickles (Ray), a method not


def _caches(thinker: nn.Module) -> Iterator[ItemCache]:
    """Each item cache of ``thinker``'s towers once (the audio tower is no submodule)."""
    seen: set[int] = set()
    for module in thinker.modules():
        for tower in (module, getattr(getattr(module, "audio", None), "tower", None)):
            cache = getattr(tower, "__dict__", {}).get("omni_item_cache")
            if cache is not None and id(cache) not in seen:
                seen.add(id(cache))
                yield cache


def item_cache_counts(thinker: nn.Module) -> dict[str, int]:
    """Items found (``hits``) and encoded (``misses``) by ``thinker``'s towers so far: a
    benchmark reads what its rollout encoded and that its update encoded nothing again."""
    caches = list(_caches(thinker))
    return {"hits": sum(c.hits for c in caches), "misses": sum(c.misses for c in caches)}


def clear_item_caches(thinker: nn.Module) -> int:
    """Empty the towers' item caches; returns how many entries were dropped.

    Why: a benchmark that feeds the same prompts at every step would otherwise find every item
    kept from the step before and time a rollout without towers — in training a step brings new
    prompts, so the benchmarks clear the caches at each step's start and time what a step really
    costs (the rollout encodes its media, the trainer's forwards reuse them).
    """
    dropped = 0
    for cache in _caches(thinker):
        dropped += len(cache.entries)
        cache.clear()
    return dropped

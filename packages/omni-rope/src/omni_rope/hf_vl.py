"""Make a HF ``Qwen3VLMoeForConditionalGeneration`` (omni-extract's ``vl`` checkpoint) use Omni positions.

Why: the pseudo-VL checkpoint carries the Omni thinker's weights, but Qwen3-VL's own ``get_rope_index``
splits videos into one-frame groups around timestamp text and knows no audio, so Omni-layout video
and audio tokens would get silently wrong positions. ``install_omni_rope`` swaps in the Omni rule.

Hook points (the same two the Omni thinker uses), both removable:

* a forward pre-hook (``register_forward_pre_hook(with_kwargs=True, prepend=True)``) that pops the
  Omni-only kwargs (``video_second_per_grid``, ``use_audio_in_video``, ``audio_seqlens``), computes
  ``position_ids`` with :func:`omni_rope.get_rope_index` when the caller gave none, and stores the
  decode deltas in ``model.model.rope_deltas`` exactly where the VL model (and Omni) keep them;
* ``_prepare_position_ids_for_generation`` on the instance, so ``generate()`` builds the same
  ``[4,B,L]`` prefill positions as the Omni thinker and then extends them the same way; and
  ``_validate_model_kwargs``, so ``generate()`` accepts the Omni-only kwargs instead of rejecting
  them as unused (they stay in ``model_kwargs`` for the prefill positions and are popped per step).

Image and text positions are the same under the Omni and the VL formulas (proved by
``tests/test_hf_vl.py::test_vl_formula_coincides_for_text_and_images``), so one core serves every
segment; videos and audio take the Omni formula.

For another model wrapper (e.g. a Megatron-Bridge Qwen3-VL model) the hook point is the same pure
core: compute ``positions, deltas = get_rope_index(input_ids, attention_mask, config, grids...,
second_per_grids=..., audio_seqlens=...)`` where the wrapper builds its M-RoPE inputs and pass
``positions`` as its ``position_ids`` (``[3,B,L]``, t/h/w rows); for decoding, positions continue as
``last + 1`` per step (:func:`next_position_ids`), as ``generate()`` does.

``video_second_per_grid`` handling survives micro-batch splits: each forward consumes, in order, as
many entries as it has videos (``len(video_grid_thw)``). A forward may pass its own entries, or the
whole batch's list (then a cursor walks through it across micro-batches), or nothing after
:meth:`OmniRopeHandle.feed_second_per_grid` queued the list.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch

from omni_rope.config import OmniRopeConfig
from omni_rope.errors import OmniRopeError
from omni_rope.positions import get_rope_index

# Keyword names accepted for each Omni-only input (first is the Omni thinker's forward name).
SECOND_PER_GRID_KEYS: tuple[str, ...] = ("video_second_per_grid", "second_per_grids")
AUDIO_LENGTH_KEYS: tuple[str, ...] = ("audio_seqlens",)
# Read but left in place: the audio injector (omni-audio-inject) consumes them.
SHARED_AUDIO_KEYS: tuple[str, ...] = ("audio_feature_lengths", "feature_attention_mask")
OWN_KEYS: tuple[str, ...] = (*SECOND_PER_GRID_KEYS, "use_audio_in_video", *AUDIO_LENGTH_KEYS)
_HANDLE_ATTR = "_omni_rope_handle"


class SecondPerGridCursor:
    """Hands out ``video_second_per_grid`` entries in batch order across (micro-batch) forwards."""

    def __init__(self) -> None:
        self._values: torch.Tensor | None = None
        self._pos = 0

    @property
    def remaining(self) -> int:
        return 0 if self._values is None else self._values.numel() - self._pos

    def feed(self, values: torch.Tensor | Sequence[float]) -> None:
        """Queue the whole batch's seconds-per-grid; later forwards consume them in order."""
        if self.remaining:
            raise OmniRopeError(
                f"video_second_per_grid: {self.remaining} queued entries were never consumed; "
                "call reset() before feeding a new batch"
            )
        self._values, self._pos = _as_vector(values), 0

    def reset(self) -> None:
        self._values, self._pos = None, 0

    def take(self, given: Any, n: int) -> torch.Tensor | None:
        """The ``n`` entries for this forward (``given``: what the forward was passed, if anything)."""
        if n == 0:
            return None
        if given is not None:
            given = _as_vector(given)
            if given.numel() == n and not self._continues(given):
                self.reset()  # a correctly split micro-batch; any leftover list is stale
                return given
            if not self._continues(given):
                self._values, self._pos = given, 0
        if self._values is None:
            raise OmniRopeError(
                f"this forward has {n} video(s) but no video_second_per_grid was passed or fed "
                "(temporal_patch_size / sampled fps, one entry per video)"
            )
        if self.remaining < n:
            raise OmniRopeError(
                f"video_second_per_grid: this forward has {n} video(s) but only {self.remaining} of "
                f"the batch's {self._values.numel()} entries are left"
            )
        out = self._values[self._pos : self._pos + n]
        self._pos += n
        if not self.remaining:
            self.reset()
        return out

    def _continues(self, given: torch.Tensor) -> bool:
        """Is ``given`` the batch list already being walked (same object or same values)?"""
        v = self._values
        if v is None or not self.remaining:
            return False
        return given is v or (given.shape == v.shape and torch.equal(given.cpu(), v.cpu()))


def _as_vector(values: Any) -> torch.Tensor:
    t = torch.as_tensor(values).detach()
    if t.ndim == 2 and t.shape[1] == 1:
        t = t[:, 0]
    if t.ndim != 1:
        raise OmniRopeError(
            f"video_second_per_grid: expected one entry per video, got shape {tuple(t.shape)}"
        )
    return t


class OmniRopeHandle:
    """An installed override; ``remove()`` (or leaving a ``with`` block) restores the VL model."""

    def __init__(self, model: torch.nn.Module, config: OmniRopeConfig) -> None:
        self.model = model
        self.config = config
        self.cursor = SecondPerGridCursor()
        self.base = _base_model(model)
        self._signature = inspect.signature(model.forward)
        self._hook = model.register_forward_pre_hook(self._pre_hook, with_kwargs=True, prepend=True)
        self._patched_generation = hasattr(model, "_prepare_position_ids_for_generation")
        if self._patched_generation:
            self._validate = model._validate_model_kwargs
            model._prepare_position_ids_for_generation = self._prepare_position_ids_for_generation
            model._validate_model_kwargs = self._validate_model_kwargs
        setattr(model, _HANDLE_ATTR, self)
        self.removed = False

    # ------------------------------------------------------------------ lifecycle

    def remove(self) -> None:
        if self.removed:
            return
        self._hook.remove()
        if self._patched_generation:
            del self.model._prepare_position_ids_for_generation
            del self.model._validate_model_kwargs
        delattr(self.model, _HANDLE_ATTR)
        self.base.rope_deltas = None
        self.cursor.reset()
        self.removed = True

    def __enter__(self) -> OmniRopeHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def feed_second_per_grid(self, values: torch.Tensor | Sequence[float]) -> None:
        """Queue the batch's seconds-per-grid for wrappers that cannot pass extra forward kwargs."""
        self.cursor.feed(values)

    # ------------------------------------------------------------------ positions

    def positions(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        *,
        image_grid_thw: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        second_per_grid: Any = None,
        audio_seqlens: Any = None,
        use_audio_in_video: bool | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Omni positions for one forward, taking seconds-per-grid through the cursor."""
        n_videos = 0 if video_grid_thw is None else int(video_grid_thw.shape[0])
        return get_rope_index(
            input_ids,
            attention_mask,
            self.config,
            image_grid_thw=image_grid_thw,
            video_grid_thw=video_grid_thw,
            second_per_grids=self.cursor.take(second_per_grid, n_videos),
            audio_seqlens=audio_seqlens,
            use_audio_in_video=use_audio_in_video,
        )

    def _pre_hook(
        self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]
    ) -> tuple[tuple, dict[str, Any]]:
        kw = dict(self._signature.bind_partial(*args, **kwargs).arguments)
        extra = kw.pop("kwargs", None)
        if isinstance(extra, dict):
            kw.update(extra)
        spg = _pop_first(kw, SECOND_PER_GRID_KEYS)
        use_aiv = kw.pop("use_audio_in_video", None)
        audio = _audio_lengths(kw, pop=True)
        if kw.get("position_ids") is None:
            pos = self._forward_positions(kw, spg, audio, use_aiv)
            if pos is not None:
                kw["position_ids"] = pos
        return (), kw

    def _forward_positions(
        self, kw: dict[str, Any], spg: Any, audio: Any, use_aiv: bool | None
    ) -> torch.Tensor | None:
        """What the Omni thinker's ``compute_3d_position_ids`` does, with the Omni rule."""
        input_ids, mask = kw.get("input_ids"), kw.get("attention_mask")
        cache = kw.get("cache", kw.get("past_key_values"))
        cache_length = 0 if cache is None else cache.get_seq_length()
        if input_ids is not None and (self.base.rope_deltas is None or cache_length == 0):
            if mask is not None and mask.ndim != 2:
                raise OmniRopeError(
                    f"attention_mask: the Omni positions need a 2-D [batch, seq] mask, got {mask.ndim}-D"
                )
            pos, deltas = self.positions(
                input_ids,
                mask,
                image_grid_thw=kw.get("image_grid_thw"),
                video_grid_thw=kw.get("video_grid_thw"),
                second_per_grid=spg,
                audio_seqlens=audio,
                use_audio_in_video=use_aiv,
            )
            self.base.rope_deltas = deltas
            return pos
        if self.base.rope_deltas is not None and (cache_length > 0 or input_ids is None):
            embeds = kw.get("inputs_embeds")
            batch, seq = (embeds if embeds is not None else input_ids).shape[:2]
            device = (embeds if embeds is not None else input_ids).device
            if mask is not None:
                pos = mask.long().cumsum(-1) - 1
                pos = pos.masked_fill(mask == 0, 0).view(1, batch, -1).repeat(3, 1, 1).to(device)
            else:
                pos = torch.arange(cache_length, cache_length + seq, device=device)
                pos = pos.view(1, 1, -1).expand(3, batch, -1)
            deltas = self.base.rope_deltas
            return pos + deltas.repeat_interleave(batch // deltas.shape[0], dim=0).to(device)
        return None

    def _validate_model_kwargs(self, model_kwargs: dict[str, Any]) -> None:
        """transformers' check for unused generate kwargs, minus the ones this override consumes."""
        self._validate({k: v for k, v in model_kwargs.items() if k not in OWN_KEYS})

    def _prepare_position_ids_for_generation(
        self, inputs_tensor: torch.Tensor, model_kwargs: dict[str, Any]
    ) -> torch.Tensor:
        """``[4,B,L]`` prefill positions (text row + Omni t/h/w), as the Omni thinker's ``generate``."""
        from transformers import GenerationMixin

        text = GenerationMixin._prepare_position_ids_for_generation(
            self.model, inputs_tensor, model_kwargs
        )
        cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
        past = 0 if cache is None else cache.get_seq_length()
        if past != 0 and self.base.rope_deltas is not None:
            return text[None, ...] + self.base.rope_deltas
        ids = model_kwargs.get("input_ids")
        if ids is not None and ids.shape[1] > 0:
            inputs_tensor = ids
        is_ids = inputs_tensor.ndim == 2 and inputs_tensor.dtype in (torch.int, torch.long)
        mask = model_kwargs.get("attention_mask")
        if is_ids and mask is not None:
            spg = next((model_kwargs[k] for k in SECOND_PER_GRID_KEYS if k in model_kwargs), None)
            vision, deltas = self.positions(
                inputs_tensor,
                mask,
                image_grid_thw=model_kwargs.get("image_grid_thw"),
                video_grid_thw=model_kwargs.get("video_grid_thw"),
                second_per_grid=spg,
                audio_seqlens=_audio_lengths(model_kwargs, pop=False),
                use_audio_in_video=model_kwargs.get("use_audio_in_video"),
            )
            self.base.rope_deltas = deltas
        else:
            vision = text.unsqueeze(0).expand(3, -1, -1)
            self.base.rope_deltas = torch.zeros(
                inputs_tensor.shape[0], 1, dtype=torch.long, device=inputs_tensor.device
            )
        return torch.cat([text[None, ...], vision], dim=0)


def install_omni_rope(
    model: torch.nn.Module, config: OmniRopeConfig | None = None
) -> OmniRopeHandle:
    """Make ``model`` (a HF Qwen3-VL(-MoE) model) use Omni TM-RoPE positions; returns the handle.

    ``config`` defaults to the model config's ``omni_sideband`` (written by omni-extract).
    """
    if getattr(model, _HANDLE_ATTR, None) is not None:
        raise OmniRopeError(
            "omni-rope is already installed on this model; remove() the handle first"
        )
    if config is None:
        config = OmniRopeConfig.from_vl_config(model.config)
    return OmniRopeHandle(model, config)


def next_position_ids(position_ids: torch.Tensor, num_new: int = 1) -> torch.Tensor:
    """Positions of ``num_new`` decoded tokens after ``position_ids`` (``[3|4,B,L]``): ``last + 1 ...``.

    This is how ``generate()`` extends the prefill positions of both the Omni thinker and the VL
    model, so a manual decode loop that uses it decodes exactly like ``generate()``.
    """
    step = torch.arange(1, num_new + 1, dtype=position_ids.dtype, device=position_ids.device)
    return position_ids[..., -1:] + step


def _base_model(model: torch.nn.Module) -> torch.nn.Module:
    inner = getattr(model, "model", None)
    if inner is not None and hasattr(inner, "rope_deltas"):
        return inner
    if hasattr(model, "rope_deltas"):
        return model
    raise OmniRopeError(
        f"{type(model).__name__}: not a Qwen3-VL model (no rope_deltas on it or on .model)"
    )


def _pop_first(kw: dict[str, Any], keys: Sequence[str]) -> Any:
    found = [kw.pop(k) for k in keys if k in kw]
    found = [v for v in found if v is not None]
    return found[0] if found else None


def _audio_lengths(kw: dict[str, Any], *, pop: bool) -> Any:
    """Mel frames per audio: ``audio_seqlens``, else ``audio_feature_lengths``, else the mask's sums."""
    own = _pop_first(kw, AUDIO_LENGTH_KEYS) if pop else kw.get(AUDIO_LENGTH_KEYS[0])
    if own is not None:
        return own
    if kw.get("audio_feature_lengths") is not None:
        return kw["audio_feature_lengths"]
    fam = kw.get("feature_attention_mask")
    return None if fam is None else fam.sum(-1)

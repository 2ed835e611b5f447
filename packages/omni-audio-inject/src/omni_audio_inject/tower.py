"""A frozen Qwen3-Omni audio tower, loaded on first use and kept out of the trained model.

Why it sits outside the module tree: the tower is never trained, so it must not reach the optimizer,
DDP/FSDP gradient sync, checkpoints or weight sync to the rollout server. Keeping it as a plain
attribute of a plain Python object (not an ``nn.Module`` child) makes every one of those exclusions
automatic: ``parameters()``, ``named_parameters()``, ``state_dict()`` and wrappers that walk them
simply never see it.

The module itself is transformers' ``Qwen3OmniMoeAudioEncoder`` built from the config, so its
numerics are the reference's by construction.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from omni_audio_inject.errors import AudioInjectError
from omni_audio_inject.lengths import audio_output_lengths
from omni_audio_inject.source import TowerSource, audio_config_of, locate_tower, read_tensors


def _encoder_classes() -> tuple[type, type]:
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
        Qwen3OmniMoeAudioEncoderConfig,
    )
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        Qwen3OmniMoeAudioEncoder,
    )

    return Qwen3OmniMoeAudioEncoderConfig, Qwen3OmniMoeAudioEncoder


def _materialise_buffers(module: nn.Module) -> None:
    """Recompute non-persistent buffers left on ``meta`` (the sinusoidal position table).

    The module is built on the meta device so that a 0.65 B-parameter tower is not randomly
    initialised only to be overwritten; weights arrive by ``load_state_dict(assign=True)``, but
    non-persistent buffers are not in any checkpoint and must be rebuilt here.
    """
    for name, sub in module.named_modules():
        for bname, buf in list(sub.named_buffers(recurse=False)):
            if not buf.is_meta:
                continue
            compute = getattr(sub, "compute_default_singular_positional_embedding", None)
            if compute is None:
                raise AudioInjectError(
                    f"audio tower buffer {name}.{bname} is not in the checkpoint and cannot be rebuilt"
                )
            with torch.device("cpu"):
                sub.register_buffer(bname, compute(), persistent=False)


def first_equal(items: Sequence[torch.Tensor], keys: Sequence[object] | None = None) -> list[int]:
    """For each item, the index of the first item equal to it (same key, same values).

    Exact comparison (``torch.equal``), no hashing: a frozen tower's output for an item depends on
    that item alone, so equal items are encoded once (the audio tower here, the vision tower in
    omni-grpo). ``keys`` (e.g. a grid) must match too.
    """
    keys = [None] * len(items) if keys is None else list(keys)
    firsts: list[int] = []
    out: list[int] = []
    for i, item in enumerate(items):
        for j in firsts:
            if keys[j] == keys[i] and torch.equal(items[j], item):
                out.append(j)
                break
        else:
            firsts.append(i)
            out.append(i)
    return out


def same_items(features: torch.Tensor, lengths: torch.Tensor) -> list[int]:
    """For each audio item, the index of the first item with the same valid frames.

    Why: a GRPO group's samples all carry their prompt's audio, and the frozen tower's output
    for an item depends on that item alone (its windows never mix items), so each distinct
    audio is encoded once and its rows reused.
    """
    valid = [features[i, :, : int(n)] for i, n in enumerate(lengths.tolist())]
    return first_equal(valid)


class FrozenAudioTower:
    """Lazily loaded, frozen audio encoder. Not an ``nn.Module`` on purpose (see module doc).

    ``root`` is omni-extract's ``audio`` output or an Omni checkpoint directory. Nothing is read
    until :meth:`module` (or :meth:`encode`) is first called; the location is validated by
    :meth:`check` without loading tensors.
    """

    def __init__(self, root: str | Path, attn_implementation: str | None = None) -> None:
        self.root = Path(root)
        self.attn_implementation = attn_implementation
        self._module: nn.Module | None = None
        self._config: Any = None
        self._lock = threading.Lock()

    def __deepcopy__(self, memo: dict[int, Any]) -> FrozenAudioTower:
        """Copies share the tower: it is frozen and never written, so one copy serves every model
        (e.g. the policy and its reference copy) without doubling its memory."""
        return self

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_lock")
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        state = "loaded" if self._module is not None else "not loaded"
        return f"FrozenAudioTower({str(self.root)!r}, {state})"

    @property
    def loaded(self) -> bool:
        return self._module is not None

    def _skeleton(self, config_dict: dict[str, Any] | None) -> tuple[Any, nn.Module]:
        config_cls, encoder_cls = _encoder_classes()
        cfg = config_cls(**{k: v for k, v in (config_dict or {}).items() if k != "model_type"})
        kwargs = {}
        if self.attn_implementation is not None:
            kwargs["attn_implementation"] = self.attn_implementation
        with torch.device("meta"):
            module = encoder_cls._from_config(cfg, **kwargs)
        return cfg, module

    def check(self) -> TowerSource:
        """Locate config and every tower tensor; raises ``MissingAudioTowerError`` naming the path."""
        config_dict = audio_config_of(self.root) if self.root.is_dir() else None
        _, skeleton = self._skeleton(config_dict)
        return locate_tower(self.root, set(skeleton.state_dict().keys()))

    @property
    def config(self) -> Any:
        """The ``Qwen3OmniMoeAudioEncoderConfig`` (loads nothing but ``config.json``)."""
        if self._config is None:
            self._config, _ = self._skeleton(self.check().config)
        return self._config

    def output_lengths(self, mel_frames: torch.Tensor) -> torch.Tensor:
        """Tokens per audio for ``mel_frames`` valid frames, using this tower's ``n_window``."""
        return audio_output_lengths(mel_frames, int(self.config.n_window))

    def module(self, device: torch.device | str, dtype: torch.dtype) -> nn.Module:
        """The encoder on ``device``/``dtype``, in eval mode, every parameter frozen."""
        with self._lock:
            if self._module is None:
                source = self.check()
                cfg, module = self._skeleton(source.config)
                state = read_tensors(source)
                module.load_state_dict(state, strict=True, assign=True)
                _materialise_buffers(module)
                self._config = cfg
                self._module = module
            module = self._module
            first = next(module.parameters())
            target = torch.empty(0, device=device).device  # "cuda" -> "cuda:0"
            if first.device != target or first.dtype != dtype:
                module.to(device=target, dtype=dtype)
            module.eval()
            module.requires_grad_(False)
            return module

    @torch.no_grad()
    def encode(
        self,
        input_features: torch.Tensor,
        feature_attention_mask: torch.Tensor | None,
        *,
        device: torch.device | str,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """``[Σ tokens, output_dim]`` for ``[n, mel, T]`` features, audios concatenated in order.

        Only valid frames (``feature_attention_mask``) are encoded, so padding never matters, and
        each distinct audio once (:func:`same_items`). Runs under ``no_grad``: nothing upstream of
        the LM embeddings is trained.
        """
        module = self.module(device, dtype)
        if input_features.ndim != 3:
            raise AudioInjectError(
                f"input_features must be [n_audio, mel_bins, frames], got {tuple(input_features.shape)}"
            )
        if feature_attention_mask is None:
            feature_attention_mask = torch.ones(
                input_features.shape[0], input_features.shape[2], dtype=torch.long
            )
        if feature_attention_mask.shape != (input_features.shape[0], input_features.shape[2]):
            raise AudioInjectError(
                f"feature_attention_mask {tuple(feature_attention_mask.shape)} does not match "
                f"input_features {tuple(input_features.shape)} (expected [n_audio, frames])"
            )
        mask = feature_attention_mask.to(input_features.device).bool()
        lengths = mask.sum(-1)
        if bool((lengths == 0).any()):
            empty = torch.nonzero(lengths == 0).flatten().tolist()
            raise AudioInjectError(f"audio items {empty} have no valid frames")
        first_of = same_items(input_features, lengths)
        unique = sorted(set(first_of))
        if len(unique) < len(first_of):  # a GRPO group repeats its prompt's audio per sample
            feats, umask = input_features[unique], mask[unique]
            flat = feats.permute(0, 2, 1)[umask].permute(1, 0)  # [mel, Σ T]
            out = module(flat.to(device), feature_lens=lengths[unique].to(device), return_dict=True)
            tokens = self.output_lengths(lengths[unique]).tolist()
            pieces = dict(zip(unique, out.last_hidden_state.split(tokens), strict=True))
            return torch.cat([pieces[i] for i in first_of])
        flat = input_features.permute(0, 2, 1)[mask].permute(1, 0)  # [mel, Σ T]
        out = module(flat.to(device), feature_lens=lengths.to(device), return_dict=True)
        return out.last_hidden_state

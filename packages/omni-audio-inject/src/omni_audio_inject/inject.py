"""The attachment: frozen tower + placeholder scatter, hooked where embeddings leave the embedding.

Hook point (the same for every backend): **embeddings in -> embeddings out, given input_ids and the
audio features**. For HF models that is a forward hook on ``get_input_embeddings()`` (the hook sees
the module's ``input_ids`` argument and returns the patched output); for a Megatron ``GPTModel`` it
is the ``LanguageModelEmbedding`` output (``[S, B, H]`` there: call :meth:`AudioInjector.inject`
with ``seq_dim`` handled by the caller, and a ``window`` under sequence parallelism, where each rank
holds the contiguous chunk ``[start, end)`` of the sequence).

Features are handed to the hook through :meth:`AudioInjector.feeding`, a context manager, so the
model's own forward signature does not need to change and a forward without features (a decode
step) is untouched.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from omni_audio_inject.errors import PlaceholderCountError
from omni_audio_inject.scatter import placeholder_mask, scatter_audio_embeds, scatter_audio_window
from omni_audio_inject.tower import FrozenAudioTower


@dataclass
class _Pending:
    input_features: torch.Tensor | None
    feature_attention_mask: torch.Tensor | None
    window: tuple[int, int] | None
    full_input_ids: torch.Tensor | None


class AudioInjector:
    """Fills audio placeholder rows of LM input embeddings from a :class:`FrozenAudioTower`.

    Holds the tower as a plain attribute: attaching an injector to a model adds no parameter,
    buffer or submodule to it.
    """

    def __init__(self, tower: FrozenAudioTower, audio_token_id: int) -> None:
        self.tower = tower
        self.audio_token_id = int(audio_token_id)
        self._pending: _Pending | None = None

    def __repr__(self) -> str:
        return f"AudioInjector(audio_token_id={self.audio_token_id}, tower={self.tower!r})"

    def inject(
        self,
        input_ids: torch.Tensor,
        inputs_embeds: torch.Tensor,
        input_features: torch.Tensor | None,
        feature_attention_mask: torch.Tensor | None = None,
        *,
        window: tuple[int, int] | None = None,
        full_input_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Return ``inputs_embeds`` with the audio rows filled (strict placeholder count).

        Without ``window``: ``input_ids`` and ``inputs_embeds`` cover the whole sequence. With
        ``window=(start, end)``: ``inputs_embeds`` is this rank's chunk and ``full_input_ids`` (or
        ``input_ids`` if it is the full sequence) is the unsplit ids, so the rank knows how many
        placeholders precede its window. Placeholders without features raise too.
        """
        ids = full_input_ids if full_input_ids is not None else input_ids
        mask = placeholder_mask(ids, self.audio_token_id)
        if input_features is None:
            n = int(mask.sum())
            if n:
                raise PlaceholderCountError(
                    n, 0, "input_ids hold audio placeholders but no input_features were given"
                )
            return inputs_embeds
        audio = self.tower.encode(
            input_features,
            feature_attention_mask,
            device=inputs_embeds.device,
            dtype=inputs_embeds.dtype,
        )
        if window is None:
            return scatter_audio_embeds(inputs_embeds, mask, audio)
        start, end = window
        return scatter_audio_window(inputs_embeds, mask, audio, start, end)

    @contextmanager
    def feeding(
        self,
        input_features: torch.Tensor | None,
        feature_attention_mask: torch.Tensor | None = None,
        *,
        window: tuple[int, int] | None = None,
        full_input_ids: torch.Tensor | None = None,
    ) -> Iterator[None]:
        """Make the attached hook inject these features on the next embedding call(s)."""
        previous = self._pending
        self._pending = _Pending(input_features, feature_attention_mask, window, full_input_ids)
        try:
            yield
        finally:
            self._pending = previous

    def _hook(self, module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
        pending = self._pending
        if pending is None:
            return output
        input_ids = args[0]
        return self.inject(
            input_ids,
            output,
            pending.input_features,
            pending.feature_attention_mask,
            window=pending.window,
            full_input_ids=pending.full_input_ids,
        )

    def attach(self, embedding: nn.Module) -> RemovableHandle:
        """Hook ``embedding`` (called as ``embedding(input_ids)``); ``handle.remove()`` detaches.

        Only calls inside :meth:`feeding` are changed; outside it the embedding is untouched.
        """
        return embedding.register_forward_hook(self._hook)

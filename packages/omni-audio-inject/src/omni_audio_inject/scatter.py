"""Put audio-encoder rows into the LLM input embeddings at the placeholder positions.

Pure tensor functions, shared by the HF thinker (hooked on ``embed_tokens``) and a Megatron
embedding: rows are consumed in batch order (row-major over ``[batch, position]``), the same order
as transformers' ``masked_scatter``, but the counts are checked strictly.

Sequence parallelism: a rank that owns only a contiguous window ``[start, end)`` of the sequence
(per batch row, or of a flattened/packed sequence) fills only that window. The encoder row for a
placeholder is its rank among all placeholders in row-major order, so a window needs either the
full placeholder mask (``scatter_audio_window``) or the number of placeholders that precede it
(``scatter_audio_rows``, for context parallelism where a rank never sees the full sequence).
"""

from __future__ import annotations

import torch

from omni_audio_inject.errors import PlaceholderCountError


def placeholder_mask(input_ids: torch.Tensor, audio_token_id: int) -> torch.Tensor:
    """Boolean mask of audio placeholder positions, same shape as ``input_ids``."""
    return input_ids == audio_token_id


def _check_embeds(embeds: torch.Tensor, mask: torch.Tensor, audio_embeds: torch.Tensor) -> None:
    if tuple(embeds.shape[:-1]) != tuple(mask.shape):
        raise ValueError(
            f"embeddings shape {tuple(embeds.shape)} does not match placeholder mask shape "
            f"{tuple(mask.shape)} (expected embeddings [*mask.shape, hidden])"
        )
    if audio_embeds.ndim != 2 or audio_embeds.shape[-1] != embeds.shape[-1]:
        raise ValueError(
            f"audio embeddings must be [rows, {embeds.shape[-1]}] (hidden size of the LM), "
            f"got {tuple(audio_embeds.shape)}"
        )


def scatter_audio_rows(
    embeds: torch.Tensor,
    mask: torch.Tensor,
    audio_embeds: torch.Tensor,
    first_row: int = 0,
) -> torch.Tensor:
    """Replace ``embeds`` at ``mask`` with ``audio_embeds[first_row : first_row + mask.sum()]``.

    ``embeds`` is ``[*mask.shape, hidden]``; rows are consumed in row-major order of ``mask``.
    ``first_row`` is how many placeholders precede this tensor in the full (unsplit) batch.
    Raises :class:`PlaceholderCountError` if the window asks for rows the encoder did not produce.
    Returns a new tensor (autograd flows into the non-audio rows of ``embeds``).
    """
    _check_embeds(embeds, mask, audio_embeds)
    n = int(mask.sum())
    if first_row < 0 or first_row + n > audio_embeds.shape[0]:
        raise PlaceholderCountError(
            first_row + n,
            audio_embeds.shape[0],
            f"window needs rows [{first_row}, {first_row + n})",
        )
    if n == 0:
        return embeds
    rows = audio_embeds[first_row : first_row + n].to(embeds.device, embeds.dtype)
    return embeds.masked_scatter(mask.unsqueeze(-1).to(embeds.device), rows)


def scatter_audio_embeds(
    embeds: torch.Tensor, mask: torch.Tensor, audio_embeds: torch.Tensor
) -> torch.Tensor:
    """The unsplit case: every placeholder gets a row and every row is used (strict count check)."""
    n = int(mask.sum())
    if n != audio_embeds.shape[0]:
        raise PlaceholderCountError(n, audio_embeds.shape[0])
    return scatter_audio_rows(embeds, mask, audio_embeds, 0)


def scatter_audio_window(
    window_embeds: torch.Tensor,
    full_mask: torch.Tensor,
    audio_embeds: torch.Tensor,
    start: int,
    end: int,
) -> torch.Tensor:
    """Fill one rank's sequence window ``[start, end)`` of the embeddings.

    ``full_mask`` is the unsplit placeholder mask, ``[L]`` (flattened/packed sequence) or
    ``[B, L]`` (the window is taken along the last dim of every row); ``window_embeds`` is
    ``[end - start, H]`` or ``[B, end - start, H]``. The total placeholder count is checked against
    the encoder rows, so every rank raises on the same bad batch. Concatenating the ranks' outputs
    along the sequence dim equals :func:`scatter_audio_embeds` on the full tensor.
    """
    length = full_mask.shape[-1]
    if not 0 <= start <= end <= length:
        raise ValueError(f"window [{start}, {end}) is outside the sequence of length {length}")
    total = int(full_mask.sum())
    if total != audio_embeds.shape[0]:
        raise PlaceholderCountError(total, audio_embeds.shape[0])
    mask2d = full_mask.reshape(-1, length)
    window = mask2d[:, start:end]
    if not window.any():
        return window_embeds
    # Row-major rank of each placeholder; the window keeps per-row runs, so each row of the window
    # is one contiguous run of encoder rows starting at the count before (row, start).
    before = torch.cumsum(mask2d.reshape(-1).long(), 0).reshape(mask2d.shape) - mask2d.long()
    index = before[:, start:end][window]
    rows = audio_embeds.index_select(0, index.to(audio_embeds.device))
    wmask = window.reshape(full_mask.shape[:-1] + (end - start,))
    _check_embeds(window_embeds, wmask, audio_embeds)
    rows = rows.to(window_embeds.device, window_embeds.dtype)
    return window_embeds.masked_scatter(wmask.unsqueeze(-1).to(window_embeds.device), rows)

"""Strict scatter and its sequence-parallel windows, against torch's own masked_scatter."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from omni_audio_inject import (
    PlaceholderCountError,
    scatter_audio_embeds,
    scatter_audio_rows,
    scatter_audio_window,
)

H = 4


@st.composite
def batches(draw: st.DrawFn) -> tuple[torch.Tensor, list[int]]:
    """A placeholder mask ([B, L], or flattened [B*L] for packed sequences) and rank boundaries."""
    b = draw(st.integers(1, 3))
    length = draw(st.integers(1, 24))
    bits = draw(st.lists(st.booleans(), min_size=b * length, max_size=b * length))
    mask = torch.tensor(bits).reshape(b, length)
    if draw(st.booleans()):
        mask = mask.reshape(-1)
    last = mask.shape[-1]
    n_ranks = draw(st.integers(1, 5))
    cuts = sorted(draw(st.lists(st.integers(0, last), min_size=n_ranks - 1, max_size=n_ranks - 1)))
    return mask, [0, *cuts, last]


@settings(max_examples=150, deadline=None)
@given(batches())
def test_simulated_ranks_equal_unsplit(case: tuple[torch.Tensor, list[int]]) -> None:
    mask, bounds = case
    windows = list(zip(bounds[:-1], bounds[1:], strict=True))
    embeds = torch.randn(*mask.shape, H)
    audio = torch.randn(int(mask.sum()), H)
    reference = embeds.masked_scatter(mask.unsqueeze(-1), audio)
    assert torch.equal(scatter_audio_embeds(embeds, mask, audio), reference)
    parts = [scatter_audio_window(embeds[..., s:e, :], mask, audio, s, e) for s, e in windows]
    assert torch.equal(torch.cat(parts, dim=-2), reference)
    if mask.ndim == 1:
        # Context-parallel form: a rank knows only its window and the count before it.
        rows = [
            scatter_audio_rows(embeds[s:e], mask[s:e], audio, int(mask[:s].sum()))
            for s, e in windows
        ]
        assert torch.equal(torch.cat(rows, dim=0), reference)


def test_rows_in_batch_order() -> None:
    mask = torch.tensor([[0, 1, 1, 0], [1, 0, 0, 1]], dtype=torch.bool)
    audio = torch.arange(4, dtype=torch.float32)[:, None].expand(4, H)
    out = scatter_audio_embeds(torch.full((2, 4, H), -1.0), mask, audio)
    assert out[..., 0].tolist() == [[-1, 0, 1, -1], [2, -1, -1, 3]]


@pytest.mark.parametrize("rows", [2, 4])
def test_count_mismatch_names_both_counts(rows: int) -> None:
    mask = torch.tensor([[0, 1, 1, 1]], dtype=torch.bool)
    with pytest.raises(PlaceholderCountError, match=f"3 audio placeholder tokens .* {rows} rows"):
        scatter_audio_embeds(torch.zeros(1, 4, H), mask, torch.zeros(rows, H))
    with pytest.raises(PlaceholderCountError, match=f"3 audio .* {rows} rows"):
        scatter_audio_window(torch.zeros(1, 2, H), mask, torch.zeros(rows, H), 2, 4)


def test_window_bounds_and_hidden_size_checked() -> None:
    mask = torch.tensor([[0, 1]], dtype=torch.bool)
    with pytest.raises(ValueError, match="outside the sequence"):
        scatter_audio_window(torch.zeros(1, 2, H), mask, torch.zeros(1, H), 1, 3)
    with pytest.raises(ValueError, match="hidden size"):
        scatter_audio_embeds(torch.zeros(1, 2, H), mask, torch.zeros(1, H + 1))


def test_gradient_flows_to_text_rows_only() -> None:
    mask = torch.tensor([[0, 1, 0]], dtype=torch.bool)
    embeds = torch.randn(1, 3, H, requires_grad=True)
    scatter_audio_embeds(embeds, mask, torch.randn(1, H)).sum().backward()
    assert embeds.grad[0, :, 0].tolist() == [1.0, 0.0, 1.0]

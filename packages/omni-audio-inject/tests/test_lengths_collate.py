"""Output-length arithmetic and micro-batch collation."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from omni_audio_inject import pad_audio_features
from omni_audio_inject.lengths import audio_output_lengths
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as hf


@pytest.mark.parametrize(
    ("frames", "tokens"),
    [(1, 1), (99, 13), (100, 13), (101, 14), (300, 39), (800, 104), (1000, 130), (4000, 520)],
)
def test_known_lengths(frames: int, tokens: int) -> None:
    assert audio_output_lengths(frames) == tokens


@given(st.lists(st.integers(1, 20000), min_size=1, max_size=16))
def test_lengths_match_reference(frames: list[int]) -> None:
    # The reference hard-codes 13 tokens per full chunk, which holds for the released n_window=50
    # only; we derive it from the conv strides, so compare at 50.
    t = torch.tensor(frames)
    assert torch.equal(audio_output_lengths(t, 50), hf._get_feat_extract_output_lengths(t, 50))


def test_pad_audio_features_right_pads_and_concatenates() -> None:
    a = torch.randn(1, 8, 5)
    b = torch.randn(2, 8, 3)
    empty = torch.zeros(0, 8, 7)
    feats, mask = pad_audio_features(
        [a, b, empty], [torch.ones(1, 5), torch.ones(2, 3), torch.zeros(0, 7)]
    )
    assert feats.shape == (3, 8, 7) and mask.shape == (3, 7)
    assert torch.equal(feats[0, :, :5], a[0]) and torch.equal(feats[1:, :, :3], b)
    assert (
        torch.count_nonzero(feats[:, :, 5:][0]) == 0 and torch.count_nonzero(feats[1:, :, 3:]) == 0
    )
    assert mask.sum(-1).tolist() == [5, 3, 3]


def test_pad_audio_features_names_the_bad_item() -> None:
    with pytest.raises(ValueError, match="item 1"):
        pad_audio_features(
            [torch.randn(1, 8, 5), torch.randn(1, 8, 4)], [torch.ones(1, 5), torch.ones(1, 5)]
        )
    with pytest.raises(ValueError, match="item 1: 4 mel bins"):
        pad_audio_features(
            [torch.randn(1, 8, 5), torch.randn(1, 4, 5)], [torch.ones(1, 5), torch.ones(1, 5)]
        )

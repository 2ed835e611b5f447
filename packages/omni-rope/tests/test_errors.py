"""Malformed inputs raise ``OmniRopeError`` naming the row, column and what disagrees."""

from __future__ import annotations

import pytest
import torch
from omni_rope import (
    OmniRopeError,
    audio_in_video_segment_ids,
    audio_segment_ids,
    get_rope_index,
    image_segment_ids,
    video_segment_ids,
)


def one_row(*parts) -> torch.Tensor:
    return torch.cat([torch.as_tensor(p, dtype=torch.long) for p in parts])[None]


TEXT = [5, 6, 7]


def test_video_without_second_per_grid(rope_config):
    ids = one_row(TEXT, video_segment_ids(rope_config, [2, 4, 4]))
    with pytest.raises(OmniRopeError, match="1 video.*no second_per_grids"):
        get_rope_index(ids, None, rope_config, video_grid_thw=torch.tensor([[2, 4, 4]]))


def test_second_per_grid_count(rope_config):
    ids = one_row(TEXT, video_segment_ids(rope_config, [2, 4, 4]))
    with pytest.raises(OmniRopeError, match=r"one entry per video \(1\), got 2"):
        get_rope_index(
            ids,
            None,
            rope_config,
            video_grid_thw=torch.tensor([[2, 4, 4]]),
            second_per_grids=torch.tensor([1.0, 1.0]),
        )


def test_more_grids_than_segments(rope_config):
    ids = one_row(TEXT, image_segment_ids(rope_config, [1, 4, 4]))
    with pytest.raises(OmniRopeError, match="image_grid_thw: 2 grid.*1 image segment"):
        get_rope_index(ids, None, rope_config, image_grid_thw=torch.tensor([[1, 4, 4], [1, 2, 2]]))


def test_grid_vs_placeholder_count(rope_config):
    seg = image_segment_ids(rope_config, [1, 4, 4])  # 4 placeholders
    ids = one_row(TEXT, seg[:2], seg[3:], TEXT)  # one dropped
    with pytest.raises(OmniRopeError, match=r"row 0, column 3: image #0 .*4 .*found 3 placeholder"):
        get_rope_index(ids, None, rope_config, image_grid_thw=torch.tensor([[1, 4, 4]]))
    ids = one_row(TEXT, seg[:2], seg[1:])  # one extra, at the end of the row
    with pytest.raises(OmniRopeError, match="found 5 placeholder"):
        get_rope_index(ids, None, rope_config, image_grid_thw=torch.tensor([[1, 4, 4]]))


def test_missing_vision_start(rope_config):
    seg = image_segment_ids(rope_config, [1, 4, 4])
    ids = one_row(TEXT, seg[1:], TEXT)  # no <vision_start>
    with pytest.raises(
        OmniRopeError, match=r"row 0, column 3: media placeholder .*missing <vision_start>"
    ):
        get_rope_index(ids, None, rope_config, image_grid_thw=torch.zeros(0, 3, dtype=torch.long))
    seg2 = image_segment_ids(rope_config, [1, 2, 2])
    ids = one_row(seg2, TEXT, seg[1:])  # second image lacks it: seen as one segment too many tokens
    with pytest.raises(OmniRopeError, match=r"row 0, column 6: .*outside any media segment"):
        get_rope_index(ids, None, rope_config, image_grid_thw=torch.tensor([[1, 2, 2]]))


def test_vision_start_followed_by_text(rope_config):
    ids = one_row(TEXT, [rope_config.vision_start_token_id], TEXT)
    with pytest.raises(
        OmniRopeError, match=r"row 0, column 3: <vision_start> .*followed by token 5"
    ):
        get_rope_index(ids, None, rope_config, image_grid_thw=torch.zeros(0, 3, dtype=torch.long))


def test_audio_lengths_vs_placeholders(rope_config):
    ids = one_row(TEXT, audio_segment_ids(rope_config, 300), TEXT)  # 39 placeholders
    with pytest.raises(OmniRopeError, match="no audio_seqlens"):
        get_rope_index(ids, None, rope_config)
    with pytest.raises(
        OmniRopeError, match=r"one entry per audio \(1: 1 audio, 0 audio-in-video\), got 2"
    ):
        get_rope_index(ids, None, rope_config, audio_seqlens=torch.tensor([300, 300]))
    with pytest.raises(OmniRopeError, match=r"audio #0 \(52 audio placeholders\).*found 39"):
        get_rope_index(ids, None, rope_config, audio_seqlens=torch.tensor([400]))  # 52 tokens
    with pytest.raises(OmniRopeError, match="found 39"):
        get_rope_index(  # the same check in the 3-D branch
            ids,
            None,
            rope_config,
            audio_seqlens=torch.tensor([250]),
            image_grid_thw=torch.zeros(0, 3, dtype=torch.long),
        )


def test_audio_in_video_flag_must_match_layout(rope_config):
    aiv = audio_in_video_segment_ids(rope_config, [2, 4, 4], 1.0, 200)
    kw = dict(
        video_grid_thw=torch.tensor([[2, 4, 4]]),
        second_per_grids=torch.tensor([1.0]),
        audio_seqlens=torch.tensor([200]),
    )
    with pytest.raises(OmniRopeError, match="use_audio_in_video=False"):
        get_rope_index(one_row(TEXT, aiv), None, rope_config, **kw)
    plain = video_segment_ids(rope_config, [2, 4, 4])
    kw.pop("audio_seqlens")
    with pytest.raises(OmniRopeError, match="video without audio but use_audio_in_video=True"):
        get_rope_index(one_row(TEXT, plain), None, rope_config, use_audio_in_video=True, **kw)


def test_audio_in_video_split_mismatch(rope_config):
    aiv = audio_in_video_segment_ids(rope_config, [2, 4, 4], 1.0, 200)
    body = aiv[2:-2].clone()
    v = (body == rope_config.video_token_id).nonzero()[-1]
    body[v] = rope_config.audio_token_id  # one video placeholder turned into audio
    ids = one_row(TEXT, aiv[:2], body, aiv[-2:])
    with pytest.raises(OmniRopeError, match=r"audio-in-video #0 .*wrong video/audio split"):
        get_rope_index(
            ids,
            None,
            rope_config,
            video_grid_thw=torch.tensor([[2, 4, 4]]),
            second_per_grids=torch.tensor([1.0]),
            audio_seqlens=torch.tensor([200]),
            use_audio_in_video=True,
        )


def test_bad_grids_and_masks(rope_config):
    ids = one_row(TEXT, image_segment_ids(rope_config, [1, 4, 4]))
    with pytest.raises(OmniRopeError, match="divisible by spatial_merge_size 2"):
        get_rope_index(ids, None, rope_config, image_grid_thw=torch.tensor([[1, 4, 3]]))
    with pytest.raises(OmniRopeError, match="only 0/1"):
        get_rope_index(ids, torch.full_like(ids, 2), rope_config)
    with pytest.raises(OmniRopeError, match="attention_mask: expected shape"):
        get_rope_index(ids, torch.ones(1, 3), rope_config)
    with pytest.raises(OmniRopeError, match="input_ids: expected an integer"):
        get_rope_index(ids.float(), None, rope_config)

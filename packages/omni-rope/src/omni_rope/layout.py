"""Placeholder layouts of Qwen3-Omni prompts: how many tokens each media item takes, in which order.

These are the sequences the Omni processor writes into ``input_ids``; the data code uses them to expand
placeholders by hand (no processor needed) and the tests use them to build inputs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from omni_rope.audio import audio_output_length
from omni_rope.config import OmniRopeConfig
from omni_rope.errors import OmniRopeError


def _grid(grid_thw: Sequence[int] | torch.Tensor, merge: int, what: str) -> tuple[int, int, int]:
    t, h, w = (
        int(x) for x in (grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else grid_thw)
    )
    if t < 1 or h < 1 or w < 1 or h % merge or w % merge:
        raise OmniRopeError(
            f"{what} grid (t,h,w)=({t},{h},{w}): expected positive sizes with h and w divisible by "
            f"spatial_merge_size {merge}"
        )
    return t, h // merge, w // merge


def _vision_segment_ids(
    config: OmniRopeConfig, grid_thw: Sequence[int] | torch.Tensor, pad_id: int, what: str
) -> torch.Tensor:
    """``<vision_start> <pad> x t*h*w/m^2 <vision_end>``: images and videos differ only in pad."""
    t, hp, wp = _grid(grid_thw, config.spatial_merge_size, what)
    body = torch.full((t * hp * wp,), pad_id, dtype=torch.long)
    return _wrap(body, [config.vision_start_token_id], [config.vision_end_token_id])


def image_segment_ids(
    config: OmniRopeConfig, grid_thw: Sequence[int] | torch.Tensor
) -> torch.Tensor:
    """``<vision_start> <image_pad> x t*h*w/m^2 <vision_end>`` for one image grid."""
    return _vision_segment_ids(config, grid_thw, config.image_token_id, "image")


def video_segment_ids(
    config: OmniRopeConfig, grid_thw: Sequence[int] | torch.Tensor
) -> torch.Tensor:
    """``<vision_start> <video_pad> x t*h*w/m^2 <vision_end>`` for one video grid (no audio)."""
    return _vision_segment_ids(config, grid_thw, config.video_token_id, "video")


def audio_segment_ids(config: OmniRopeConfig, n_mel_frames: int) -> torch.Tensor:
    """``<audio_start> <audio_pad> x audio_output_length(n) <audio_end>`` for one audio."""
    n = _audio_tokens(config, n_mel_frames)
    body = torch.full((n,), config.audio_token_id, dtype=torch.long)
    return _wrap(body, [config.audio_start_token_id], [config.audio_end_token_id])


def audio_in_video_body_kinds(
    config: OmniRopeConfig,
    grid_thw: Sequence[int] | torch.Tensor,
    second_per_grid: float,
    n_audio_tokens: int,
) -> torch.Tensor:
    """Bool mask over the interleaved body, ``True`` where a video token goes, in the processor's order.

    The processor places each temporal grid k at time ``k * second_per_grid * position_id_per_seconds``
    and each audio token j at time j, merging the two in time order with video first on ties (float64
    arithmetic, as numpy does in ``replace_video_with_audio_token``).
    """
    t, hp, wp = _grid(grid_thw, config.spatial_merge_size, "video")
    spg = float(second_per_grid)
    if not spg >= 0:
        raise OmniRopeError(
            f"second_per_grid must be a non-negative number, got {second_per_grid!r}"
        )
    if n_audio_tokens < 1:
        raise OmniRopeError(f"audio-in-video needs at least one audio token, got {n_audio_tokens}")
    frame = torch.arange(t, dtype=torch.float64).repeat_interleave(hp * wp)
    video_time = frame * spg * float(config.position_id_per_seconds)
    audio_time = torch.arange(n_audio_tokens, dtype=torch.float64)
    times = torch.cat([video_time, audio_time])
    # A stable sort of [video..., audio...] by time is exactly the processor's two-pointer merge.
    order = torch.sort(times, stable=True).indices
    return order < video_time.numel()


def audio_in_video_segment_ids(
    config: OmniRopeConfig,
    grid_thw: Sequence[int] | torch.Tensor,
    second_per_grid: float,
    n_mel_frames: int,
) -> torch.Tensor:
    """The whole audio-in-video segment as the processor writes it into ``input_ids``.

    ``<vision_start> <audio_start> [video_pad / audio_pad interleaved in time] <audio_end> <vision_end>``.
    """
    n_audio = _audio_tokens(config, n_mel_frames)
    is_video = audio_in_video_body_kinds(config, grid_thw, second_per_grid, n_audio)
    body = torch.where(
        is_video,
        torch.tensor(config.video_token_id, dtype=torch.long),
        torch.tensor(config.audio_token_id, dtype=torch.long),
    )
    return _wrap(
        body,
        [config.vision_start_token_id, config.audio_start_token_id],
        [config.audio_end_token_id, config.vision_end_token_id],
    )


def _audio_tokens(config: OmniRopeConfig, n_mel_frames: int) -> int:
    if int(n_mel_frames) < 1:
        raise OmniRopeError(f"audio needs at least one mel frame, got {n_mel_frames}")
    return int(audio_output_length(int(n_mel_frames), n_window=config.audio_n_window))


def _wrap(body: torch.Tensor, head: list[int], tail: list[int]) -> torch.Tensor:
    return torch.cat(
        [torch.tensor(head, dtype=torch.long), body, torch.tensor(tail, dtype=torch.long)]
    )

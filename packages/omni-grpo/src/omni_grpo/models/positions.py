"""Omni TM-RoPE position ids for the thinker, and their continuation during KV-cached decoding.

Prefill: 3-D positions from omni-rope (text, image, video, audio, audio-in-video) plus the per-row
``delta`` (``max position + 1 - valid tokens``). Decode: every new token is text, so its position is
its index among the row's valid tokens plus that delta on all three rows, exactly what transformers'
Omni thinker does with its cached ``rope_deltas``.
"""

from __future__ import annotations

from typing import Any

import torch


class RopeIndex:
    """Callable ``(input_ids, attention_mask, grids, ...) -> (positions [3,B,L], deltas [B,1])``."""

    def __init__(self, sideband: dict[str, Any], spatial_merge_size: int) -> None:
        self.sideband = sideband
        self.spatial_merge_size = spatial_merge_size

    def __call__(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        image_grid_thw: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        video_second_per_grid: torch.Tensor | None = None,
        audio_seqlens: torch.Tensor | None = None,
        use_audio_in_video: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


def decode_positions(
    deltas: torch.Tensor,
    past_length: int,
    new_length: int,
    attention_mask: torch.Tensor | None,
    device: torch.device,
) -> torch.Tensor:
    """``[3, B, new_length]`` positions of tokens appended after ``past_length`` cached ones.

    With an ``attention_mask`` covering cache + new tokens (left padding), a token's text position is
    its count among valid tokens; without one, every row is assumed unpadded.
    """
    batch = deltas.shape[0]
    if attention_mask is not None:
        if attention_mask.shape[-1] != past_length + new_length:
            raise ValueError(
                f"attention_mask covers {attention_mask.shape[-1]} tokens, expected cache "
                f"{past_length} + new {new_length} during decoding"
            )
        text = (attention_mask.long().cumsum(-1) - 1)[:, -new_length:].clamp(min=0)
    else:
        text = torch.arange(past_length, past_length + new_length, device=device).expand(batch, -1)
    pos = text.to(device) + deltas.to(device)
    return pos.unsqueeze(0).expand(3, -1, -1)


def _hf_standin(sideband: dict[str, Any], vl_config: Any) -> Any:
    """TEMPORARY: transformers' Omni rope index, until omni-rope lands."""
    from types import SimpleNamespace

    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        Qwen3OmniMoePreTrainedModelForConditionalGeneration as Ref,
    )

    fake = object.__new__(Ref)
    object.__setattr__(fake, "spatial_merge_size", vl_config.vision_config.spatial_merge_size)
    object.__setattr__(
        fake,
        "config",
        SimpleNamespace(
            **{**sideband, "audio_config": SimpleNamespace(**sideband["audio_config"])}
        ),
    )

    def rope_index(
        input_ids,
        attention_mask,
        image_grid_thw=None,
        video_grid_thw=None,
        video_second_per_grid=None,
        audio_seqlens=None,
        use_audio_in_video=False,
    ):
        return fake.get_rope_index(
            input_ids,
            image_grid_thw,
            video_grid_thw,
            attention_mask,
            use_audio_in_video,
            audio_seqlens,
            video_second_per_grid,
        )

    return rope_index


def make_rope_index(sideband: dict[str, Any], vl_config: Any) -> Any:
    return _hf_standin(sideband, vl_config)

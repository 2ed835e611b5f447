"""Omni TM-RoPE position ids for the thinker, and their continuation during KV-cached decoding.

Prefill: 3-D positions from omni-rope (text, image, video, audio, audio-in-video) plus the per-row
``delta`` (``max position + 1 - valid tokens``). Decode: every new token is text, so its position is
its index among the row's valid tokens plus that delta on all three rows, exactly what transformers'
Omni thinker does with its cached ``rope_deltas``.
"""

from __future__ import annotations

import torch
from omni_rope import OmniRopeConfig, get_rope_index


class RopeIndex:
    """omni-rope's ``get_rope_index`` bound to one checkpoint's :class:`OmniRopeConfig`.

    ``use_audio_in_video`` is passed through: ``True``/``False`` for the whole batch (as
    transformers' thinker takes it) or ``None`` to read it per video from the tokens.
    """

    def __init__(self, config: OmniRopeConfig) -> None:
        self.config = config

    def __call__(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        image_grid_thw: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        video_second_per_grid: torch.Tensor | None = None,
        audio_seqlens: torch.Tensor | None = None,
        use_audio_in_video: bool | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return get_rope_index(
            input_ids,
            attention_mask,
            self.config,
            image_grid_thw=image_grid_thw,
            video_grid_thw=video_grid_thw,
            second_per_grids=video_second_per_grid,
            audio_seqlens=audio_seqlens,
            use_audio_in_video=use_audio_in_video,
        )


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

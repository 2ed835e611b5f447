"""The continuation of Omni TM-RoPE position ids during KV-cached decoding.

Prefill: 3-D positions from ``omni_rope.positions_from_mm`` (text, image, video, audio,
audio-in-video) plus the per-row ``delta`` (``max position + 1 - valid tokens``). Decode: every new token is text, so its position is
its index among the row's valid tokens plus that delta on all three rows, exactly what transformers'
Omni thinker does with its cached ``rope_deltas``.
"""

from __future__ import annotations

import torch


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

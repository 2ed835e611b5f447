"""omni-rope: Qwen3-Omni TM-RoPE position ids (text, image, video, audio, audio-in-video).

``get_rope_index`` is the pure core, identical to transformers' Omni reference and vectorised;
``positions_from_mm`` calls it with the Omni processor's media tensors as they are;
``install_omni_rope`` makes a bare HF Qwen3-VL-MoE model use it (for HF ``generate`` users).
"""

from omni_rope.audio import audio_output_length
from omni_rope.config import OmniRopeConfig
from omni_rope.errors import OmniRopeError
from omni_rope.hf_vl import OmniRopeHandle, install_omni_rope, next_position_ids
from omni_rope.layout import (
    audio_in_video_body_kinds,
    audio_in_video_segment_ids,
    audio_segment_ids,
    image_segment_ids,
    video_segment_ids,
)
from omni_rope.positions import get_rope_index
from omni_rope.processed import positions_from_mm

__all__ = [
    "OmniRopeConfig",
    "OmniRopeError",
    "OmniRopeHandle",
    "audio_in_video_body_kinds",
    "audio_in_video_segment_ids",
    "audio_output_length",
    "audio_segment_ids",
    "get_rope_index",
    "image_segment_ids",
    "install_omni_rope",
    "next_position_ids",
    "positions_from_mm",
    "video_segment_ids",
]

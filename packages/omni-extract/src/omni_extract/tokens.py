"""The Omni special tokens as data.

Every id the rest of the project uses is read from a config (``thinker_config`` or the pseudo-VL
``omni_sideband``), never hard-coded; this table only says *which* token strings exist, in the
order the released tokenizer assigns them, and which config field carries each id.
"""

from __future__ import annotations

# (token string, thinker/top-level config field that carries its id). Order matters: it is the order
# in which the released Qwen3-Omni tokenizer appends the tokens that plain Qwen3 lacks.
QWEN3_BASE_SPECIALS: tuple[tuple[str, str | None], ...] = (
    ("<|endoftext|>", "pad_token_id"),
    ("<|im_start|>", "im_start_token_id"),
    ("<|im_end|>", "im_end_token_id"),
    ("<|object_ref_start|>", None),
    ("<|object_ref_end|>", None),
    ("<|box_start|>", None),
    ("<|box_end|>", None),
    ("<|quad_start|>", None),
    ("<|quad_end|>", None),
    ("<|vision_start|>", "vision_start_token_id"),
    ("<|vision_end|>", "vision_end_token_id"),
    ("<|vision_pad|>", None),
    ("<|image_pad|>", "image_token_id"),
    ("<|video_pad|>", "video_token_id"),
)

# Appended after the Qwen3 vocabulary (ids 151669..151675 on the real tokenizer).
OMNI_EXTRA_SPECIALS: tuple[tuple[str, str | None], ...] = (
    ("<|audio_start|>", "audio_start_token_id"),
    ("<|audio_end|>", "audio_end_token_id"),
    ("<tts_pad>", "tts_pad_token_id"),
    ("<tts_text_bos>", "tts_bos_token_id"),
    ("<tts_text_eod>", "tts_eos_token_id"),
    ("<tts_text_bos_single>", None),
    ("<|audio_pad|>", "audio_token_id"),
)

# Thinker-config fields carrying a media token's id (placeholders and segment markers): every Omni
# checkpoint's ``thinker_config`` has them, and omni-extract copies them into the VL sideband.
MEDIA_TOKEN_ID_FIELDS: tuple[str, ...] = (
    "audio_token_id",
    "audio_start_token_id",
    "audio_end_token_id",
    "image_token_id",
    "video_token_id",
    "vision_start_token_id",
    "vision_end_token_id",
)

# Attribute names the Omni processor reads from the tokenizer (`tokenizer.image_token` etc.).
PROCESSOR_TOKEN_ATTRS: dict[str, str] = {
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
    "audio_token": "<|audio_pad|>",
    "vision_bos_token": "<|vision_start|>",
    "vision_eos_token": "<|vision_end|>",
    "audio_bos_token": "<|audio_start|>",
    "audio_eos_token": "<|audio_end|>",
}

# The released checkpoint's ids, used only by the factory's real-vocabulary preset and by tests
# that check the factory reproduced them.
REAL_IDS: dict[str, int] = {
    "pad_token_id": 151643,
    "im_start_token_id": 151644,
    "im_end_token_id": 151645,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "image_token_id": 151655,
    "video_token_id": 151656,
    "audio_start_token_id": 151669,
    "audio_end_token_id": 151670,
    "tts_pad_token_id": 151671,
    "tts_bos_token_id": 151672,
    "tts_eos_token_id": 151673,
    "audio_token_id": 151675,
    "system_token_id": 8948,
    "user_token_id": 872,
    "assistant_token_id": 77091,
}
REAL_VOCAB_SIZE = 152064

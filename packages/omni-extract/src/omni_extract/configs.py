"""Synthesising the ``config.json`` of each output variant from the Omni ``thinker_config``.

The key lists are data: which Omni text/vision fields carry over verbatim. What Qwen3-VL has no
field for (time scaling of positions, audio ids, the whole audio tower) travels in the
``omni_sideband`` block so the trainer can restore Omni behaviour from the VL checkpoint alone.
"""

from __future__ import annotations

import copy
from typing import Any

from omni_extract.errors import NotQwen3OmniError

# Qwen3-VL-MoE text fields copied verbatim from the Omni text config (rope handled separately).
VL_TEXT_KEYS: tuple[str, ...] = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "max_position_embeddings",
    "initializer_range",
    "rms_norm_eps",
    "use_cache",
    "attention_bias",
    "attention_dropout",
    "decoder_sparse_step",
    "moe_intermediate_size",
    "num_experts_per_tok",
    "num_experts",
    "output_router_logits",
    "router_aux_loss_coef",
    "mlp_only_layers",
)
# Qwen3-MoE (text variant) additionally knows these.
TEXT_EXTRA_KEYS: tuple[str, ...] = ("norm_topk_prob", "sliding_window")

VL_VISION_KEYS: tuple[str, ...] = (
    "depth",
    "hidden_size",
    "hidden_act",
    "intermediate_size",
    "num_heads",
    "in_channels",
    "patch_size",
    "spatial_merge_size",
    "temporal_patch_size",
    "out_hidden_size",
    "num_position_embeddings",
    "deepstack_visual_indexes",
    "initializer_range",
)
# Thinker-level ids Qwen3-VL has fields for.
VL_ID_KEYS: tuple[str, ...] = (
    "image_token_id",
    "video_token_id",
    "vision_start_token_id",
    "vision_end_token_id",
)
# Everything the sideband carries from the thinker config (the audio config is added whole).
SIDEBAND_THINKER_KEYS: tuple[str, ...] = (
    "position_id_per_seconds",
    "seconds_per_chunk",
    "audio_token_id",
    "audio_start_token_id",
    "audio_end_token_id",
    *VL_ID_KEYS,
    "user_token_id",
)
SIDEBAND_TOP_KEYS: tuple[str, ...] = (
    "im_start_token_id",
    "im_end_token_id",
    "system_token_id",
    "user_token_id",
    "assistant_token_id",
)
# The only rope keys Qwen3-VL's config accepts without complaint.
VL_ROPE_KEYS: tuple[str, ...] = ("rope_type", "mrope_section", "mrope_interleaved")
SIDEBAND_VERSION = 1


def _require(d: dict[str, Any], key: str, where: str) -> Any:
    if key not in d or d[key] is None:
        raise NotQwen3OmniError(f"config.json: field '{where}.{key}' is missing")
    return d[key]


def _rope(text: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """Omni rope settings (5.x ``rope_parameters`` or legacy ``rope_scaling``) -> VL whitelist + theta."""
    params = text.get("rope_parameters") or text.get("rope_scaling") or {}
    theta = params.get("rope_theta", text.get("rope_theta"))
    if theta is None:
        raise NotQwen3OmniError("config.json: thinker_config.text_config has no rope_theta")
    section = params.get("mrope_section")
    if section is None:
        raise NotQwen3OmniError(
            "config.json: thinker_config.text_config rope settings lack 'mrope_section'"
        )
    scaling = {
        "rope_type": params.get("rope_type", params.get("type", "default")),
        "mrope_section": list(section),
        "mrope_interleaved": bool(params.get("mrope_interleaved", params.get("interleaved", True))),
    }
    return scaling, float(theta)


def _dtype_name(config: dict[str, Any], out_dtype: str | None) -> str | None:
    return out_dtype or config.get("dtype") or config.get("torch_dtype")


def omni_sideband(config: dict[str, Any]) -> dict[str, Any]:
    """What Qwen3-VL's config cannot hold, for restoring Omni positions and audio later."""
    thinker = config["thinker_config"]
    side: dict[str, Any] = {"version": SIDEBAND_VERSION, "source_model_type": config["model_type"]}
    for key in SIDEBAND_THINKER_KEYS:
        side[key] = _require(thinker, key, "thinker_config")
    for key in SIDEBAND_TOP_KEYS:
        if key in config:
            side.setdefault(key, config[key])
    side["audio_config"] = copy.deepcopy(thinker["audio_config"])
    return side


def vl_config(config: dict[str, Any], out_dtype: str | None) -> dict[str, Any]:
    """``config.json`` of the pseudo-Qwen3-VL-MoE checkpoint."""
    thinker = config["thinker_config"]
    text_in, vision_in = thinker["text_config"], thinker["vision_config"]
    if text_in.get("norm_topk_prob", True) is not True:
        raise NotQwen3OmniError(
            "config.json: thinker_config.text_config.norm_topk_prob is false, but Qwen3-VL-MoE always "
            "renormalises the top-k router weights; the VL variant would change the model"
        )
    scaling, theta = _rope(text_in)
    text = {k: copy.deepcopy(text_in[k]) for k in VL_TEXT_KEYS if k in text_in}
    for key in (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_experts",
        "moe_intermediate_size",
    ):
        _require(text_in, key, "thinker_config.text_config")
    text.update(
        model_type="qwen3_vl_moe_text",
        rope_scaling=scaling,
        rope_theta=theta,
        tie_word_embeddings=bool(thinker.get("tie_word_embeddings", False)),
    )
    vision = {k: copy.deepcopy(vision_in[k]) for k in VL_VISION_KEYS if k in vision_in}
    _require(vision_in, "num_position_embeddings", "thinker_config.vision_config")
    vision["model_type"] = "qwen3_vl_moe"  # as on the Qwen3-VL hub; renamed on load
    out: dict[str, Any] = {
        "architectures": ["Qwen3VLMoeForConditionalGeneration"],
        "model_type": "qwen3_vl_moe",
        "text_config": text,
        "vision_config": vision,
        "tie_word_embeddings": bool(thinker.get("tie_word_embeddings", False)),
    }
    for key in VL_ID_KEYS:
        out[key] = _require(thinker, key, "thinker_config")
    dtype = _dtype_name(config, out_dtype)
    if dtype:
        out["dtype"] = dtype
        text["dtype"] = dtype
    out["omni_sideband"] = omni_sideband(config)
    return out


def text_config(
    config: dict[str, Any], out_dtype: str | None, generation: dict[str, Any] | None
) -> dict[str, Any]:
    """``config.json`` of the plain ``qwen3_moe`` checkpoint (``Qwen3MoeForCausalLM``)."""
    thinker = config["thinker_config"]
    text_in = thinker["text_config"]
    _, theta = _rope(text_in)
    out = {k: copy.deepcopy(text_in[k]) for k in (*VL_TEXT_KEYS, *TEXT_EXTRA_KEYS) if k in text_in}
    out.update(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        rope_theta=theta,
        rope_scaling=None,  # text-only positions are 1-D: M-RoPE reduces to plain RoPE
        tie_word_embeddings=bool(thinker.get("tie_word_embeddings", False)),
    )
    gen = generation or {}
    out["bos_token_id"] = gen.get("bos_token_id", config.get("im_start_token_id"))
    out["eos_token_id"] = gen.get("eos_token_id", config.get("im_end_token_id"))
    if gen.get("pad_token_id") is not None:
        out["pad_token_id"] = gen["pad_token_id"]
    dtype = _dtype_name(config, out_dtype)
    if dtype:
        out["dtype"] = dtype
    out["omni_sideband"] = omni_sideband(config)
    return out


def audio_config(config: dict[str, Any], out_dtype: str | None) -> dict[str, Any]:
    """``config.json`` of the audio-tower checkpoint.

    The top level IS a ``Qwen3OmniMoeAudioEncoderConfig`` dict (so
    ``Qwen3OmniMoeAudioEncoderConfig.from_pretrained(dir)`` works); ``omni_audio`` adds the ids and
    time scaling the injector needs, and the tensor-name prefix of the weights.
    """
    thinker = config["thinker_config"]
    out = copy.deepcopy(thinker["audio_config"])
    out["model_type"] = "qwen3_omni_moe_audio_encoder"
    out["architectures"] = ["Qwen3OmniMoeAudioEncoder"]
    dtype = _dtype_name(config, out_dtype)
    if dtype:
        out["dtype"] = dtype
    side = omni_sideband(config)
    side.pop("audio_config")
    side["tensor_prefix"] = "audio_tower."
    side["text_hidden_size"] = thinker["text_config"].get("hidden_size")
    out["omni_audio"] = side
    return out

"""Config translation: extracted pseudo-VL config.json + MegatronConfig -> megatron-core args (no megatron needed)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from omni_grpo.backends.megatron import MegatronConfigError, megatron_model_args
from omni_grpo.config import MegatronConfig

# Qwen3-Omni-30B-A3B thinker text config (reference: qwen3_omni_layout.md §3.1), VL-extracted form.
REAL_VL = {
    "text_config": {
        "hidden_size": 2048,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "moe_intermediate_size": 768,
        "intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "vocab_size": 152064,
        "max_position_embeddings": 65536,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "rope_scaling": {
            "rope_type": "default",
            "mrope_section": [24, 20, 20],
            "mrope_interleaved": True,
        },
        "rope_theta": 1e6,
        "tie_word_embeddings": False,
    },
    "vision_config": {"deepstack_visual_indexes": [8, 16, 24]},
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "omni_sideband": {  # the released thinker's sideband, as omni-extract writes it
        "audio_token_id": 151675,
        "audio_start_token_id": 151669,
        "audio_end_token_id": 151670,
        "image_token_id": 151655,
        "video_token_id": 151656,
        "vision_start_token_id": 151652,
        "vision_end_token_id": 151653,
        "position_id_per_seconds": 13,
        "audio_config": {"n_window": 50},
    },
    "tie_word_embeddings": False,
}


@pytest.fixture(scope="module")
def tiny_vl_config(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from omni_extract import extract
    from omni_extract.tiny import TinyOmniSpec, make_tiny_omni

    root = tmp_path_factory.mktemp("mega")
    make_tiny_omni(root / "omni", TinyOmniSpec())
    extract(root / "omni", root / "vl", variant="vl")
    return json.loads((root / "vl" / "config.json").read_text())


def test_real_thinker_widths() -> None:
    a = megatron_model_args(REAL_VL, MegatronConfig(tp=2, ep=2, sp=True, recompute="full"))
    t = a.transformer
    assert (
        t["num_layers"],
        t["hidden_size"],
        t["num_attention_heads"],
        t["num_query_groups"],
        t["kv_channels"],
    ) == (48, 2048, 32, 4, 128)
    assert (t["num_moe_experts"], t["moe_router_topk"], t["moe_ffn_hidden_size"]) == (128, 8, 768)
    assert t["moe_router_pre_softmax"] is False  # norm_topk_prob: top-k of logits, softmax over k
    assert t["normalization"] == "RMSNorm" and t["qk_layernorm"] and t["gated_linear_unit"]
    assert t["activation_func"] == "silu" and t["add_bias_linear"] is False
    assert t["sequence_parallel"] is True and t["expert_tensor_parallel_size"] == 1
    assert (t["tensor_model_parallel_size"], t["expert_model_parallel_size"]) == (2, 2)
    assert t["recompute_granularity"] == "full" and t["recompute_method"] == "uniform"
    assert t["bf16"] and t["params_dtype"] == "bfloat16"
    assert t["mrope_section"] == [24, 20, 20] and a.mrope_interleaved
    assert a.rotary_base == 1e6 and a.vocab_size == 152064
    assert a.share_embeddings_and_output_weights is False
    assert a.token_ids["audio_token_id"] == 151675 and a.token_ids["image_token_id"] == 151655
    assert a.deepstack_layers == 3


def test_tiny_extracted_config_is_read(tiny_vl_config: dict) -> None:
    text = tiny_vl_config["text_config"]
    a = megatron_model_args(tiny_vl_config, MegatronConfig(precision="fp32"))
    assert a.transformer["hidden_size"] == text["hidden_size"]
    assert a.transformer["moe_ffn_hidden_size"] == text["moe_intermediate_size"]
    assert a.transformer["params_dtype"] == "float32" and not a.transformer["bf16"]
    assert a.transformer["sequence_parallel"] is False
    assert a.token_ids["video_token_id"] == tiny_vl_config["video_token_id"]
    assert a.token_ids["audio_token_id"] == tiny_vl_config["omni_sideband"]["audio_token_id"]
    assert list(a.mrope_section) == text["rope_scaling"]["mrope_section"]


def test_rope_parameters_form_is_accepted() -> None:
    cfg = json.loads(json.dumps(REAL_VL))
    text = cfg["text_config"]
    text["rope_parameters"] = {"rope_theta": 5e6, **text.pop("rope_scaling")}
    text.pop("rope_theta")
    assert megatron_model_args(cfg, MegatronConfig()).rotary_base == 5e6


def test_sp_required_for_moe_with_tp() -> None:
    # MegatronConfig validates this itself; a config built another way is still refused here.
    fake = SimpleNamespace(tp=2, ep=1, pp=1, sp=False, precision="bf16", recompute="none")
    with pytest.raises(MegatronConfigError, match=r"trainer\.megatron\.sp"):
        megatron_model_args(REAL_VL, fake)


@pytest.mark.parametrize(
    ("field", "value", "layout", "match"),
    [
        (
            "num_key_value_heads",
            4,
            {"tp": 8, "sp": True},
            "num_key_value_heads=4 is not divisible by tp=8",
        ),
        ("num_experts", 128, {"ep": 3}, "num_experts=128 is not divisible by ep=3"),
        ("mlp_only_layers", [0], {}, "dense layers"),
        ("hidden_act", "gelu", {}, "hidden_act"),
    ],
)
def test_bad_layouts_name_the_field(field: str, value: object, layout: dict, match: str) -> None:
    cfg = json.loads(json.dumps(REAL_VL))
    cfg["text_config"][field] = value
    with pytest.raises(MegatronConfigError, match=match):
        megatron_model_args(cfg, MegatronConfig(**layout))


def test_mrope_section_must_cover_head_dim() -> None:
    cfg = json.loads(json.dumps(REAL_VL))
    cfg["text_config"]["rope_scaling"]["mrope_section"] = [24, 20, 19]
    with pytest.raises(MegatronConfigError, match="head_dim/2 = 64"):
        megatron_model_args(cfg, MegatronConfig())


def test_world_size_checked() -> None:
    with pytest.raises(MegatronConfigError, match="world size 3"):
        megatron_model_args(REAL_VL, MegatronConfig(tp=2, sp=True), world_size=3)


def test_missing_keys_name_the_file() -> None:
    with pytest.raises(
        MegatronConfigError, match=r"vl/config.json: text_config lacks \['num_experts'\]"
    ):
        bad = {
            "text_config": {k: v for k, v in REAL_VL["text_config"].items() if k != "num_experts"}
        }
        megatron_model_args(bad, MegatronConfig(), source=str(Path("vl/config.json")))

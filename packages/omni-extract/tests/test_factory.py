"""The factory's checkpoint is a faithful miniature of the released Qwen3-Omni hub checkpoint."""

from __future__ import annotations

import json

import pytest
import torch
from omni_extract.tiny import TinyOmniSpec, make_tiny_omni
from omni_extract.tokens import MEDIA_TOKEN_ID_FIELDS, REAL_IDS
from safetensors import safe_open


def _all_keys(ckpt):
    index = ckpt / "model.safetensors.index.json"
    if index.exists():
        return set(json.loads(index.read_text())["weight_map"])
    with safe_open(ckpt / "model.safetensors", "pt") as f:
        return set(f.keys())


def test_hub_layout(tiny_omni_dir):
    keys = _all_keys(tiny_omni_dir)
    assert any(k.startswith("talker.") for k in keys)
    assert any(k.startswith("code2wav.") for k in keys)
    assert "thinker.model.layers.0.mlp.experts.0.gate_proj.weight" in keys
    assert "thinker.visual.merger.ln_q.weight" in keys
    assert "thinker.visual.merger.mlp.0.weight" in keys
    assert "thinker.visual.merger_list.0.mlp.2.weight" in keys
    assert "thinker.audio_tower.conv_out.weight" in keys
    assert not any("gate_up_proj" in k for k in keys if k.startswith("thinker."))
    shards = sorted(p.name for p in tiny_omni_dir.glob("model-*.safetensors"))
    assert len(shards) >= 3


def test_config_values(tiny_omni_dir):
    cfg = json.loads((tiny_omni_dir / "config.json").read_text())
    th = cfg["thinker_config"]
    text, audio, vision = th["text_config"], th["audio_config"], th["vision_config"]
    assert th["position_id_per_seconds"] == 13
    h, i = text["hidden_size"], text["moe_intermediate_size"]
    assert 2 * i != h and i != h
    assert audio["output_dim"] == h and vision["out_hidden_size"] == h
    assert sum(text["rope_parameters"]["mrope_section"]) == text["head_dim"] // 2
    assert vision["deepstack_visual_indexes"]
    for key in ("audio_token_id", "image_token_id", "video_token_id", "vision_start_token_id"):
        assert th[key] < text["vocab_size"]


def test_tokenizer_ids_match_config(tiny_omni_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_omni_dir)
    th = json.loads((tiny_omni_dir / "config.json").read_text())["thinker_config"]
    assert tok.convert_tokens_to_ids("<|audio_pad|>") == th["audio_token_id"]
    assert tok.convert_tokens_to_ids("<|image_pad|>") == th["image_token_id"]
    assert tok.convert_tokens_to_ids("<|video_pad|>") == th["video_token_id"]
    assert tok.convert_tokens_to_ids("<|vision_start|>") == th["vision_start_token_id"]
    assert tok.convert_tokens_to_ids("<|audio_start|>") == th["audio_start_token_id"]
    pre = json.loads((tiny_omni_dir / "preprocessor_config.json").read_text())
    assert pre["feature_size"] == 128 and pre["patch_size"] == 16
    assert pre["merge_size"] == 2 and pre["temporal_patch_size"] == 2
    assert "chat_template" in json.loads((tiny_omni_dir / "chat_template.json").read_text())
    assert (tiny_omni_dir / "generation_config.json").exists()


def test_real_vocab_reproduces_released_ids(tiny_omni_real_vocab_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_omni_real_vocab_dir)
    cfg = json.loads((tiny_omni_real_vocab_dir / "config.json").read_text())
    th = cfg["thinker_config"]
    assert th["text_config"]["vocab_size"] == 152064
    for key in MEDIA_TOKEN_ID_FIELDS:
        assert th[key] == REAL_IDS[key], key
    assert [tok.convert_tokens_to_ids(t) for t in ("<|audio_start|>", "<|audio_pad|>")] == [
        151669,
        151675,
    ]


def _mm_inputs(th: dict, batch_text_id: int = 5):
    """text + image + video + audio placeholders in one sample (hand-expanded, as a processor would)."""
    ids = [batch_text_id, batch_text_id + 1]
    ids += [th["vision_start_token_id"]] + [th["image_token_id"]] * 4 + [th["vision_end_token_id"]]
    ids += [th["vision_start_token_id"]] + [th["video_token_id"]] * 8 + [th["vision_end_token_id"]]
    ids += [th["audio_start_token_id"]] + [th["audio_token_id"]] * 39 + [th["audio_end_token_id"]]
    ids += [batch_text_id + 2]
    gen = torch.Generator().manual_seed(0)
    return {
        "input_ids": torch.tensor([ids]),
        "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
        "pixel_values": torch.randn(16, 1536, generator=gen),
        "image_grid_thw": torch.tensor([[1, 4, 4]]),
        "pixel_values_videos": torch.randn(32, 1536, generator=gen),
        "video_grid_thw": torch.tensor([[2, 4, 4]]),
        "video_second_per_grid": torch.tensor([1.0]),
        "input_features": torch.randn(1, 128, 300, generator=gen),
        "feature_attention_mask": torch.ones(1, 300, dtype=torch.long),
    }


@pytest.mark.parametrize("fixture", ["tiny_omni_dir", "tiny_omni_real_vocab_dir"])
def test_thinker_loads_without_missing_keys_and_runs_all_modalities(fixture, request):
    from transformers import Qwen3OmniMoeThinkerForConditionalGeneration

    ckpt = request.getfixturevalue(fixture)
    model, info = Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(
        ckpt, output_loading_info=True
    )
    assert info["missing_keys"] == [] or not info["missing_keys"]
    assert not info["unexpected_keys"]
    th = json.loads((ckpt / "config.json").read_text())["thinker_config"]
    with torch.no_grad():
        out = model(**_mm_inputs(th))
    assert out.logits.shape[-1] == th["text_config"]["vocab_size"]
    assert torch.isfinite(out.logits).all()


def test_options_seed_dtype_shards(tmp_path):
    a = make_tiny_omni(
        tmp_path / "a", TinyOmniSpec(seed=3, dtype="bfloat16", num_shards=2, with_talker=False)
    )
    b = make_tiny_omni(
        tmp_path / "b", TinyOmniSpec(seed=3, dtype="bfloat16", num_shards=2, with_talker=False)
    )
    assert len(list(a.glob("model-*.safetensors"))) >= 2
    with safe_open(a / next(iter(sorted(p.name for p in a.glob("model-*")))), "pt") as f:
        name = next(iter(f.keys()))
        ta = f.get_tensor(name)
    with safe_open(b / next(iter(sorted(p.name for p in b.glob("model-*")))), "pt") as f:
        tb = f.get_tensor(name)
    assert ta.dtype == torch.bfloat16 and torch.equal(ta, tb)
    assert not any(k.startswith("talker.") for k in _all_keys(a))


def test_refuses_non_empty_destination(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "f").write_text("keep me")
    with pytest.raises(FileExistsError):
        make_tiny_omni(tmp_path / "x")
    assert (tmp_path / "x" / "f").read_text() == "keep me"


def test_old_testing_module_is_a_deprecated_alias_of_tiny() -> None:
    import importlib
    import sys

    import omni_extract.tiny as tiny

    sys.modules.pop("omni_extract.testing", None)
    with pytest.deprecated_call(match="omni_extract.tiny"):
        old = importlib.import_module("omni_extract.testing")
    assert old.make_tiny_omni is tiny.make_tiny_omni
    assert old.TinyOmniSpec is tiny.TinyOmniSpec


def test_same_seed_same_bytes_and_every_tensor_finite(tmp_path):
    """Every tensor is seeded: transformers leaves the talker's fused experts as torch.empty, which
    the factory must initialise (they used to hold whatever the allocator had, NaN included)."""
    from safetensors.torch import load_file

    dirs = [make_tiny_omni(tmp_path / n, TinyOmniSpec(seed=5)) for n in ("a", "b")]
    files = sorted(p.name for p in dirs[0].glob("*.safetensors"))
    for name in files:
        ta, tb = load_file(dirs[0] / name), load_file(dirs[1] / name)
        for key, t in ta.items():
            assert torch.isfinite(t.float()).all(), key
            assert torch.equal(t, tb[key]), key
    assert any(k.startswith("talker.") and ".experts." in k for k in _all_keys(dirs[0]))

"""Each variant loads in its transformers class and reproduces the Omni thinker (the reference)."""

from __future__ import annotations

import json

import pytest
import torch
from omni_extract import extract
from omni_extract.audio import load_audio_tower
from transformers import (
    AutoTokenizer,
    Qwen3MoeForCausalLM,
    Qwen3OmniMoeThinkerForConditionalGeneration,
    Qwen3VLMoeForConditionalGeneration,
)

CKPTS = ["tiny_omni_dir", "tiny_omni_single_shard_dir"]


@pytest.fixture(scope="module", params=CKPTS)
def ckpt(request):
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def thinker(ckpt):
    return Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(
        ckpt, experts_implementation="eager", dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def th_cfg(ckpt):
    return json.loads((ckpt / "config.json").read_text())["thinker_config"]


def _extract(ckpt, tmp_path_factory, variant, **kw):
    dst = tmp_path_factory.mktemp(variant) / "out"
    result = extract(ckpt, dst, variant=variant, **kw)
    assert result.dst == dst and dst.is_dir()
    assert not [p for p in dst.parent.iterdir() if p.name.startswith(".")]  # no temp dirs left
    return dst


def _text_image_inputs(th_cfg):
    ids = [5, 6, th_cfg["vision_start_token_id"], *[th_cfg["image_token_id"]] * 4]
    ids += [th_cfg["vision_end_token_id"], 7, 8, 9]
    gen = torch.Generator().manual_seed(0)
    ids2 = [7, th_cfg["vision_start_token_id"], *[th_cfg["image_token_id"]] * 4]
    ids2 += [th_cfg["vision_end_token_id"], 9, 10, 11, 12]
    input_ids = torch.tensor([ids, ids2])
    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "pixel_values": torch.randn(32, 1536, generator=gen),
        "image_grid_thw": torch.tensor([[1, 4, 4], [1, 4, 4]]),
    }


def test_vl_loads_and_matches_thinker_logits(ckpt, thinker, th_cfg, tmp_path_factory):
    dst = _extract(ckpt, tmp_path_factory, "vl", shard_size="200KB")
    assert (dst / "model.safetensors.index.json").is_file()
    vl, info = Qwen3VLMoeForConditionalGeneration.from_pretrained(
        dst, output_loading_info=True, experts_implementation="eager", dtype=torch.float32
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    inputs = _text_image_inputs(th_cfg)
    mm_types = (inputs["input_ids"] == th_cfg["image_token_id"]).long()
    with torch.no_grad():
        ref = thinker(**inputs).logits
        got = vl.eval()(**inputs, mm_token_type_ids=mm_types).logits
    assert ref.shape == got.shape
    assert (ref - got).abs().max().item() <= 1e-5


def test_vl_config_carries_sideband(ckpt, th_cfg, tmp_path_factory):
    dst = _extract(ckpt, tmp_path_factory, "vl")
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_vl_moe"
    assert cfg["text_config"]["rope_scaling"].keys() == {
        "rope_type",
        "mrope_section",
        "mrope_interleaved",
    }
    side = cfg["omni_sideband"]
    for key in (
        "position_id_per_seconds",
        "seconds_per_chunk",
        "audio_token_id",
        "audio_start_token_id",
        "audio_end_token_id",
        "vision_start_token_id",
        "vision_end_token_id",
        "image_token_id",
        "video_token_id",
    ):
        assert side[key] == th_cfg[key], key
    assert side["audio_config"] == th_cfg["audio_config"]
    for key in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        assert cfg[key] == th_cfg[key]
    assert (
        cfg["vision_config"]["num_position_embeddings"]
        == th_cfg["vision_config"]["num_position_embeddings"]
    )
    from transformers import AutoConfig

    loaded = AutoConfig.from_pretrained(dst)
    assert loaded.omni_sideband["position_id_per_seconds"] == 13
    assert (
        loaded.text_config.rope_parameters["mrope_section"]
        == th_cfg["text_config"]["rope_parameters"]["mrope_section"]
    )


def test_text_loads_and_matches_thinker_on_text(ckpt, thinker, tmp_path_factory):
    dst = _extract(ckpt, tmp_path_factory, "text")
    model, info = Qwen3MoeForCausalLM.from_pretrained(
        dst, output_loading_info=True, experts_implementation="eager", dtype=torch.float32
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17, 18]])
    with torch.no_grad():
        ref = thinker(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        got = model.eval()(input_ids=ids).logits
    assert (ref - got).abs().max().item() <= 1e-5


def test_audio_reproduces_thinker_audio_features(ckpt, thinker, th_cfg, tmp_path_factory):
    dst = _extract(ckpt, tmp_path_factory, "audio")
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["omni_audio"]["audio_token_id"] == th_cfg["audio_token_id"]
    assert cfg["d_model"] == th_cfg["audio_config"]["d_model"]
    tower = load_audio_tower(dst)
    gen = torch.Generator().manual_seed(1)
    feats = torch.randn(2, 128, 300, generator=gen)
    mask = torch.ones(2, 300, dtype=torch.long)
    mask[1, 180:] = 0
    with torch.no_grad():
        ref = thinker.get_audio_features(feats, feature_attention_mask=mask).last_hidden_state
        flat = feats.permute(0, 2, 1)[mask.bool()].permute(1, 0)
        got = tower(flat, feature_lens=mask.sum(1)).last_hidden_state
    assert ref.shape == got.shape
    assert (ref - got).abs().max().item() <= 1e-6


@pytest.mark.parametrize("variant", ["text", "vl", "audio"])
def test_every_variant_resolves_tokenizer(tiny_omni_dir, tmp_path_factory, variant):
    dst = _extract(tiny_omni_dir, tmp_path_factory, variant)
    tok = AutoTokenizer.from_pretrained(dst)
    ref = AutoTokenizer.from_pretrained(tiny_omni_dir)
    assert tok.encode("the quick brown fox") == ref.encode("the quick brown fox")
    assert (dst / "chat_template.jinja").is_file() and (dst / "preprocessor_config.json").is_file()
    msgs = [{"role": "user", "content": "hi"}]
    assert "<|im_start|>user" in tok.apply_chat_template(msgs, tokenize=False)


def test_release_style_legacy_rope_keys(tiny_omni_dir, tmp_path):
    """The released config.json spells rope as legacy ``rope_scaling`` + ``rope_theta``."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(tiny_omni_dir, src)
    cfg = json.loads((src / "config.json").read_text())
    text = cfg["thinker_config"]["text_config"]
    params = text.pop("rope_parameters")
    text["rope_theta"] = params.pop("rope_theta")
    text["rope_scaling"] = params
    (src / "config.json").write_text(json.dumps(cfg))
    dst = extract(src, tmp_path / "vl", variant="vl").dst
    out = json.loads((dst / "config.json").read_text())["text_config"]
    assert out["rope_scaling"] == {
        "rope_type": params["rope_type"],
        "mrope_section": params["mrope_section"],
        "mrope_interleaved": True,
    }
    assert out["rope_theta"] == text["rope_theta"]
    model, info = Qwen3VLMoeForConditionalGeneration.from_pretrained(dst, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.config.text_config.rope_parameters["rope_theta"] == text["rope_theta"]

"""Layout helpers against transformers' own functions, and strict config reading."""

from __future__ import annotations

import copy
import inspect
import json
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omni_rope import (
    OmniRopeConfig,
    OmniRopeError,
    audio_in_video_segment_ids,
    audio_output_length,
)
from omni_rope.testing import SECONDS_PER_GRID


def test_audio_output_length_matches_transformers():
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        _get_feat_extract_output_lengths,
    )

    frames = torch.arange(1, 6001)
    assert torch.equal(audio_output_length(frames), _get_feat_extract_output_lengths(frames))
    known = {1: 1, 99: 13, 100: 13, 101: 14, 300: 39, 800: 104, 1600: 208, 3000: 390}
    assert {n: audio_output_length(n) for n in known} == known


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    t=st.integers(1, 12),
    h=st.integers(1, 4),
    w=st.integers(1, 4),
    spg=st.sampled_from(SECONDS_PER_GRID),
    frames=st.integers(1, 2000),
)
def test_audio_in_video_order_matches_the_processor(rope_config, t, h, w, spg, frames):
    """Our interleave == Qwen3OmniMoeProcessor.replace_video_with_audio_token (run on a stub self)."""
    import numpy as np
    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import Qwen3OmniMoeProcessor

    helper = getattr(Qwen3OmniMoeProcessor, "replace_video_with_audio_token", None)
    if helper is None:  # older transformers (5.17) inline the interleave in __call__
        pytest.skip("this transformers has no Qwen3OmniMoeProcessor.replace_video_with_audio_token")
    params = list(inspect.signature(helper).parameters)
    if params[:5] != ["self", "video_inputs", "video_idx", "audio_inputs", "audio_idx"]:
        pytest.skip(f"this transformers' interleave helper has another signature: {params}")
    m = rope_config.spatial_merge_size
    grid = [t, h * m, w * m]
    n_audio = audio_output_length(frames)
    stub = SimpleNamespace(
        video_processor=SimpleNamespace(merge_size=m),
        audio_bos_token="S",
        audio_eos_token="E",
        video_token="V",
        audio_token="A",
        position_id_per_seconds=rope_config.position_id_per_seconds,
    )
    text = helper(
        stub,
        {"video_grid_thw": np.array([grid]), "video_second_per_grid": [spg]},
        0,
        {"num_audio_tokens": np.array([n_audio])},
        0,
        position_id_per_seconds=rope_config.position_id_per_seconds,
    )
    table = {
        "S": rope_config.audio_start_token_id,
        "E": rope_config.audio_end_token_id,
        "V": rope_config.video_token_id,
        "A": rope_config.audio_token_id,
    }
    expected = [rope_config.vision_start_token_id, *(table[c] for c in text)]
    expected.append(rope_config.vision_end_token_id)
    assert audio_in_video_segment_ids(rope_config, grid, spg, frames).tolist() == expected


def test_config_sources_agree(omni_config, rope_config):
    full = omni_config.to_dict()
    assert OmniRopeConfig.from_omni_config(full) == rope_config
    assert OmniRopeConfig.from_omni_config(full["thinker_config"]) == rope_config
    assert OmniRopeConfig.from_omni_config(omni_config.thinker_config) == rope_config
    assert rope_config.position_id_per_seconds == 13
    assert rope_config.audio_token_id == full["thinker_config"]["audio_token_id"]


def test_config_never_uses_transformers_defaults(omni_config):
    from transformers import Qwen3OmniMoeThinkerConfig

    with pytest.raises(OmniRopeError, match="vision_start_token_id is missing"):
        OmniRopeConfig.from_omni_config(Qwen3OmniMoeThinkerConfig())
    thinker = copy.deepcopy(omni_config.thinker_config)
    thinker.position_id_per_seconds = 25
    with pytest.raises(OmniRopeError, match="position_id_per_seconds = 25 is transformers'"):
        OmniRopeConfig.from_omni_config(thinker)
    raw = omni_config.to_dict()
    del raw["thinker_config"]["position_id_per_seconds"]
    with pytest.raises(OmniRopeError, match=r"thinker_config.position_id_per_seconds is missing"):
        OmniRopeConfig.from_omni_config(raw)
    raw = omni_config.to_dict()
    del raw["thinker_config"]["audio_config"]["n_window"]
    with pytest.raises(OmniRopeError, match=r"thinker_config.audio_config.n_window is missing"):
        OmniRopeConfig.from_omni_config(raw)


def test_vl_sideband(omni_config, rope_config, tmp_path):
    thinker = omni_config.to_dict()["thinker_config"]
    keys = ["position_id_per_seconds", "seconds_per_chunk", "audio_token_id"]
    keys += ["audio_start_token_id", "audio_end_token_id", "image_token_id", "video_token_id"]
    keys += ["vision_start_token_id", "vision_end_token_id"]
    side = {k: thinker[k] for k in keys} | {"audio_config": thinker["audio_config"]}
    vl = {
        "model_type": "qwen3_vl_moe",
        "vision_config": {"spatial_merge_size": 2},
        "image_token_id": thinker["image_token_id"],
        "omni_sideband": side,
    }
    assert OmniRopeConfig.from_vl_config(vl) == rope_config
    (tmp_path / "config.json").write_text(json.dumps(vl))
    assert OmniRopeConfig.from_pretrained_dir(tmp_path) == rope_config
    with pytest.raises(OmniRopeError, match="no 'omni_sideband'"):
        OmniRopeConfig.from_vl_config({k: v for k, v in vl.items() if k != "omni_sideband"})
    bad = copy.deepcopy(vl)
    del bad["omni_sideband"]["audio_end_token_id"]
    with pytest.raises(OmniRopeError, match="omni_sideband.audio_end_token_id is missing"):
        OmniRopeConfig.from_vl_config(bad)
    bad = copy.deepcopy(vl) | {"image_token_id": 1}
    with pytest.raises(OmniRopeError, match="image_token_id is 1 at the top level"):
        OmniRopeConfig.from_vl_config(bad)
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(OmniRopeError, match="config.json: not valid JSON"):
        OmniRopeConfig.from_pretrained_dir(tmp_path)

"""The fake server checks disk weight updates the way sglang-omni's thinker loader reads them."""

from __future__ import annotations

import httpx
import pytest

torch = pytest.importorskip("torch")  # the package's own venv is torch-free
from omni_rollout_client.testing import FakeOmniServer  # noqa: E402
from omni_rollout_client.testing.loader_names import check_names  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

TEXT = {
    "hidden_size": 8,
    "vocab_size": 32,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 4,
    "num_experts": 2,
    "moe_intermediate_size": 3,
    "num_hidden_layers": 1,
}
CONFIG = {"thinker_config": {"text_config": TEXT}}


def _full() -> dict[str, list[int]]:
    lay = "thinker.model.layers.0."
    return {
        "thinker.model.embed_tokens.weight": [32, 8],
        "thinker.model.norm.weight": [8],
        "thinker.lm_head.weight": [32, 8],
        lay + "input_layernorm.weight": [8],
        lay + "post_attention_layernorm.weight": [8],
        lay + "self_attn.q_proj.weight": [8, 8],
        lay + "self_attn.k_proj.weight": [4, 8],
        lay + "self_attn.v_proj.weight": [4, 8],
        lay + "self_attn.o_proj.weight": [8, 8],
        lay + "self_attn.q_norm.weight": [4],
        lay + "self_attn.k_norm.weight": [4],
        lay + "mlp.gate.weight": [2, 8],
        lay + "mlp.experts.gate_up_proj": [2, 8, 6],
        lay + "mlp.experts.down_proj": [2, 3, 8],
        "thinker.audio_tower.conv_out.weight": [4, 4],
        "talker.model.norm.weight": [4],
    }


def test_a_full_hub_checkpoint_loads_completely():
    report = check_names(_full(), CONFIG)
    assert report.ok and report.missing == []
    assert sorted(report.skipped) == [
        "talker.model.norm.weight",
        "thinker.audio_tower.conv_out.weight",
    ]


def test_dropped_names_transposed_experts_and_gaps_are_reported():
    shapes = _full()
    shapes["body.model.layers.0.mlp.gate.weight"] = [2, 8]  # an early converter's namespace
    shapes["thinker.model.layers.0.mlp.experts.gate_up_proj"] = [2, 6, 8]  # in-memory layout
    del shapes["thinker.model.layers.0.mlp.experts.down_proj"]
    report = check_names(shapes, CONFIG)
    assert report.dropped == ["body.model.layers.0.mlp.gate.weight"]
    assert report.bad_shapes[0].startswith("thinker.model.layers.0.mlp.experts.gate_up_proj")
    assert report.missing == ["0.down", "0.gate_up"]


def test_fake_server_refuses_a_disk_update_with_names_it_would_drop(tmp_path):
    good, bad = tmp_path / "good", tmp_path / "bad"
    for d, extra in ((good, {}), (bad, {"body.lm_head.weight": [32, 8]})):
        d.mkdir()
        shapes = {**_full(), **extra}
        save_file({k: torch.zeros(v) for k, v in shapes.items()}, str(d / "model.safetensors"))
        (d / "config.json").write_text(__import__("json").dumps(CONFIG))
    with FakeOmniServer() as server:
        ok = httpx.post(f"{server.url}/update_weights_from_disk", json={"model_path": str(good)})
        assert ok.status_code == 200 and ok.json()["success"]
        r = httpx.post(f"{server.url}/update_weights_from_disk", json={"model_path": str(bad)})
        assert r.status_code == 400 and "body.lm_head.weight" in r.text

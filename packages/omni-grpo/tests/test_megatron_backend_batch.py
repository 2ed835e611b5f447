"""The megatron backend's conversion of rollout groups into its batch, and its sync tensors (no megatron)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from omni_grpo.backends.megatron.backend import MegatronBackend
from omni_grpo.backends.torch_backend import GRPOBatch
from omni_grpo.config import AlgoConfig, TrainerConfig
from omni_grpo.types import Completion, PromptInputs, Sample


@pytest.fixture(scope="module")
def vl_config(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from omni_extract import extract
    from omni_extract.tiny import TinyOmniSpec, make_tiny_omni

    root = tmp_path_factory.mktemp("backend")
    make_tiny_omni(root / "omni", TinyOmniSpec())
    extract(root / "omni", root / "vl", variant="vl")
    return json.loads((root / "vl" / "config.json").read_text())


def _prompt(cfg: dict) -> PromptInputs:
    vs, ve, img = cfg["vision_start_token_id"], cfg["vision_end_token_id"], cfg["image_token_id"]
    ids = [5, 6, vs, *[img] * 4, ve, 7]
    mm = {"pixel_values": torch.randn(16, 1536), "image_grid_thw": torch.tensor([[1, 4, 4]])}
    return PromptInputs(Sample("u", "p", "A"), ids, mm)


def test_groups_become_positioned_rows(vl_config: dict) -> None:
    from omni_rope import OmniRopeConfig, get_rope_index

    fake_trainer = SimpleNamespace(device=torch.device("cpu"))
    be = MegatronBackend(fake_trainer, vl_config, TrainerConfig(backend="megatron"), AlgoConfig())  # type: ignore[arg-type]
    p = _prompt(vl_config)
    groups = [
        [Completion(p, [11, 12, 13], [-1.0, -2.0, -1.5], "stop"), Completion(p, [], [], "abort")],
        [Completion(p, [14], [-0.5], "length"), Completion(p, [15, 16], [-0.1, -0.2], "stop")],
    ]
    adv = torch.tensor([[1.0, -1.0], [0.5, -0.5]])
    mb = be._batch(GRPOBatch(groups, adv, temperature=0.7))
    assert len(mb.input_ids) == 3  # the empty completion carries no token to train on
    assert mb.advantages.tolist() == [1.0, 0.5, -0.5]
    assert mb.response_start == [len(p.input_ids)] * 3 and mb.temperature == 0.7
    assert [r.numel() for r in mb.rollout_logp] == [3, 1, 2]
    assert torch.cat(mb.rollout_logp).tolist() == pytest.approx(
        [-1.0, -2.0, -1.5, -0.5, -0.1, -0.2]
    )
    full = torch.tensor([p.input_ids + [11, 12, 13]])
    ref, _ = get_rope_index(
        full, None, OmniRopeConfig.from_vl_config(vl_config), image_grid_thw=p.mm["image_grid_thw"]
    )
    assert torch.equal(mb.position_ids[0], ref[:, 0])
    assert mb.position_ids[0].shape == (3, len(p.input_ids) + 3)


def test_sync_tensors_reach_server_names_in_hub_layout(vl_config: dict) -> None:
    from omni_grpo.sync.base import ServerTensors

    gate_up = torch.randn(4, 64, 32)  # hub layout [E, H, 2I] as the Megatron export yields it
    exported = [
        ("model.language_model.layers.0.mlp.experts.gate_up_proj", gate_up),
        ("lm_head.weight", torch.randn(8, 64)),
    ]
    fake_trainer = SimpleNamespace(device=torch.device("cpu"), export=lambda: iter(exported))
    be = MegatronBackend(fake_trainer, vl_config, TrainerConfig(backend="megatron"), AlgoConfig())  # type: ignore[arg-type]
    sd = be.state_dict_for_sync()
    server = dict(ServerTensors(sd, "hf_memory"))  # the trainer pushes with the default layout
    assert torch.equal(server["thinker.model.layers.0.mlp.experts.gate_up_proj"], gate_up)
    assert torch.equal(server["thinker.lm_head.weight"], exported[1][1])

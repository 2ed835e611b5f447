"""The megatron backend's conversion of rollout groups into its batch, and its sync tensors (no megatron)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from omni_grpo.backends.megatron import backend as megatron_backend
from omni_grpo.backends.megatron.backend import MegatronBackend, completion_rows
from omni_grpo.config import AlgoConfig, TrainerConfig
from omni_grpo.types import Completion, GRPOBatch, PromptInputs, Sample
from torch import nn


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
    from omni_grpo.algo.step import local_counts
    from omni_rope import OmniRopeConfig, get_rope_index

    p = _prompt(vl_config)
    groups = [
        [Completion(p, [11, 12, 13], [-1.0, -2.0, -1.5], "stop"), Completion(p, [], [], "abort")],
        [Completion(p, [14], [-0.5], "length"), Completion(p, [15, 16], [-0.1, -0.2], "stop")],
    ]
    adv = torch.tensor([[1.0, -1.0], [0.5, -0.5]])
    batch = GRPOBatch(groups, adv, temperature=0.7)
    rows = completion_rows(batch, OmniRopeConfig.from_vl_config(vl_config))
    assert len(rows) == 3  # the empty completion carries no token to train on ...
    assert local_counts(batch).num_samples == 4  # ... but counts in the normaliser
    assert [r.advantage for r in rows] == [1.0, 0.5, -0.5]
    assert [r.response_start for r in rows] == [len(p.input_ids)] * 3
    assert [r.rollout_logp.numel() for r in rows] == [3, 1, 2]
    assert torch.cat([r.rollout_logp for r in rows]).tolist() == pytest.approx(
        [-1.0, -2.0, -1.5, -0.5, -0.1, -0.2]
    )
    full = torch.tensor([p.input_ids + [11, 12, 13]])
    ref, _ = get_rope_index(
        full, None, OmniRopeConfig.from_vl_config(vl_config), image_grid_thw=p.mm["image_grid_thw"]
    )
    assert torch.equal(rows[0].position_ids, ref[:, 0])
    assert rows[0].position_ids.shape == (3, len(p.input_ids) + 3)


class _FlatThinker(nn.Module):
    """The members ``MegatronBackend.__init__`` reads from a thinker, without megatron-core."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = nn.Linear(2, 2)
        self.lm.config = SimpleNamespace(sequence_parallel=False)  # type: ignore[assignment]
        self.args = SimpleNamespace()

    def trainable_parameters(self):  # type: ignore[no-untyped-def]
        return ((n, p) for n, p in self.lm.named_parameters() if p.requires_grad)


def test_sync_streams_the_export_in_hub_layout(
    vl_config: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    from omni_grpo.sync.base import ServerTensors

    gate_up = torch.randn(4, 64, 32)  # hub layout [E, H, 2I] as the Megatron export yields it
    exported = [
        ("model.language_model.layers.0.mlp.experts.gate_up_proj", gate_up),
        ("lm_head.weight", torch.randn(8, 64)),
    ]
    pulled: list[str] = []

    def export(lm: nn.Module, args: object):  # type: ignore[no-untyped-def]
        for name, t in exported:  # a generator that gathers on demand, as the real export does
            pulled.append(name)
            yield name, t

    monkeypatch.setattr(megatron_backend, "export_hf_weights", export)
    be = MegatronBackend(_FlatThinker(), vl_config, TrainerConfig(backend="megatron"), AlgoConfig())  # type: ignore[arg-type]
    weights, layout = be.weights_for_sync()
    assert layout == "vl_hub" and not isinstance(weights, dict) and pulled == []  # not collected
    server = dict(ServerTensors(weights, layout))  # what push does with (weights, layout)
    assert torch.equal(server["thinker.model.layers.0.mlp.experts.gate_up_proj"], gate_up)
    assert torch.equal(server["thinker.lm_head.weight"], exported[1][1])
    assert be.policy is None and be.is_driver

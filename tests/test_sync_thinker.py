"""Cross-package: the trainer's composed thinker (omni_grpo.models) -> weight sync -> server names.

omni-extract's ``vl`` output is loaded with ``load_thinker`` (pseudo-Qwen3-VL names, fused experts
in transformers' in-memory layout); its ``sync_state_dict()`` is pushed through the disk and the
distributed sync. Unchanged weights must arrive bit-exactly equal to what the hub checkpoint
holds (reference computed from the hub files, not through omni-extract's table); after an
"optimizer step" the new values must arrive, again bit-exactly, and nothing of the towers.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omni_extract import extract
from omni_grpo.config import SglangOmniConfig
from omni_grpo.models import load_thinker
from omni_grpo.sync import make_weight_sync
from omni_grpo.testing.sync import ServerSideReceivers, expected_server_tensors, read_hub_tensors
from omni_rollout_client.testing import FakeOmniServer


@pytest.fixture(scope="module")
def vl_dir(tiny_omni_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sync-thinker")
    extract(tiny_omni_dir, root / "vl", "vl")
    extract(tiny_omni_dir, root / "audio", "audio")
    return root / "vl"


def _bit_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want), (sorted(set(want) - set(got)), sorted(set(got) - set(want)))
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name].view(torch.uint8), tensor.contiguous().view(torch.uint8)), name


def _step(thinker) -> dict[str, torch.Tensor]:
    """Perturb two trainable tensors like an optimizer step; return the server-side expectation
    for them (fused experts transposed from [E,2I,H] to the VL hub [E,H,2I])."""
    params = dict(thinker.named_parameters())
    gate_up = params["model.language_model.layers.1.mlp.experts.gate_up_proj"]
    head = params["lm_head.weight"]
    with torch.no_grad():
        gate_up.add_(torch.randn_like(gate_up) * 1e-2)
        head.mul_(1.5)
    return {
        "thinker.model.layers.1.mlp.experts.gate_up_proj": gate_up.detach()
        .transpose(1, 2)
        .contiguous(),
        "thinker.lm_head.weight": head.detach().clone(),
    }


def test_thinker_disk_sync_round_trip(tmp_path: Path, vl_dir: Path, tiny_omni_dir: Path) -> None:
    thinker = load_thinker(vl_dir, dtype=torch.float32)
    state = thinker.sync_state_dict(trainable_only=False)
    assert any(k.startswith("model.visual.") for k in state)  # towers offered, must be skipped
    expected = expected_server_tensors(tiny_omni_dir)
    with FakeOmniServer() as server:
        sync = make_weight_sync(
            SglangOmniConfig(urls=[server.url], sync_mode="disk"), run_dir=tmp_path
        )
        try:
            report = sync.push(state, "0")
            _bit_exact(read_hub_tensors(tmp_path / "weight_sync" / "0"), expected)
            assert report.skipped_tower_tensors == sum(k.startswith("model.visual.") for k in state)
            expected.update(_step(thinker))
            sync.push(thinker.sync_state_dict(), "1")  # trainable only: visual frozen by default
            _bit_exact(read_hub_tensors(tmp_path / "weight_sync" / "1"), expected)
            assert server.weight_version == "1"
        finally:
            sync.close()


def test_thinker_distributed_sync_round_trip(
    tmp_path: Path, vl_dir: Path, tiny_omni_dir: Path
) -> None:
    thinker = load_thinker(vl_dir, dtype=torch.float32)
    expected = expected_server_tensors(tiny_omni_dir)
    expected.update(_step(thinker))
    with FakeOmniServer(tp_size=2) as server:
        cfg = SglangOmniConfig(urls=[server.url], sync_mode="distributed")
        sync = make_weight_sync(cfg, run_dir=tmp_path, backend="gloo", bucket_bytes=128 << 10)
        with ServerSideReceivers([server], tmp_path / "recv") as rx:
            try:
                report = sync.push(thinker.sync_state_dict(), "step-1")
                group = sync.group.group_name
            finally:
                sync.close()
        assert not rx.errors and report.buckets >= 2
        received = rx.received(group)
        assert sorted(received) == [1, 2]
        for got in received.values():
            _bit_exact(got, expected)
        assert server.weight_version == "step-1"

"""Cross-package: ``omni-grpo train`` with ``rollout.engine: sglang-omni`` against the fake server.

Two GRPO steps on the tiny model: rollouts go over HTTP to the fake sglang-omni server, and after
each step the trainer pushes its weights through the disk sync. Checks that step 2's rollouts
were generated under the version pushed after step 1, that the server ends on the last version,
and that the pushed directory holds exactly the server names of the trained text weights (the
trained ones changed, the shapes/dtypes are those of the hub checkpoint).
"""

from __future__ import annotations

import json

import torch
from omni_grpo.testing.sync import expected_server_tensors, read_hub_tensors


def test_train_two_steps_with_sglang_omni_engine_and_disk_sync(train_against_fake_server) -> None:
    run = train_against_fake_server(
        ["rollout.sglang.sync_mode=disk", "trainer.device=cpu", "trainer.lr=0.01"]
    )
    run_dir, omni, records = run.run_dir, run.omni, run.records
    assert run.weight_version == "step-2"
    versions = [r.weight_version for r in records if r.outcome == "ok"]
    assert (
        len(versions) == 16 and versions[:8] == ["default"] * 8 and versions[8:] == ["step-1"] * 8
    )
    pushed = run_dir / "weight_sync" / "step-2"
    got = read_hub_tensors(pushed)
    hub = expected_server_tensors(omni)
    assert sorted(got) == sorted(hub)
    for name, tensor in hub.items():
        assert got[name].shape == tensor.shape and got[name].dtype == tensor.dtype, name
    assert not torch.equal(got["thinker.lm_head.weight"], hub["thinker.lm_head.weight"])
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    synced = [line["weight_sync/tensors"] for line in lines if line.get("step", 0) >= 1]
    assert synced == [len(hub)] * 2


def test_failed_weight_sync_saves_a_checkpoint_before_stopping(
    train_against_fake_server, tmp_path
) -> None:
    """Issue 15 item 3: a disk update that keeps failing (past the client's bounded retries)
    stops the run, but only after the step's update is checkpointed."""
    import pytest
    from omni_grpo.run.checkpoint import latest_checkpoint
    from omni_grpo.sync.base import WeightSyncError

    def always_500(server) -> None:
        server.faults.fail_next(1000, status=500, route="/update_weights_from_disk")

    with pytest.raises(WeightSyncError, match="does not report weight_version 'step-1'"):
        train_against_fake_server(
            ["rollout.sglang.sync_mode=disk", "trainer.device=cpu"], arm=always_500
        )
    ckpt = latest_checkpoint(tmp_path / "run")
    assert ckpt is not None and ckpt.name == "step_000001"

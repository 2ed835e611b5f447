"""GPU: ``omni-grpo train`` end to end with ``trainer.backend: megatron``.

The scale path's loop top to bottom on one GPU: tiny Omni checkpoint -> extraction -> synthetic
image/audio/video data -> rollouts over HTTP from the fake sglang-omni server (the Megatron
backend holds no HF module, so rollouts are remote) -> GRPO steps in the megatron-core thinker
with the shared loss -> disk weight sync after each step. Checks that step 2's rollouts carry the
version pushed after step 1 and that every pushed tensor has the hub name, shape and dtype.
Skips without CUDA or megatron-core.
"""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_train_two_steps_with_megatron_backend(train_against_fake_server) -> None:
    pytest.importorskip("megatron.core")
    from omni_grpo.testing.sync import expected_server_tensors, read_hub_tensors

    run = train_against_fake_server(
        [
            "rollout.sglang.sync_mode=disk",
            "trainer.backend=megatron",
            "trainer.device=cuda",
            "trainer.megatron.precision=fp32",
            "trainer.lr=0.01",
        ],
        letters="AB",
        prompts_per_step=3,
        n_train=6,
        n_eval=3,
    )
    run_dir, omni = run.run_dir, run.omni
    assert run.weight_version == "step-2"
    versions = [r.weight_version for r in run.records if r.outcome == "ok"]
    assert versions[:12] == ["default"] * 12 and versions[12:] == ["step-1"] * 12
    pushed = run_dir / "weight_sync" / "step-2"
    got = read_hub_tensors(pushed)
    hub = expected_server_tensors(omni)
    assert sorted(got) == sorted(hub)
    for name, tensor in hub.items():
        assert got[name].shape == tensor.shape and got[name].dtype == tensor.dtype, name
    assert not torch.equal(got["thinker.lm_head.weight"], hub["thinker.lm_head.weight"])
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "loss" in line]
    assert [line["step"] for line in steps] == [1, 2]
    assert all(torch.isfinite(torch.tensor(line["loss"])) for line in steps)

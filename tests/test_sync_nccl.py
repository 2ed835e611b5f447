"""GPU: the distributed weight sync over NCCL (trainer on cuda:0, receivers on the other GPUs).

Same protocol as the CPU/gloo tests (fake servers over HTTP + receiver processes joining with the
servers' rank offsets), with ``backend="nccl"`` and bf16 weights as on a real trainer. Skips
without at least two CUDA devices (NCCL cannot put two ranks on one GPU).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

needs_two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"
)


@needs_two_gpus
def test_nccl_sync_bf16_bit_exact(
    tmp_path: Path, tiny_omni_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from omni_grpo.config import SglangOmniConfig
    from omni_grpo.sync import make_weight_sync
    from omni_grpo.testing.sync import ServerSideReceivers, expected_server_tensors
    from omni_rollout_client.testing import FakeOmniServer
    from transformers import Qwen3OmniMoeThinkerForConditionalGeneration

    for key in ("NCCL_CUMEM_ENABLE", "NCCL_NVLS_ENABLE"):  # as the upstream 2-GPU e2e test does
        monkeypatch.setenv(key, os.environ.get(key, "0"))
    torch.cuda.set_device(0)
    model = Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(
        str(tiny_omni_dir), dtype=torch.bfloat16
    )
    state = {k: v.detach().to("cuda:0") for k, v in model.state_dict().items()}
    expected = {k: v.to(torch.bfloat16) for k, v in expected_server_tensors(tiny_omni_dir).items()}
    n_receivers = torch.cuda.device_count() - 1
    with FakeOmniServer(tp_size=n_receivers) as server:
        cfg = SglangOmniConfig(urls=[server.url], sync_mode="distributed")
        sync = make_weight_sync(cfg, run_dir=tmp_path, backend="nccl", bucket_bytes=64 << 10)
        with ServerSideReceivers([server], tmp_path / "recv", backend="nccl") as rx:
            try:
                report = sync.push(state, "gpu-1")
                group = sync.group.group_name
            finally:
                sync.close()
    assert not rx.errors and report.buckets >= 2
    received = rx.received(group)
    assert sorted(received) == list(range(1, n_receivers + 1))
    for got in received.values():
        assert sorted(got) == sorted(expected)
        for name, want in expected.items():
            assert got[name].dtype == torch.bfloat16 and torch.equal(
                got[name].view(torch.int16), want.view(torch.int16)
            ), name

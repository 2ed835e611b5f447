"""Distributed weight sync: trainer (this process) -> fake servers over HTTP + receivers over gloo.

The fake sglang-omni servers accept and record the admin requests; ``ServerSideReceivers`` plays
the thinker TP ranks in separate processes, joining the group with the rank offsets the servers
were given and receiving every bucket per the names/dtypes/shapes the servers recorded. Every
received tensor is compared bit-exactly with the reference computed from the hub checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from omni_grpo.config import SglangOmniConfig
from omni_grpo.sync import WeightSyncError, make_weight_sync
from omni_grpo.sync.distributed import DistributedWeightSync
from omni_grpo.sync.testing import ServerSideReceivers, expected_server_tensors
from omni_rollout_client.testing import FakeOmniServer


@pytest.fixture(scope="module")
def thinker_state(tiny_omni_dir: Path) -> dict[str, torch.Tensor]:
    from transformers import Qwen3OmniMoeThinkerForConditionalGeneration

    model = Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(
        str(tiny_omni_dir), dtype=torch.float32
    )
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_bit_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want), (sorted(set(want) - set(got)), sorted(set(got) - set(want)))
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name].view(torch.uint8), tensor.contiguous().view(torch.uint8)), name


def test_distributed_sync_two_servers_rank_offsets_bit_exact(
    tmp_path: Path, tiny_omni_dir: Path, thinker_state
) -> None:
    """Server A (TP 1) and server B (TP 2): world 4, offsets 1 and 2; three receivers, each gets
    every tensor of every bucket; flush_cache and the version ride on the last bucket only."""
    expected = expected_server_tensors(tiny_omni_dir)
    with FakeOmniServer(tp_size=1) as a, FakeOmniServer(tp_size=2) as b:
        cfg = SglangOmniConfig(urls=[a.url, b.url], sync_mode="distributed")
        # small buckets so the tiny model spans several (the config's unit is MiB)
        sync = make_weight_sync(cfg, run_dir=tmp_path, backend="gloo", bucket_bytes=96 << 10)
        assert isinstance(sync, DistributedWeightSync)
        with ServerSideReceivers([a, b], tmp_path / "recv") as rx:
            try:
                report = sync.push(thinker_state, "step-1", layout="hf_memory")
                group = sync.group.group_name
                report2 = sync.push(iter(thinker_state.items()), "step-2", layout="hf_memory")
                assert sync.group.group_name == group  # the group is reused across pushes
            finally:
                sync.close()
        assert not rx.errors
        assert not dist.is_initialized()  # the trainer's default process group was never touched
        n_buckets = report.buckets
        assert n_buckets >= 2 and report2.buckets == n_buckets
        for push in (slice(0, n_buckets), slice(n_buckets, 2 * n_buckets)):
            received = rx.received(group, push)
            assert sorted(received) == [1, 2, 3]
            for got in received.values():
                _assert_bit_exact(got, expected)
        for server, offset in ((a, 1), (b, 2)):
            log = server.admin_log
            init = [p for r, p in log if r == "/init_weights_update_group"]
            assert (
                len(init) == 1 and init[0]["rank_offset"] == offset and init[0]["world_size"] == 4
            )
            assert init[0]["stages"] == ["thinker"] and init[0]["backend"] == "gloo"
            updates = [p for r, p in log if r == "/update_weights_from_distributed"]
            assert len(updates) == 2 * n_buckets
            assert [u.get("flush_cache") for u in updates[:n_buckets]] == [False] * (
                n_buckets - 1
            ) + [True]
            assert [u.get("weight_version") for u in updates[:n_buckets]] == [None] * (
                n_buckets - 1
            ) + ["step-1"]
            assert all(u["stages"] == ["thinker"] for u in updates)
            routes = [r for r, _ in log]
            first_update = routes.index("/update_weights_from_distributed")
            assert (
                routes[first_update - 1] == "/pause_generation"
                and log[first_update - 1][1]["mode"] == "retract"
            )
            assert routes.count("/continue_generation") == 2
            assert routes[-1] == "/destroy_weights_update_group"
            assert server.weight_version == "step-2" and not server.engine_paused


def test_failed_distributed_update_continues_and_raises(
    tmp_path: Path, tiny_omni_dir: Path, thinker_state
) -> None:
    """The server fails the update (it lost the group): it stays paused per the contract, so the
    sync must send continue_generation, raise, and rebuild the group on the next push."""
    with FakeOmniServer() as server:
        cfg = SglangOmniConfig(urls=[server.url], sync_mode="distributed", bucket_mb=64)
        sync = make_weight_sync(cfg, run_dir=tmp_path, backend="gloo")
        with ServerSideReceivers([server], tmp_path / "recv") as rx:
            try:
                sync.push(thinker_state, "ok-1")
                first_group = sync.group.group_name
                server.call(lambda: server.engine.groups.clear())
                with pytest.raises(WeightSyncError, match="not initialized"):
                    sync.push(thinker_state, "bad-2")
                routes = [r for r, _ in server.admin_log]
                assert (
                    routes[-1] == "/continue_generation"
                    and routes[-2] == "/update_weights_from_distributed"
                )
                assert not server.engine_paused and server.weight_version == "ok-1"
                assert sync.group is None  # poisoned group dropped
                sync.push(thinker_state, "ok-3")  # rebuilt under a fresh group name
                assert sync.group.group_name != first_group and server.weight_version == "ok-3"
                final_group = sync.group.group_name
            finally:
                sync.close()
        assert not rx.errors
        _assert_bit_exact(rx.received(final_group)[1], expected_server_tensors(tiny_omni_dir))

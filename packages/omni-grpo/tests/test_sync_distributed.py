"""Distributed weight sync: trainer (this process) -> fake servers over HTTP + receivers over gloo.

The fake sglang-omni servers accept and record the admin requests; ``ServerSideReceivers`` plays
the thinker TP ranks in separate processes, joining the group with the rank offsets the servers
were given and receiving every bucket per the names/dtypes/shapes the servers recorded. Every
received tensor is compared bit-exactly with the reference computed from the hub checkpoint.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from omni_grpo.config import SglangOmniConfig
from omni_grpo.sync import WeightSyncError, make_weight_sync
from omni_grpo.sync.distributed import DistributedWeightSync
from omni_grpo.testing.sync import ServerSideReceivers, expected_server_tensors
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


def test_router_only_config_finds_workers_and_syncs_with_admin_key(
    tmp_path: Path, tiny_omni_dir: Path, thinker_state
) -> None:
    """Only ``router_url`` configured: the workers are discovered through ``/workers`` and each
    is called directly (the router refuses multi-worker group init); the admin key is sent."""
    from omni_rollout_client.testing import FakeOmniRouter

    key = "s3cret"
    with (
        FakeOmniServer(admin_api_key=key) as a,
        FakeOmniServer(admin_api_key=key) as b,
        FakeOmniRouter([a.url, b.url], admin_api_key=key) as router,
    ):
        cfg = SglangOmniConfig(router_url=router.url, admin_api_key=key, sync_mode="distributed")
        sync = make_weight_sync(cfg, run_dir=tmp_path, backend="gloo")
        assert sorted(c.base_url for c in sync.clients) == sorted([a.url, b.url])
        with ServerSideReceivers([a, b], tmp_path / "recv") as rx:
            try:
                sync.push(thinker_state, "r1")
                group = sync.group.group_name
            finally:
                sync.close()
        assert not rx.errors
        received = rx.received(group)
        assert sorted(received) == [1, 2]
        expected = expected_server_tensors(tiny_omni_dir)
        for got in received.values():
            _assert_bit_exact(got, expected)
        assert a.weight_version == b.weight_version == "r1"


def test_bad_name_in_a_later_bucket_resumes_servers_and_keeps_version(
    tmp_path: Path, thinker_state
) -> None:
    """An export iterator that yields an unmapped name mid-way: earlier buckets went out, so the
    error is raised after continue_generation, and the version is never bumped."""

    def export():
        yield from thinker_state.items()
        yield "model.language_model.layers.0.mlp.shared_expert.up_proj.weight", torch.zeros(4, 4)

    with FakeOmniServer() as server:
        cfg = SglangOmniConfig(urls=[server.url], sync_mode="distributed")
        sync = make_weight_sync(cfg, run_dir=tmp_path, backend="gloo", bucket_bytes=64 << 10)
        with ServerSideReceivers([server], tmp_path / "recv"):
            try:
                with pytest.raises(WeightSyncError, match="shared_expert"):
                    sync.push(export(), "never")
            finally:
                sync.close()
        routes = [r for r, _ in server.admin_log]
        assert "/update_weights_from_distributed" in routes
        assert routes[routes.index("/pause_generation") :].count("/continue_generation") == 1
        updates = [p for r, p in server.admin_log if r == "/update_weights_from_distributed"]
        assert all(u.get("weight_version") is None and not u.get("flush_cache") for u in updates)
        assert server.weight_version == "default" and not server.engine_paused


def test_distributed_update_with_a_request_in_flight_pauses_with_retract(
    tmp_path: Path, thinker_state
) -> None:
    from omni_grpo.aio import BackgroundLoop
    from omni_rollout_client.client import OmniRolloutClient
    from omni_rollout_client.testing import FakeGeneration, FakeRequest

    def long_generation(req: FakeRequest) -> FakeGeneration:
        return FakeGeneration(
            token_ids=[7] * req.max_new_tokens, logprobs=[-0.5] * req.max_new_tokens
        )

    with FakeOmniServer(token_delay_s=0.05, generator=long_generation) as server:
        loop = BackgroundLoop()
        client = OmniRolloutClient(server.url)
        cfg = SglangOmniConfig(urls=[server.url], sync_mode="distributed")
        sync = make_weight_sync(cfg, run_dir=tmp_path, backend="gloo", loop=loop)
        try:
            with ServerSideReceivers([server], tmp_path / "recv") as rx:
                inflight = loop.submit(
                    client.generate(
                        [1, 2, 3], {"temperature": 1.0, "max_new_tokens": 60, "seed": 1}
                    )
                )
                while server.active_count() == 0:
                    time.sleep(0.01)
                sync.push(thinker_state, "live")
                assert inflight.result(30).weight_version == "live"
                sync.close()
            assert not rx.errors
        finally:
            loop.run(client.aclose())
            loop.close()
        log = server.admin_log
        first_update = next(
            i for i, (r, _) in enumerate(log) if r == "/update_weights_from_distributed"
        )
        assert (
            log[first_update - 1][0] == "/pause_generation"
            and log[first_update - 1][1]["mode"] == "retract"
        )

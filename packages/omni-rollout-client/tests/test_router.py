"""The client against a fake router in front of two fake workers."""

import asyncio

import pytest
from omni_rollout_client import (
    ActiveRequestsError,
    ContractError,
    OmniRolloutClient,
    PreparedPrompt,
    init_weights_update_groups,
)
from omni_rollout_client.testing import FakeGeneration, FakeOmniRouter


@pytest.fixture
def cluster(make_server):
    workers = [make_server(tp_size=2), make_server(tp_size=2)]
    with FakeOmniRouter([w.url for w in workers]) as router:
        yield router, workers


@pytest.mark.asyncio
async def test_generate_through_router_and_worker_listing(cluster):
    router, workers = cluster
    async with OmniRolloutClient(router.url) as client:
        results = await client.generate_group(
            PreparedPrompt.build([1, 2]), 4, {"max_new_tokens": 4}
        )
        listed = await client.list_workers()
    assert len(results) == 4
    assert sorted(w["url"] for w in listed) == sorted(w.url for w in workers)
    assert all(len(w.records) == 2 for w in workers)  # round robin


@pytest.mark.asyncio
async def test_admin_broadcast_and_model_info(cluster, tmp_path):
    router, workers = cluster
    async with OmniRolloutClient(router.url) as client:
        reply = await client.pause_generation("retract")
        assert {r.worker for r in reply.stages} == {w.url for w in workers}
        assert all(w.engine_paused for w in workers)
        await client.update_weights_from_disk(str(tmp_path), weight_version="r1")
        await client.continue_generation()
        info = await client.model_info()
    assert info.weight_version == "r1" and info.thinker_tp_sizes == (2, 2)


@pytest.mark.asyncio
async def test_router_refuses_multi_worker_group_init_and_helper_addresses_each_worker(cluster):
    router, workers = cluster
    async with OmniRolloutClient(router.url) as client:
        with pytest.raises(ContractError, match="distinct rank_offset") as info:
            await client.init_weights_update_group("127.0.0.1", 29500, world_size=5, rank_offset=1)
        assert info.value.status_code == 422
        direct = await client.worker_clients()
        try:
            plan, _ = await init_weights_update_groups(direct, "127.0.0.1", 29500)
        finally:
            for c in direct:
                await c.aclose()
    assert plan.world_size == 5 and plan.rank_offsets == (1, 3)
    offsets = sorted(
        dict(w.admin_log)["/init_weights_update_group"]["rank_offset"] for w in workers
    )
    assert offsets == [1, 3]


@pytest.mark.asyncio
async def test_router_update_refused_when_a_worker_has_active_requests(cluster, tmp_path):
    router, workers = cluster
    workers[0].engine.token_delay_s = 0.02
    workers[0].engine.generator = lambda req: FakeGeneration([1] * 30, [-0.1] * 30)
    async with OmniRolloutClient(workers[0].url) as direct, OmniRolloutClient(router.url) as client:
        task = asyncio.create_task(direct.generate([1], {"max_new_tokens": 64}))
        for _ in range(500):
            if workers[0].active_count():
                break
            await asyncio.sleep(0.01)
        with pytest.raises(ActiveRequestsError) as info:
            await client.update_weights_from_disk(str(tmp_path), weight_version="r2")
        assert info.value.status_code == 502 and info.value.active_request_ids
        await task


@pytest.mark.asyncio
async def test_router_names_the_worker_that_is_down(make_server):
    alive = make_server()
    with FakeOmniRouter([alive.url, "http://127.0.0.1:9"]) as router:
        async with OmniRolloutClient(router.url) as client:
            with pytest.raises(ContractError, match="127.0.0.1:9: ConnectError") as info:
                await client.pause_generation("retract")
    assert info.value.status_code == 502

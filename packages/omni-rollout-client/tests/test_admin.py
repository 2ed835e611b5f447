"""Admin routes against the fake worker over loopback."""

import asyncio

import httpx
import pytest
from omni_rollout_client import (
    ActiveRequestsError,
    AdminAuthError,
    ClientValidationError,
    ConflictError,
    EnginePausedError,
    NotSupportedError,
    OmniRolloutClient,
    RetryPolicy,
    RouteNotFoundError,
    TransientServerError,
    WeightUpdateError,
    plan_weight_sync_ranks,
)
from omni_rollout_client.client import Retry
from omni_rollout_client.testing import FakeGeneration

FAST = RetryPolicy(max_attempts=3, base_delay_s=0.01, max_delay_s=0.02)


def long_generator(eos):
    return lambda req: FakeGeneration(token_ids=[1] * 30 + [eos], logprobs=[-0.1] * 31)


async def wait_active(server, n=1):
    for _ in range(500):
        if server.active_count() >= n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("no active request")


@pytest.mark.asyncio
async def test_pause_continue_scoped_to_thinker(server):
    async with OmniRolloutClient(server.url) as client:
        reply = await client.pause_generation("in_place")
        assert reply.stage_data("thinker")[0]["engine_paused"] is True
        assert server.engine_paused
        await client.continue_generation()
        with pytest.raises(ClientValidationError, match="mode"):
            await client.pause_generation("bogus")
    log = server.admin_log
    assert [path for path, _ in log] == ["/pause_generation", "/continue_generation"]
    assert all(body["stages"] == ["thinker"] for _, body in log)
    assert not server.engine_paused


@pytest.mark.asyncio
async def test_update_refused_while_active_then_allowed_under_retract(make_server, tmp_path):
    server = make_server(token_delay_s=0.02)
    server.engine.generator = long_generator(server.engine.eos_token_id)
    async with OmniRolloutClient(server.url) as client:
        task = asyncio.create_task(client.generate([1, 2], {"max_new_tokens": 64}))
        await wait_active(server)
        with pytest.raises(ActiveRequestsError, match="pause_generation") as info:
            await client.update_weights_from_disk(str(tmp_path), weight_version="v1")
        assert info.value.active_request_ids and info.value.status_code == 400
        await client.pause_generation("in_place")
        with pytest.raises(ActiveRequestsError):
            await client.update_weights_from_disk(str(tmp_path), weight_version="v1")
        await client.pause_generation("retract")
        await client.update_weights_from_disk(str(tmp_path), weight_version="v1")
        assert server.engine_paused  # previous pause state restored
        assert await client.weight_version() == "v1"
        await client.continue_generation()
        result = await task
    assert result.weight_version == "v1"  # the retracted request finished with the new weights


@pytest.mark.asyncio
async def test_distributed_update_lifecycle(server):
    async with OmniRolloutClient(server.url) as client:
        assert await client.weight_version() == "default"
        await client.init_weights_update_group("127.0.0.1", 29500, world_size=2, rank_offset=1)
        await client.update_weights_from_distributed(
            ["model.norm.weight"], ["torch.bfloat16"], [[8]], weight_version="step-1"
        )
        assert (await client.generate([1], {"max_new_tokens": 2})).weight_version == "step-1"
        await client.destroy_weights_update_group()
        with pytest.raises(ClientValidationError, match="equal length"):
            await client.update_weights_from_distributed(["a", "b"], ["bfloat16"], [[1]])
    init = dict(server.admin_log)["/init_weights_update_group"]
    assert init["rank_offset"] == 1 and init["world_size"] == 2 and init["stages"] == ["thinker"]
    upd = dict(server.admin_log)["/update_weights_from_distributed"]
    assert upd["dtypes"] == ["bfloat16"] and upd["flush_cache"] is True


@pytest.mark.asyncio
async def test_failed_distributed_update_leaves_engine_paused(server):
    async with OmniRolloutClient(server.url) as client:
        with pytest.raises(EnginePausedError, match="continue_generation") as info:
            await client.update_weights_from_distributed(
                ["x"], ["bfloat16"], [[1]], group_name="missing"
            )
        assert info.value.engine_paused is True and server.engine_paused
        await client.continue_generation()
    assert not server.engine_paused


@pytest.mark.asyncio
async def test_failed_disk_update_does_not_pause(server, tmp_path):
    async with OmniRolloutClient(server.url) as client:
        with pytest.raises(WeightUpdateError) as info:
            await client.update_weights_from_disk(str(tmp_path / "nope"))
    assert not isinstance(info.value, EnginePausedError)
    assert not server.engine_paused and server.weight_version == "default"


@pytest.mark.asyncio
async def test_update_with_abort_all_requests_aborts_in_flight(make_server, tmp_path):
    server = make_server(token_delay_s=0.02)
    server.engine.generator = long_generator(server.engine.eos_token_id)
    async with OmniRolloutClient(server.url, retry=FAST) as client:
        task = asyncio.create_task(client.generate([1, 2], {"max_new_tokens": 64}))
        await wait_active(server)
        await client.update_weights_from_disk(
            str(tmp_path), weight_version="v2", abort_all_requests=True
        )
        with pytest.raises(Exception) as info:
            await task
    assert type(info.value).__name__ == "GenerationAbortedError"


@pytest.mark.asyncio
async def test_admin_key_auth_and_redaction(make_server):
    server = make_server(admin_api_key="s3cret-key")
    async with OmniRolloutClient(server.url) as anon:
        with pytest.raises(AdminAuthError) as info:
            await anon.model_info()
        assert info.value.status_code == 401
        assert (await anon.generate([1], {"max_new_tokens": 2})).token_ids  # /generate needs no key
    async with OmniRolloutClient(server.url, admin_api_key="wrong-key") as bad:
        with pytest.raises(AdminAuthError) as info:
            await bad.pause_generation("retract")
        assert info.value.status_code == 403 and "wrong-key" not in str(info.value)
    async with OmniRolloutClient(server.url, admin_api_key="s3cret-key") as good:
        assert "s3cret" not in repr(good) and "redacted" in repr(good)
        assert (await good.model_info()).weight_version == "default"
    r = httpx.post(server.url + "/update_weights_from_tensor", json={})
    assert r.status_code == 401  # auth before the 501 stub
    r = httpx.post(
        server.url + "/update_weights_from_tensor",
        json={},
        headers={"Authorization": "Bearer s3cret-key"},
    )
    assert r.status_code == 501 and r.json()["error"]["code"] == "not_implemented"


@pytest.mark.parametrize(
    "method, route",
    [
        ("GET", "/get_server_info"),
        ("GET", "/server_info"),
        ("POST", "/flush_cache"),
        ("GET", "/health_generate"),
        ("POST", "/abort_request"),
        ("GET", "/get_weight_version"),
        ("POST", "/begin_weight_update"),
        ("POST", "/end_weight_update"),
        ("GET", "/get_model_info"),
    ],
)
def test_plain_sglang_routes_are_404(server, method, route):
    r = httpx.request(method, server.url + route)
    assert r.status_code == 404 and r.json() == {"detail": "Not Found"}


@pytest.mark.asyncio
async def test_noop_methods_never_touch_the_server(server):
    async with OmniRolloutClient(server.url) as client:
        for call in (
            client.flush_cache,
            client.begin_weight_update,
            client.end_weight_update,
            client.get_server_info,
        ):
            assert await call() is None
        with pytest.raises(RouteNotFoundError, match="no such route"):
            await client.list_workers()  # a bare worker has no /workers
    assert [p for p, _ in server.admin_log] == ["/workers"]


@pytest.mark.asyncio
async def test_tensor_update_stub_is_not_supported(server):
    async with OmniRolloutClient(server.url) as client:
        with pytest.raises(NotSupportedError):
            await client._send(
                "POST",
                "/update_weights_from_tensor",
                json_body={},
                admin=True,
                retry=Retry.ALL,
                read_timeout=5,
            )


@pytest.mark.asyncio
async def test_unknown_stage_500_then_connection_recovers(server):
    async with OmniRolloutClient(server.url, retry=FAST) as client:
        with pytest.raises(TransientServerError) as info:
            await client.pause_generation("retract", stages=["no_such_stage"])
        assert info.value.status_code == 500 and info.value.attempts == 3
        await client.continue_generation()  # the next pooled request still works
        assert (await client.model_info()).weight_version == "default"


@pytest.mark.asyncio
async def test_speech_pipeline_needs_thinker_scope(make_server):
    server = make_server(speech=True)
    async with OmniRolloutClient(server.url, stages=None) as unscoped:
        with pytest.raises(WeightUpdateError, match="rank collision"):
            await unscoped.init_weights_update_group("127.0.0.1", 1, world_size=2, rank_offset=1)
    async with OmniRolloutClient(server.url) as client:
        await client.init_weights_update_group("127.0.0.1", 1, world_size=2, rank_offset=1)
        await client.update_weights_from_distributed(
            ["lm_head.weight"], ["bfloat16"], [[4, 4]], weight_version="t1"
        )
        assert (await client.model_info(stages=["thinker"])).weight_version == "t1"
        # Scoped by default like pause/continue: the talker's old version does not 409 it.
        assert (await client.model_info()).weight_version == "t1"
        assert (await client.weight_version()) == "t1"
        await client.wait_until_ready(timeout_s=5, poll_s=0.05)
        with pytest.raises(ConflictError):
            await client.model_info(stages=None)  # thinker t1 vs talker default: mixed -> 409


@pytest.mark.asyncio
async def test_wait_until_ready_polls_health(make_server):
    server = make_server(startup_delay_s=0.5)
    async with OmniRolloutClient(server.url) as client:
        first = await client.health()
        assert not first.ok and first.status_code == 503 and first.body["status"] == "starting"
        ready = await client.wait_until_ready(timeout_s=10, poll_s=0.05)
        assert ready.ok


def test_rank_plan():
    plan = plan_weight_sync_ranks([2, 4, 1])
    assert plan.world_size == 8 and plan.rank_offsets == (1, 3, 7)
    with pytest.raises(ValueError, match="tp_sizes"):
        plan_weight_sync_ranks([])
    with pytest.raises(ValueError, match="tp_sizes"):
        plan_weight_sync_ranks([0])


@pytest.mark.asyncio
async def test_admin_key_never_reaches_the_logs(make_server, caplog):
    import logging

    server = make_server(admin_api_key="k-9f8e7d")
    caplog.set_level(logging.DEBUG)
    async with OmniRolloutClient(server.url, admin_api_key="k-9f8e7d") as client:
        await client.pause_generation("retract")
        await client.continue_generation()
    async with OmniRolloutClient(server.url, admin_api_key="wrong-1234") as client:
        with pytest.raises(AdminAuthError) as info:
            await client.model_info()
    assert caplog.records  # httpx/httpcore debug logging was on
    assert "k-9f8e7d" not in caplog.text and "wrong-1234" not in caplog.text
    assert "wrong-1234" not in repr(info.value) and "wrong-1234" not in str(info.value.detail)

"""Fault injection over real loopback HTTP: bounded retries, no lost or duplicated samples."""

import asyncio
from collections import Counter

import pytest
from omni_rollout_client import (
    ContractError,
    GenerationAbortedError,
    OmniRolloutClient,
    PreparedPrompt,
    RetryPolicy,
    Timeouts,
    TransientServerError,
)
from omni_rollout_client.testing import FakeGeneration

FAST = RetryPolicy(max_attempts=5, base_delay_s=0.01, max_delay_s=0.05)


def index_generator(eos: int, length: int = 2):
    """Every executed request yields a unique first token (its server-side index)."""
    return lambda req: FakeGeneration(
        token_ids=[req.request_index] + [1] * (length - 2) + [eos], logprobs=[-0.5] * length
    )


@pytest.mark.asyncio
async def test_5xx_burst_is_retried_then_succeeds(server):
    server.faults.fail_next(3, status=503)
    async with OmniRolloutClient(server.url, retry=FAST) as client:
        r = await client.generate([1, 2], {"max_new_tokens": 4})
    assert r.attempts == 4
    assert len(server.records) == 1  # the burst was refused before executing


@pytest.mark.asyncio
async def test_retries_are_bounded(server):
    server.faults.fail_next(5, status=502)
    async with OmniRolloutClient(
        server.url, retry=RetryPolicy(max_attempts=3, base_delay_s=0.01)
    ) as client:
        with pytest.raises(TransientServerError) as info:
            await client.generate([1, 2], {"max_new_tokens": 4})
    assert info.value.attempts == 3 and info.value.status_code == 502
    assert server.faults.pending() == 2


@pytest.mark.asyncio
async def test_4xx_is_never_retried(server):
    server.faults.fail_next(2, status=422)
    async with OmniRolloutClient(server.url, retry=FAST) as client:
        with pytest.raises(ContractError) as info:
            await client.generate([1, 2], {"max_new_tokens": 4})
    assert info.value.status_code == 422
    assert server.faults.pending() == 1


@pytest.mark.asyncio
async def test_dropped_connections_lose_and_duplicate_nothing(make_server):
    server = make_server(generator=None)
    server.engine.generator = index_generator(server.engine.eos_token_id, length=3)
    server.faults.drop_next(3)
    server.faults.fail_next(2, status=500)
    async with OmniRolloutClient(server.url, retry=FAST, max_concurrency=4) as client:
        prompt = PreparedPrompt.build([1, 2, 3])
        results = await client.generate_group(prompt, 8, {"max_new_tokens": 8})
    records = server.records
    outcomes = Counter(r.outcome for r in records)
    assert outcomes == {"ok": 8, "dropped": 3}
    got = sorted(r.token_ids[0] for r in results)
    assert got == sorted(r.request_index for r in records if r.outcome == "ok")
    assert len(set(got)) == 8  # no duplicates
    assert not set(got) & {r.request_index for r in records if r.outcome == "dropped"}
    assert sum(r.attempts for r in results) == 8 + 3 + 2


@pytest.mark.asyncio
async def test_slow_responses_time_out_and_are_retried(server):
    server.faults.delay_next(2, seconds=1.0)
    timeouts = Timeouts(generate=0.3)
    async with OmniRolloutClient(server.url, retry=FAST, timeouts=timeouts) as client:
        r = await client.generate([1, 2], {"max_new_tokens": 4})
    assert r.attempts == 3


@pytest.mark.asyncio
async def test_connection_refused_is_bounded():
    async with OmniRolloutClient(
        "http://127.0.0.1:9", retry=RetryPolicy(max_attempts=2, base_delay_s=0.01)
    ) as client:
        with pytest.raises(TransientServerError, match="2 attempt"):
            await client.generate([1], {"max_new_tokens": 1})


async def _wait_active(server, n, timeout=5.0):
    for _ in range(int(timeout / 0.01)):
        if server.active_count() >= n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"server never had {n} active requests")


@pytest.mark.asyncio
async def test_abort_during_generation_is_not_retried(make_server):
    server = make_server(token_delay_s=0.05)
    server.engine.generator = index_generator(server.engine.eos_token_id, length=40)
    async with OmniRolloutClient(server.url, retry=FAST) as client:
        tasks = [
            asyncio.create_task(client.generate([1, i + 1], {"max_new_tokens": 64}))
            for i in range(4)
        ]
        await _wait_active(server, 4)
        await client.abort_all()
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(isinstance(o, GenerationAbortedError) for o in outcomes)
        assert not server.engine_paused
        after = await client.generate([7], {"max_new_tokens": 64})  # the engine was continued
    assert after.finish_reason == "stop"
    assert Counter(r.outcome for r in server.records) == {"aborted": 4, "ok": 1}


@pytest.mark.asyncio
async def test_abort_by_someone_else_is_retried(make_server):
    server = make_server(token_delay_s=0.02)
    server.engine.generator = index_generator(server.engine.eos_token_id, length=20)
    async with (
        OmniRolloutClient(server.url, retry=FAST) as rollout,
        OmniRolloutClient(server.url) as other,
    ):
        task = asyncio.create_task(rollout.generate([1, 2], {"max_new_tokens": 64}))
        await _wait_active(server, 1)
        await other.abort_all()
        result = await task
    assert result.attempts == 2
    assert Counter(r.outcome for r in server.records) == {"aborted": 1, "ok": 1}


@pytest.mark.asyncio
async def test_concurrency_limit_bounds_in_flight_requests(make_server):
    server = make_server(token_delay_s=0.01)
    server.engine.generator = index_generator(server.engine.eos_token_id, length=5)
    async with OmniRolloutClient(server.url, max_concurrency=2) as client:
        results = await client.generate_group(PreparedPrompt.build([3]), 8, {"max_new_tokens": 8})
    assert len(results) == 8
    assert server.call(lambda: server.engine.max_active) == 2


@pytest.mark.asyncio
async def test_queue_full_503_is_retried(make_server):
    server = make_server(token_delay_s=0.01, max_inflight=1)
    server.engine.generator = index_generator(server.engine.eos_token_id, length=5)
    async with OmniRolloutClient(
        server.url, retry=RetryPolicy(max_attempts=20, base_delay_s=0.01, max_delay_s=0.05)
    ) as client:
        results = await client.generate_group(PreparedPrompt.build([3]), 3, {"max_new_tokens": 8})
    assert sorted(r.token_ids[0] for r in results) == sorted(
        r.request_index for r in server.records
    )


@pytest.mark.asyncio
async def test_group_failure_raises_the_typed_error_not_an_exception_group(server):
    server.faults.fail_next(1, status=400)
    async with OmniRolloutClient(server.url, retry=FAST) as client:
        with pytest.raises(ContractError) as info:
            await client.generate_group(PreparedPrompt.build([3]), 4, {"max_new_tokens": 8})
    assert info.value.status_code == 400

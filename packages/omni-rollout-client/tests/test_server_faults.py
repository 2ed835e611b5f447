"""The 0.1.9 server behaviours that broke runs (issue 15, items 1-6), over real loopback HTTP.

Each test drives the fake server into the behaviour observed on the real 0.1.9 HTTP layer
(contract §10-11) and checks the client copes: scoped ``model_info`` on a speech pipeline,
server-side ``timeout_s`` and updates applied after a timed-out reply, bounded retries of an
idempotent disk update, abandoned requests aborted on the server, audio-in-video refused,
``max_new_tokens`` required.
"""

import asyncio

import httpx
import pytest
from omni_rollout_client import (
    QWEN3_OMNI_MEDIA_IDS,
    ClientValidationError,
    MediaTokenIds,
    OmniRolloutClient,
    PreparedPrompt,
    RetryPolicy,
    Timeouts,
    TransientServerError,
)
from omni_rollout_client.testing import FakeGeneration

FAST = RetryPolicy(max_attempts=4, base_delay_s=0.01, max_delay_s=0.05)


async def _until(predicate, what: str, limit_s: float = 10.0) -> None:
    for _ in range(int(limit_s / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"never happened: {what}")


# ---------------------------------------------------------------- 1. model_info scoped by stage
@pytest.mark.asyncio
async def test_model_info_is_scoped_so_a_speech_pipeline_does_not_409(make_server, tmp_path):
    server = make_server(speech=True)
    async with OmniRolloutClient(server.url, retry=FAST) as client:
        await client.pause_generation("retract")
        await client.update_weights_from_disk(str(tmp_path), weight_version="v1")
        await client.continue_generation()
        # talker_ar still reports "default": an unscoped /model_info is a 409 on 0.1.9
        info = await client.model_info()
        assert info.weight_version == "v1" and info.thinker_tp_sizes == (1,)
        await client.wait_until_ready(timeout_s=5, poll_s=0.05)
    assert ("/model_info", {"stages": ["thinker"], "timeout_s": pytest.approx(595.0)}) in (
        server.admin_log
    )


# --------------------------------------------------- 2. server-side timeout_s, re-read on timeout
def test_fake_reproduces_timed_out_update_that_still_applies(server, tmp_path):
    """0.1.9: the coordinator's wait_for times out (plain 500) but the scheduler still loads."""
    server.faults.slow_next(1, seconds=0.6, route="/update_weights_from_disk")
    with httpx.Client(base_url=server.url, timeout=30) as http:
        http.post("/pause_generation", json={"mode": "retract", "stages": ["thinker"]})
        r = http.post(
            "/update_weights_from_disk",
            json={"model_path": str(tmp_path), "weight_version": "v9", "timeout_s": 0.1},
        )
        assert r.status_code == 500 and r.text == "Internal Server Error"
        # /model_info queues behind the load on the scheduler, then shows the new version
        info = http.post("/model_info", json={"stages": ["thinker"]}).json()
    assert info["weight_version"] == "v9"


@pytest.mark.asyncio
async def test_admin_calls_carry_a_server_timeout_below_the_clients(server, tmp_path):
    timeouts = Timeouts(admin=40.0)
    async with OmniRolloutClient(server.url, timeouts=timeouts) as client:
        await client.pause_generation("retract")
        await client.update_weights_from_disk(str(tmp_path), weight_version="v1")
        await client.continue_generation()
    sent = {route: payload.get("timeout_s") for route, payload in server.admin_log}
    assert sent["/update_weights_from_disk"] == pytest.approx(36.0)  # 90% of the client's 40 s
    assert sent["/pause_generation"] == sent["/continue_generation"] == pytest.approx(36.0)


@pytest.mark.asyncio
@pytest.mark.parametrize("route", ["/update_weights_from_disk", "/update_weights_from_distributed"])
async def test_timed_out_update_that_applied_is_a_success(server, tmp_path, route):
    server.faults.slow_next(1, seconds=1.2, route=route)
    # server timeout_s = 0.9 s: its 500 comes first, then /model_info waits for the load
    async with OmniRolloutClient(server.url, retry=FAST, timeouts=Timeouts(admin=1.0)) as client:
        await client.pause_generation("retract")
        if route == "/update_weights_from_disk":
            reply = await client.update_weights_from_disk(str(tmp_path), weight_version="v2")
        else:
            await client.init_weights_update_group("127.0.0.1", 1, world_size=2, rank_offset=1)
            reply = await client.update_weights_from_distributed(
                ["lm_head.weight"], ["bfloat16"], [[4, 4]], weight_version="v2"
            )
        await client.continue_generation()
        assert reply.success and "recovered_from" in reply.body
        assert (await client.model_info()).weight_version == "v2"
    assert [r for r, _ in server.admin_log].count(route) == 1  # applied once, not re-sent


# ------------------------------------------------ 3. bounded retries of the idempotent disk update
@pytest.mark.asyncio
async def test_transient_500_on_disk_update_is_retried(server, tmp_path):
    server.faults.fail_next(2, status=500, route="/update_weights_from_disk")
    async with OmniRolloutClient(server.url, retry=FAST) as client:
        await client.pause_generation("retract")
        reply = await client.update_weights_from_disk(str(tmp_path), weight_version="v3")
        await client.continue_generation()
    assert reply.success and server.weight_version == "v3"


@pytest.mark.asyncio
async def test_disk_update_retries_are_bounded_and_say_the_version_was_checked(server, tmp_path):
    server.faults.fail_next(9, status=500, route="/update_weights_from_disk")
    async with OmniRolloutClient(server.url, retry=FAST) as client:
        await client.pause_generation("retract")
        with pytest.raises(TransientServerError, match="does not report weight_version 'v4'") as e:
            await client.update_weights_from_disk(str(tmp_path), weight_version="v4")
        await client.continue_generation()
    assert e.value.attempts == FAST.max_attempts
    assert server.faults.pending("/update_weights_from_disk") == 9 - FAST.max_attempts


@pytest.mark.asyncio
async def test_distributed_update_is_not_resent_after_a_500(server):
    server.faults.fail_next(1, status=500, route="/update_weights_from_distributed")
    async with OmniRolloutClient(server.url, retry=FAST) as client:
        await client.init_weights_update_group("127.0.0.1", 1, world_size=2, rank_offset=1)
        await client.pause_generation("retract")
        with pytest.raises(TransientServerError, match="1 attempt"):
            await client.update_weights_from_distributed(
                ["lm_head.weight"], ["bfloat16"], [[4, 4]], weight_version="v5"
            )
        await client.continue_generation()


# ------------------------------------------------ 4. abandoned requests are aborted on the server
@pytest.mark.asyncio
async def test_cancelled_group_is_aborted_on_the_server(make_server):
    long = lambda req: FakeGeneration(  # noqa: E731 - 400 tokens, no early EOS
        token_ids=[7] * req.max_new_tokens, logprobs=[-0.1] * req.max_new_tokens
    )
    server = make_server(token_delay_s=0.05, generator=long)
    async with OmniRolloutClient(server.url, retry=FAST) as client:
        prompt = client.prepare([1, 2, 3])
        task = asyncio.ensure_future(client.generate_group(prompt, 4, {"max_new_tokens": 400}))
        await _until(lambda: server.active_count() == 4, "4 requests running")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # 0.1.9 would decode all 4 to the end (20 s each); the client aborts them instead
        await _until(lambda: client.orphans_aborted == 4, "the client aborted them")
        # an aborted request leaves at its next token step, not within the pause reply
        await _until(lambda: server.active_count() == 0, "the server dropped them")
        assert not server.engine_paused
        after = await client.generate([1, 2], {"max_new_tokens": 2})  # still serving
    assert [r.outcome for r in server.records[:4]] == ["aborted"] * 4
    assert after.completion_tokens == 2


@pytest.mark.asyncio
async def test_timed_out_request_is_aborted_and_the_retry_still_answers(make_server):
    eos = 4095
    first_long = lambda req: FakeGeneration(  # noqa: E731
        token_ids=[7] * (300 if req.request_index == 0 else 1) + [eos],
        logprobs=[-0.1] * (301 if req.request_index == 0 else 2),
    )
    server = make_server(token_delay_s=0.02, generator=first_long)
    async with OmniRolloutClient(server.url, retry=FAST, timeouts=Timeouts(generate=0.5)) as client:
        result = await client.generate([1, 2], {"max_new_tokens": 400})
        assert result.token_ids == [7, eos] and result.attempts == 2
        assert client.orphans_aborted == 1
    assert server.records[0].outcome == "aborted"


# -------------------------------------------------------------- 5. audio-in-video is refused
IDS = MediaTokenIds(vision_start=90, vision_end=91, audio_start=92, audio_pad=93)
VIDEO_PAD = 94


@pytest.mark.parametrize(
    "ids",
    [
        [1, 90, 92, VIDEO_PAD, 93, 93, VIDEO_PAD, 93, 91, 2],  # the processor's interleaved layout
        [1, 90, VIDEO_PAD, 93, VIDEO_PAD, 91],  # audio pads inside the video, no audio_start
        [1, 90, VIDEO_PAD, 93],  # unterminated video span
    ],
)
def test_interleaved_audio_in_video_ids_are_refused(ids):
    with pytest.raises(ClientValidationError, match="no audio-in-video field"):
        PreparedPrompt.build(ids, media_ids=IDS)


def test_separate_audio_and_video_pass():
    ids = [1, 90, VIDEO_PAD, VIDEO_PAD, 91, 92, 93, 93, 2, 90, VIDEO_PAD, 91]
    assert PreparedPrompt.build(ids, media_ids=IDS).input_ids == tuple(ids)


@pytest.mark.asyncio
async def test_client_refuses_audio_in_video_before_sending(server):
    real = QWEN3_OMNI_MEDIA_IDS
    ids = [1, real.vision_start, real.audio_start, 151656, real.audio_pad, real.vision_end]
    async with OmniRolloutClient(server.url) as client:
        with pytest.raises(ClientValidationError, match="0.1.9 server has no audio-in-video"):
            client.prepare(ids)
        with pytest.raises(ClientValidationError, match="0.1.9 server has no audio-in-video"):
            await client.generate(ids, {"max_new_tokens": 2})
        with pytest.raises(ClientValidationError, match="use_audio_in_video"):
            client.prepare([1, 2], use_audio_in_video=True)
    assert server.records == []


# ------------------------------------------------------------ 6. max_new_tokens is required
@pytest.mark.asyncio
@pytest.mark.parametrize("sampling", [None, {}, {"temperature": 1.0}])
async def test_generate_requires_max_new_tokens(server, sampling):
    async with OmniRolloutClient(server.url) as client:
        with pytest.raises(ClientValidationError, match="max_new_tokens'\\] is required"):
            await client.generate([1, 2], sampling)
        with pytest.raises(ClientValidationError, match="max_new_tokens'\\] is required"):
            await client.generate_group(client.prepare([1, 2]), 2, sampling)
        ok = await client.generate([1, 2], {"max_tokens": 3})  # the alias counts
    assert ok.completion_tokens <= 3 and server.records[-1].sampling["max_new_tokens"] == 3


def test_fake_runs_a_request_on_after_the_client_gave_up(make_server):
    """0.1.9 behaviour the abort above exists for: a timed-out HTTP request keeps decoding."""
    long = lambda req: FakeGeneration(  # noqa: E731
        token_ids=[7] * req.max_new_tokens, logprobs=[-0.1] * req.max_new_tokens
    )
    server = make_server(token_delay_s=0.01, generator=long)
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 80, "temperature": 1.0}}
    with httpx.Client(base_url=server.url, timeout=0.2) as http, pytest.raises(httpx.ReadTimeout):
        http.post("/generate", json=body)
    asyncio.run(_until(lambda: server.records[0].outcome != "running", "the request ended"))
    assert server.records[0].outcome == "ok" and len(server.records[0].token_ids) == 80

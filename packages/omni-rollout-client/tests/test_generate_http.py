"""The client against the fake server over real loopback HTTP, and the fake's own contract."""

import hashlib

import httpx
import numpy as np
import pytest
from omni_rollout_client import (
    ClientValidationError,
    ContractError,
    OmniRolloutClient,
    PreparedPrompt,
)
from omni_rollout_client.testing import FakeGeneration


def image_mm():
    rng = np.random.default_rng(0)
    return {
        "pixel_values": rng.standard_normal((16, 1536)).astype(np.float32),
        "image_grid_thw": np.array([[1, 4, 4]]),
    }


@pytest.mark.asyncio
async def test_group_of_samples_with_exact_bytes_on_server(server):
    async with OmniRolloutClient(server.url) as client:
        prompt = client.prepare([1, 2, 3], image_mm())
        results = await client.generate_group(
            prompt, 4, {"max_new_tokens": 16, "skip_special_tokens": True}, metadata={"uid": "s1"}
        )
    assert len(results) == 4
    records = server.records
    assert len(records) == 4
    sent = prompt.tensors["pixel_values"]
    for rec in records:
        assert rec.tensor_digests["pixel_values"] == (
            "bfloat16",
            [16, 1536],
            hashlib.sha256(sent.raw.tobytes()).hexdigest(),
        )
        assert rec.sampling["temperature"] == 1.0 and rec.sampling["repetition_penalty"] == 1.0
    by_tokens = sorted(tuple(r.token_ids) for r in records)
    assert by_tokens == sorted(tuple(r.token_ids) for r in results)
    for res in results:
        assert res.token_ids[-1] == server.engine.eos_token_id and res.finish_reason == "stop"
        assert len(res.logprobs) == len(res.token_ids) == res.completion_tokens
        assert res.weight_version == "default" and res.cached_tokens == 0
        assert res.metadata == {"uid": "s1"} and res.prompt_tokens == 3
    assert len({tuple(r.token_ids) for r in results}) > 1  # distinct samples without a seed


@pytest.mark.asyncio
async def test_seeds_give_reproducible_samples_and_length_finish(server):
    async with OmniRolloutClient(server.url) as client:
        a = await client.generate_group(
            PreparedPrompt.build([4, 5]), 2, {"max_new_tokens": 2}, seeds=[7, 8]
        )
        b = await client.generate_group(
            PreparedPrompt.build([4, 5]), 2, {"max_new_tokens": 2}, seeds=[7, 8]
        )
        with pytest.raises(ClientValidationError, match="seeds"):
            await client.generate_group(PreparedPrompt.build([4, 5]), 2, {"seed": 1})
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    for r in a:
        assert len(r.token_ids) <= 2
        if r.token_ids[-1] != server.engine.eos_token_id:
            assert r.finish_reason == "length"


@pytest.mark.asyncio
async def test_custom_generator_callable(make_server):
    server = make_server(
        generator=lambda req: FakeGeneration(
            token_ids=[len(req.input_ids), 0], logprobs=[-1.0, -2.0]
        )
    )
    async with OmniRolloutClient(server.url) as client:
        r = await client.generate([9, 9, 9], {"max_new_tokens": 4})
    assert r.token_ids == [3, 0] and r.logprobs == [-1.0, -2.0]


@pytest.mark.asyncio
async def test_unknown_sampling_key_raises_before_sending(server):
    async with OmniRolloutClient(server.url) as client:
        with pytest.raises(ClientValidationError, match="min_new_tokens"):
            await client.generate([1, 2], {"min_new_tokens": 3})
    assert server.records == []


@pytest.mark.asyncio
async def test_resume_truncated_sample_with_remaining_budget(server):
    async with OmniRolloutClient(server.url) as client:
        prompt = PreparedPrompt.build([1, 2, 3], image_mm())
        server.faults.abort_finish_next(1, after_tokens=2)
        partial = await client.generate(prompt, {"max_new_tokens": 10, "seed": 3})
        assert partial.finish_reason == "abort" and len(partial.token_ids) == 2
        full = await client.resume(prompt, partial, {"max_new_tokens": 10, "seed": 3})
        server.faults.abort_finish_next(1, after_tokens=1)
        auto = await client.generate(prompt, {"max_new_tokens": 10, "seed": 4}, max_resumes=2)
    cont = server.records[1]
    assert cont.input_ids == [1, 2, 3, *partial.token_ids]
    assert cont.sampling["max_new_tokens"] == 8
    assert full.token_ids[:2] == partial.token_ids and full.token_ids[2:] == cont.token_ids
    assert len(full.logprobs) == len(full.token_ids) <= 10 and full.prompt_tokens == 3
    assert auto.finish_reason != "abort" and len(auto.weight_versions) == 2


@pytest.mark.asyncio
async def test_server_context_limit_is_a_contract_error(make_server):
    server = make_server(max_seq_len=16)
    async with OmniRolloutClient(server.url) as client:
        with pytest.raises(ContractError, match="maximum context length") as info:
            await client.generate(list(range(10)), {"max_new_tokens": 8})
    assert info.value.status_code == 400
    assert len(server.records) == 0


# ---- the fake enforces the contract for raw requests (what other clients would send)


def post(server, body, **kw):
    return httpx.post(server.url + "/generate", json=body, timeout=10, **kw)


def test_fake_rejects_forbidden_sampling_keys_but_ignores_top_level_extras(server):
    r = post(server, {"input_ids": [1], "sampling_params": {"skip_special_tokens": True}})
    assert r.status_code == 422
    err = r.json()["detail"][0]
    assert err["type"] == "extra_forbidden" and err["loc"] == [
        "body",
        "sampling_params",
        "skip_special_tokens",
    ]
    ok = post(
        server,
        {
            "input_ids": [1],
            "rid": "x",
            "image_data": None,
            "sampling_params": {"max_new_tokens": 2},
        },
    )
    assert ok.status_code == 200
    meta = ok.json()["meta_info"]
    assert all(len(p) == 2 for p in meta["output_token_logprobs"])
    assert meta["cached_tokens"] == 0 and meta["weight_version"] == "default"
    assert set(meta["finish_reason"]) == {"type", "length"}


def test_fake_omitted_temperature_is_greedy(server):
    a = post(server, {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 4}}).json()
    b = post(server, {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 4}}).json()
    assert a["meta_info"]["output_token_logprobs"] == b["meta_info"]["output_token_logprobs"]
    assert server.records[0].sampling["temperature"] == 0.0


@pytest.mark.parametrize(
    "body, status, fragment",
    [
        ({}, 400, "exactly one of"),
        ({"input_ids": [1], "prompt": "x"}, 400, "exactly one of"),
        ({"input_ids": [1], "stream": True}, 400, "stream=true"),
        ({"input_ids": []}, 422, "too_short"),
        ({"input_ids": [-1]}, 422, "2**63"),
        ({"input_ids": [1], "sampling_params": {"stop": 12}}, 422, "stop"),
        ({"input_ids": [5000]}, 400, "vocab"),
        ({"input_ids": [1], "metadata": {"omni_session": {}}}, 400, "omni_session"),
        ({"input_ids": [1], "return_omni_rollout": True}, 501, "omni_rollout"),
        ({"messages": [{"content": "hi"}]}, 422, "role"),
        ({"input_ids": [1], "output_modalities": ["audio"]}, 501, "omni_rollout"),
        (
            {
                "input_ids": [1],
                "multimodal_train_inputs": {
                    "version": 2,
                    "tensors": {
                        "pixel_values": {"dtype": "float32", "shape": [1], "data": "AAAAAA=="}
                    },
                },
            },
            422,
            "version",
        ),
        (
            {"input_ids": [1], "multimodal_train_inputs": {"version": 1, "tensors": {}}},
            422,
            "too_short",
        ),
        (
            {
                "input_ids": [1],
                "multimodal_train_inputs": {
                    "tensors": {
                        "pixel_values": {"dtype": "float32", "shape": [2], "data": "AAAAAA=="}
                    }
                },
            },
            422,
            "expected 8",
        ),
        (
            {
                "input_ids": [1],
                "multimodal_train_inputs": {
                    "tensors": {
                        "pixel_values": {"dtype": "float32", "shape": [1], "data": "AA$AAA=="}
                    }
                },
            },
            422,
            "base64",
        ),
        (
            {
                "input_ids": [1],
                "multimodal_train_inputs": {
                    "tensors": {
                        "pixel_values": {"dtype": "complex64", "shape": [1], "data": "AAAAAA=="}
                    }
                },
            },
            422,
            "dtype",
        ),
        (
            {
                "input_ids": [1],
                "multimodal_train_inputs": {
                    "tensors": {"pixel_values": {"dtype": "float32", "shape": [-1], "data": ""}}
                },
            },
            422,
            "shape",
        ),
        (
            {
                "input_ids": [1],
                "multimodal_train_inputs": {
                    "tensors": {"foo": {"dtype": "float32", "shape": [1], "data": "AAAAAA=="}}
                },
            },
            400,
            "unknown multimodal_train_inputs tensors: foo",
        ),
        (
            {
                "input_ids": [1],
                "multimodal_train_inputs": {
                    "tensors": {
                        "image_grid_thw": {"dtype": "int64", "shape": [1], "data": "AQAAAAAAAAA="}
                    }
                },
            },
            400,
            "without pixel_values",
        ),
        (
            {
                "messages": [{"role": "user", "content": "x"}],
                "multimodal_train_inputs": {
                    "tensors": {
                        "pixel_values": {"dtype": "float32", "shape": [1], "data": "AAAAAA=="}
                    }
                },
            },
            400,
            "requires prompt_token_ids",
        ),
    ],
)
def test_fake_generate_status_codes(server, body, status, fragment):
    r = post(server, body)
    assert r.status_code == status, r.text
    assert fragment in r.text


def test_fake_server_answers_500_where_the_real_one_does(server):
    assert (
        post(
            server, {"input_ids": [1], "sampling_params": {"temperature": 1.0, "top_k": 0}}
        ).status_code
        == 500
    )
    assert (
        post(server, {"input_ids": [1], "sampling_params": {"repetition_penalty": 2.5}}).status_code
        == 500
    )
    r = post(
        server,
        {
            "input_ids": [1],
            "multimodal_train_inputs": {
                "tensors": {"pixel_values": {"dtype": "float32", "shape": [0, 3], "data": ""}}
            },
        },
    )
    # The real 0.1.9 layer answers a stage's exception with a JSON 500 carrying its message
    # (scripts/check_real_0_1_9.py); only requests dropped by an abort get a plain-text 500.
    assert r.status_code == 500 and "buffer length (0)" in r.json()["detail"]

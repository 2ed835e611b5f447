"""``SglangOmniEngine`` against the fake sglang-omni server over real loopback HTTP."""

from __future__ import annotations

import hashlib
from importlib.metadata import entry_points

import pytest
import torch
from omni_grpo.config import SamplingParams, SglangOmniConfig
from omni_grpo.rollout.sglang_omni import SglangOmniEngine, SglangOmniEngineError
from omni_grpo.types import PromptInputs, RolloutEngine, Sample
from omni_rollout_client.errors import ClientValidationError
from omni_rollout_client.payload import PreparedPrompt
from omni_rollout_client.testing import FakeGeneration, FakeOmniServer, FakeRequest
from pydantic import ValidationError

VOCAB = 1000


def oracle(req: FakeRequest) -> FakeGeneration:
    """Deterministic in (prompt ids, seed): the test can recompute what the server produced."""
    h = hashlib.sha256(repr((req.input_ids, req.seed, req.temperature)).encode()).digest()
    n = min(req.max_new_tokens, 2 + h[0] % 5)
    ids = [h[1 + i] % (VOCAB - 1) for i in range(n)]
    return FakeGeneration(token_ids=ids, logprobs=[-(h[10 + i] + 1) / 64 for i in range(n)])


def make_prompt(uid: str, *, seed: int = 0) -> PromptInputs:
    g = torch.Generator().manual_seed(seed)
    mm = {
        "pixel_values": torch.randn(16, 1536, generator=g),
        "image_grid_thw": torch.tensor([[1, 4, 4]]),
        "input_features": torch.randn(1, 128, 100, generator=g),
        "feature_attention_mask": torch.ones(1, 100, dtype=torch.long),
    }
    ids = [1, 2, 3] + [900] * 4 + [4] + [902] * 13 + [5, 6]
    return PromptInputs(sample=Sample(uid=uid, prompt="p", label="A"), input_ids=ids, mm=mm)


@pytest.fixture
def server():
    with FakeOmniServer(vocab_size=VOCAB, generator=oracle) as s:
        yield s


def engine_for(server: FakeOmniServer, **cfg) -> SglangOmniEngine:
    return SglangOmniEngine(SglangOmniConfig(urls=[server.url], **cfg), vocab_size=VOCAB)


def test_registered_as_rollout_engine_entry_point(server) -> None:
    cls = entry_points(group="omni_grpo.rollout_engines")["sglang-omni"].load()
    assert cls is SglangOmniEngine
    engine = engine_for(server)
    try:
        assert isinstance(engine, RolloutEngine)
    finally:
        engine.close()


def test_n_completions_per_prompt_with_server_ids_logprobs_and_seeds(server, monkeypatch) -> None:
    builds = []
    real_build = PreparedPrompt.build.__func__

    def counting_build(cls, *a, **k):
        builds.append(1)
        return real_build(cls, *a, **k)

    monkeypatch.setattr(PreparedPrompt, "build", classmethod(counting_build))
    prompts = [make_prompt("u0", seed=0), make_prompt("u1", seed=1)]
    sampling = SamplingParams(temperature=0.7, top_p=0.9, top_k=50, max_new_tokens=5, seed=11)
    engine = engine_for(server)
    try:
        groups = engine.generate(prompts, 3, sampling)
        again = engine.generate(prompts, 3, sampling)
    finally:
        engine.close()
    assert len(builds) == 4  # once per prompt per call, never once per sample
    assert [len(g) for g in groups] == [3, 3]
    records = [r for r in server.records if r.outcome == "ok"]
    assert len(records) == 12
    for prompt, group in zip(prompts, groups, strict=True):
        seeds = set()
        for c in group:
            assert c.prompt is prompt and c.weight_version == "default"
            rec = next(
                r
                for r in records
                if r.metadata["omni_grpo_uid"] == prompt.sample.uid and r.token_ids == c.token_ids
            )
            want = oracle(FakeRequest(0, prompt.input_ids, 0.7, rec.sampling["seed"], 5, []))
            assert c.token_ids == want.token_ids and c.logprobs == want.logprobs
            assert c.finish_reason in ("stop", "length")
            assert rec.sampling["temperature"] == 0.7 and rec.sampling["top_p"] == 0.9
            assert rec.sampling["top_k"] == 50 and rec.sampling["max_new_tokens"] == 5
            assert rec.sampling["repetition_penalty"] == 1.0
            seeds.add(rec.sampling["seed"])
        assert len(seeds) == 3  # distinct per sample
        digests = {
            repr(sorted(r.tensor_digests.items()))
            for r in records
            if r.metadata["omni_grpo_uid"] == prompt.sample.uid
        }
        assert len(digests) == 1  # the same encoded bundle for every sample of the group
    # fixed seed -> reproducible groups
    assert [[c.token_ids for c in g] for g in groups] == [[c.token_ids for c in g] for g in again]


def test_bf16_payload_hands_the_trainer_the_rounded_tensors(server) -> None:
    prompt = make_prompt("b", seed=3)
    original = {k: v.clone() for k, v in prompt.mm.items()}
    engine = engine_for(server, bf16_payload=True)
    try:
        engine.generate([prompt], 2, SamplingParams(temperature=1.0, max_new_tokens=4))
    finally:
        engine.close()
    rec = server.records[0]
    for name in ("pixel_values", "input_features"):
        rounded = original[name].to(torch.bfloat16)
        assert prompt.mm[name].dtype == torch.float32
        assert torch.equal(prompt.mm[name], rounded.float())
        assert not torch.equal(prompt.mm[name], original[name])  # really rounded
        dtype, shape, sha = rec.tensor_digests[name]
        assert dtype == "bfloat16" and shape == list(original[name].shape)
        # the server decoded exactly the bytes of the trainer's tensor, re-cast to bf16
        assert (
            sha
            == hashlib.sha256(
                prompt.mm[name].to(torch.bfloat16).view(torch.int16).numpy().tobytes()
            ).hexdigest()
        )
    assert torch.equal(prompt.mm["image_grid_thw"], original["image_grid_thw"])
    assert rec.tensor_digests["image_grid_thw"][0] == "int64"


def test_fp32_payload_leaves_tensors_alone(server) -> None:
    prompt = make_prompt("f", seed=4)
    original = prompt.mm["pixel_values"].clone()
    engine = engine_for(server, bf16_payload=False)
    try:
        engine.generate([prompt], 2, SamplingParams(temperature=1.0, max_new_tokens=4))
    finally:
        engine.close()
    assert torch.equal(prompt.mm["pixel_values"], original)
    dtype, _, sha = server.records[0].tensor_digests["pixel_values"]
    assert dtype == "float32" and sha == hashlib.sha256(original.numpy().tobytes()).hexdigest()


@pytest.mark.parametrize(
    "bad",
    [
        {"n": 4},  # plain-sglang key: 422 on the server
        {"ignore_eos": True},
        {"max_new_tokens": 0},  # no token budget
    ],
)
def test_sampling_outside_the_contract_never_reaches_an_engine(bad) -> None:
    """Engines take only the one validated sampling type, so these fail at config time."""
    with pytest.raises(ValidationError):
        SamplingParams(temperature=1.0, **bad)


def test_bad_sampling_fails_before_sending(server) -> None:
    engine = engine_for(server)
    try:
        with pytest.raises((ClientValidationError, ValueError)):  # a 500 on the server
            engine.generate(
                [make_prompt("x")], 2, SamplingParams(temperature=1.0, top_k=0, max_new_tokens=4)
            )
    finally:
        engine.close()
    assert server.records == [] and server.admin_log == []


def test_aborted_sample_is_resumed_with_the_remaining_budget(server) -> None:
    prompt = make_prompt("r", seed=5)
    server.faults.abort_finish_next(1, after_tokens=2)
    engine = engine_for(server)
    try:
        (group,) = engine.generate(
            [prompt], 1, SamplingParams(temperature=1.0, max_new_tokens=6, seed=2)
        )
    finally:
        engine.close()
    first, cont = server.records
    assert first.finish_reason == "abort" and len(first.token_ids) == 2
    assert cont.input_ids == prompt.input_ids + first.token_ids
    assert cont.sampling["max_new_tokens"] == 4
    (c,) = group
    assert c.token_ids == first.token_ids + cont.token_ids and len(c.logprobs) == len(c.token_ids)
    assert c.finish_reason != "abort"


def test_failed_rollout_aborts_everything_and_raises(server) -> None:
    server.faults.fail_next(1, status=400)
    engine = engine_for(server)
    try:
        with pytest.raises(SglangOmniEngineError, match="ContractError: /generate: HTTP 400"):
            engine.generate(
                [make_prompt("a"), make_prompt("b")],
                2,
                SamplingParams(temperature=1.0, max_new_tokens=4),
            )
    finally:
        engine.close()
    routes = [(r, p.get("mode")) for r, p in server.admin_log]
    assert ("/pause_generation", "abort") in routes and routes[-1][0] == "/continue_generation"
    assert not server.engine_paused


def test_completions_carry_the_server_weight_version(server) -> None:
    server.call(lambda: server.engine.weight_versions.__setitem__("thinker", "step-7"))
    engine = engine_for(server)
    try:
        (group,) = engine.generate(
            [make_prompt("w")], 2, SamplingParams(temperature=1.0, max_new_tokens=4)
        )
    finally:
        engine.close()
    assert {c.weight_version for c in group} == {"step-7"} and engine.last_weight_versions == {
        "step-7"
    }


def test_preflight_names_the_unreachable_server() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    from omni_grpo.sglang import make_clients
    from omni_rollout_client.retry import RetryPolicy

    cfg = SglangOmniConfig(urls=[f"http://127.0.0.1:{port}"], timeout_s=5)
    clients = make_clients(cfg)
    clients[0].retry = RetryPolicy(max_attempts=2, base_delay_s=0.01)
    engine = SglangOmniEngine(cfg, clients=clients)
    try:
        with pytest.raises(SglangOmniEngineError, match=f"127.0.0.1:{port}"):
            engine.preflight()
    finally:
        engine.close()


def test_sampled_media_markers_are_rerolled_not_kept() -> None:
    marker, eos = 900, VOCAB - 1
    prompt = make_prompt("m", seed=6)

    def marker_once(req: FakeRequest) -> FakeGeneration:
        assert marker in req.stop_token_ids  # the server stops right at a marker
        if len(req.input_ids) == len(prompt.input_ids):  # first segment: a marker after one token
            return FakeGeneration(token_ids=[5, marker], logprobs=[-0.1, -0.2])
        return FakeGeneration(token_ids=[6, 7, eos], logprobs=[-0.3, -0.4, -0.5])

    with FakeOmniServer(vocab_size=VOCAB, generator=marker_once) as server:
        engine = SglangOmniEngine(
            SglangOmniConfig(urls=[server.url]), vocab_size=VOCAB, banned_token_ids=[marker, 901]
        )
        try:
            (group,) = engine.generate(
                [prompt], 2, SamplingParams(temperature=1.0, max_new_tokens=8, seed=3)
            )
        finally:
            engine.close()
        records = server.records
    for c in group:
        assert c.token_ids == [5, 6, 7, eos] and c.logprobs == [-0.1, -0.3, -0.4, -0.5]
        assert c.finish_reason == "stop"
    conts = [r for r in records if len(r.input_ids) > len(prompt.input_ids)]
    assert len(conts) == 2 and all(r.input_ids == prompt.input_ids + [5] for r in conts)
    assert all(r.sampling["max_new_tokens"] == 7 for r in conts)
    assert len({r.sampling["seed"] for r in records}) == 4  # fresh seeds for the rerolls
    assert engine.banned_rerolls == 2


def test_a_sample_that_keeps_sampling_markers_ends_as_abort() -> None:
    marker = 900

    def always_marker(req: FakeRequest) -> FakeGeneration:
        return FakeGeneration(token_ids=[5, marker], logprobs=[-0.1, -0.2])

    with FakeOmniServer(vocab_size=VOCAB, generator=always_marker) as server:
        engine = SglangOmniEngine(
            SglangOmniConfig(urls=[server.url]),
            vocab_size=VOCAB,
            banned_token_ids=[marker],
            max_rerolls=2,
        )
        try:
            (group,) = engine.generate(
                [make_prompt("k")], 1, SamplingParams(temperature=1.0, max_new_tokens=10)
            )
        finally:
            engine.close()
    (c,) = group
    assert c.token_ids == [5, 5, 5] and c.finish_reason == "abort" and marker not in c.token_ids


def test_groups_spread_over_worker_urls_across_calls() -> None:
    with (
        FakeOmniServer(vocab_size=VOCAB, generator=oracle) as a,
        FakeOmniServer(vocab_size=VOCAB, generator=oracle) as b,
    ):
        engine = SglangOmniEngine(SglangOmniConfig(urls=[a.url, b.url]), vocab_size=VOCAB)
        try:
            for step in range(2):  # one prompt per call: the second call goes to the second server
                engine.generate(
                    [make_prompt(f"s{step}")], 2, SamplingParams(temperature=1.0, max_new_tokens=4)
                )
        finally:
            engine.close()
        assert [r.metadata["omni_grpo_uid"] for r in a.records] == ["s0", "s0"]
        assert [r.metadata["omni_grpo_uid"] for r in b.records] == ["s1", "s1"]


def test_checkpoint_placeholder_ids_reach_the_audio_in_video_refusal(server, tmp_path) -> None:
    """A checkpoint whose media ids are not the released Qwen3-Omni ones (the tiny model) is
    still checked: the engine refuses its interleaved audio-in-video prompt before sending."""
    from omni_extract import extract
    from omni_extract.tiny import TinyOmniSpec, make_tiny_omni
    from omni_grpo.config import RolloutConfig
    from omni_grpo.models.sideband import read_sideband
    from omni_grpo.rollout import create_engine
    from omni_grpo.sglang import checkpoint_media_ids
    from omni_rollout_client.payload import QWEN3_OMNI_MEDIA_IDS

    make_tiny_omni(tmp_path / "omni", TinyOmniSpec(with_talker=False))
    extract(tmp_path / "omni", tmp_path / "vl", variant="vl")
    ids = checkpoint_media_ids(tmp_path / "vl")
    assert ids != QWEN3_OMNI_MEDIA_IDS
    video = read_sideband(tmp_path / "vl").id("video_token_id")
    interleaved = [1, ids.vision_start, ids.audio_start, video, ids.audio_pad, ids.vision_end, 2]
    prompt = PromptInputs(sample=Sample(uid="aiv", prompt="p", label="A"), input_ids=interleaved)
    cfg = RolloutConfig(engine="sglang-omni", sglang=SglangOmniConfig(urls=[server.url]))
    engine = create_engine(cfg, vocab_size=VOCAB, media_ids=ids)
    unchecked = create_engine(cfg, vocab_size=None)  # the released ids: blind to this checkpoint
    try:
        assert all(c.media_ids == ids for c in engine.clients)
        with pytest.raises(ClientValidationError, match="0.1.9 server has no audio-in-video"):
            engine.generate([prompt], 2, SamplingParams(max_new_tokens=2))
        assert unchecked.prepare(prompt).input_ids == tuple(interleaved)
    finally:
        engine.close()
        unchecked.close()
    assert server.records == []

"""The server contract ``OmniRolloutClient`` relies on, as named cases runnable against any server.

One list of cases, two servers: ``scripts/check_real_0_1_9.py`` runs it against the REAL
sglang-omni 0.1.9 HTTP layer (its unmodified ``create_app``, ``Client``, ``Coordinator``,
preprocessor, thinker request builder and scheduler admin lifecycle, with only the model faked),
and ``tests/test_contract_cases.py`` runs it against this package's fake server in CI. A case that
passes on one and fails on the other is a place where the fake stopped reproducing the real
server, which is what the fake exists to do.

A case gets a fresh server built from its ``ServerOptions`` and drives it through the client (and,
where the contract is about the server itself, through raw HTTP). The server is reached only
through ``ServerUnderTest``: the few levers a case needs (a slow or failing admin call, start-up,
what the engine executed) that each backend implements its own way.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from ..client import OmniRolloutClient, Timeouts
from ..errors import (
    ActiveRequestsError,
    AdminAuthError,
    ClientValidationError,
    ConflictError,
    ContractError,
    EnginePausedError,
    GenerationAbortedError,
    NotSupportedError,
    TransientServerError,
    WeightUpdateError,
)
from ..payload import QWEN3_OMNI_MEDIA_IDS
from ..retry import RetryPolicy

FAST = RetryPolicy(max_attempts=4, base_delay_s=0.01, max_delay_s=0.05)
ADMIN_KEY = "contract-admin-key"


@dataclass(frozen=True)
class ServerOptions:
    """How a case wants its server. ``long``: every generation runs to its token budget (no
    early EOS), so it can be paused, aborted or cancelled while it runs."""

    speech: bool = False
    admin_api_key: str | None = None
    max_in_flight: int | None = None
    token_delay_s: float = 0.0
    long: bool = False
    vocab_size: int = 4096
    max_seq_len: int = 4096
    starting: bool = False  # /health answers 503 "starting" until set_ready()


@dataclass
class Record:
    """One /generate the engine executed, as the engine saw it."""

    input_ids: list[int]
    sampling: dict[str, Any]
    tensors: dict[str, tuple[str, list[int], str]]  # name -> (dtype, shape, sha256 of the bytes)
    outcome: str  # running | ok | aborted
    token_ids: list[int] = field(default_factory=list)
    weight_version: str | None = None


class ServerUnderTest:
    """The levers a case pulls; each backend implements them on its own server."""

    url: str
    options: ServerOptions
    eos_token_id: int

    def slow_admin(self, route: str, seconds: float) -> None:
        """The next admin call of ``route`` takes ``seconds`` on the thinker's scheduler (the
        coordinator still waits only the request's ``timeout_s``)."""
        raise NotImplementedError

    def fail_admin(self, route: str, count: int) -> None:
        """The next ``count`` calls of ``route`` fail with an uncaught server error (a 500) before
        reaching the stages."""
        raise NotImplementedError

    def set_ready(self) -> None:
        """End start-up: /health answers 200 from now on."""
        raise NotImplementedError

    def active_count(self) -> int:
        raise NotImplementedError

    def records(self) -> list[Record]:
        raise NotImplementedError

    def stage_version(self, stage: str) -> str | None:
        raise NotImplementedError

    def engine_paused(self) -> bool:
        raise NotImplementedError

    def weights_dir(self) -> str:
        """A directory a disk update loads successfully."""
        raise NotImplementedError


ServerFactory = Callable[[ServerOptions], contextlib.AbstractContextManager[ServerUnderTest]]
CaseFn = Callable[[ServerUnderTest], Awaitable[str | None]]


@dataclass(frozen=True)
class Case:
    name: str
    fn: CaseFn
    options: ServerOptions


CASES: list[Case] = []


def case(name: str, **options: Any) -> Callable[[CaseFn], CaseFn]:
    def register(fn: CaseFn) -> CaseFn:
        CASES.append(Case(name, fn, ServerOptions(**options)))
        return fn

    return register


class CaseFailed(AssertionError):
    pass


def check(cond: bool, what: str) -> None:
    if not cond:
        raise CaseFailed(what)


async def until(predicate: Callable[[], bool], what: str, limit_s: float = 10.0) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise CaseFailed(f"never happened: {what}")


@contextlib.asynccontextmanager
async def expect(exc_type: type[BaseException], match: str = "") -> AsyncIterator[list[Any]]:
    """``async with expect(ContractError) as got:`` - the block must raise ``exc_type``."""
    got: list[Any] = []
    try:
        yield got
    except exc_type as exc:
        if match and match not in str(exc):
            raise CaseFailed(f"{type(exc).__name__} without {match!r}: {exc}") from exc
        got.append(exc)
        return
    except Exception as exc:
        raise CaseFailed(f"expected {exc_type.__name__}, got {type(exc).__name__}: {exc}") from exc
    raise CaseFailed(f"expected {exc_type.__name__}, nothing was raised")


def client(s: ServerUnderTest, **kwargs: Any) -> OmniRolloutClient:
    kwargs.setdefault("retry", FAST)
    kwargs.setdefault("vocab_size", None)
    return OmniRolloutClient(s.url, **kwargs)


def raw(s: ServerUnderTest, **kwargs: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=s.url, timeout=kwargs.pop("timeout", 30), **kwargs)


def _sha(raw_bytes: bytes) -> str:
    return hashlib.sha256(raw_bytes).hexdigest()


SP = {"max_new_tokens": 8, "temperature": 1.0}
GREEDY = {"max_new_tokens": 8, "temperature": 0.0}


async def sampling_refused(s: ServerUnderTest, bad: dict[str, Any], match: str) -> httpx.Response:
    """The client refuses ``SP`` with ``bad`` before sending (a ``ClientValidationError`` naming
    ``match``); the server's own answer to the same request sent raw, for the case to check.
    Refusing locally is the point: some of these the server answers with a 500, which a client
    that sent them would retry forever."""
    sampling = {**SP, **bad}
    async with client(s) as c, expect(ClientValidationError, match):
        await c.generate([1], sampling)
    async with raw(s) as http:
        return await http.post("/generate", json={"input_ids": [1], "sampling_params": sampling})


# ===================================================================== /generate: the response


@case("generate: 2-element logprob pairs, one per token, EOS included")
async def _(s: ServerUnderTest) -> str:
    async with client(s) as c:
        r = await c.generate([1, 2, 3], {"max_new_tokens": 64, "temperature": 1.0})
    check(len(r.token_ids) == len(r.logprobs) == r.completion_tokens >= 1, "len mismatch")
    check(r.finish_reason == "stop" and r.token_ids[-1] == s.eos_token_id, f"{r}")
    check(all(lp <= 0 for lp in r.logprobs), "logprobs > 0")
    return f"{r.completion_tokens} tokens"


@case("generate: prompt_tokens is len(input_ids), cached_tokens 0")
async def _(s: ServerUnderTest) -> None:
    async with client(s) as c:
        r = await c.generate(list(range(1, 18)), SP)
    check(r.prompt_tokens == 17 and r.cached_tokens == 0, f"{r.prompt_tokens} {r.cached_tokens}")


@case("generate: budget reached -> finish_reason length", long=True)
async def _(s: ServerUnderTest) -> None:
    async with client(s) as c:
        r = await c.generate([1, 2], {"max_new_tokens": 3, "temperature": 1.0})
    check(r.finish_reason == "length" and len(r.token_ids) == 3, f"{r.finish_reason} {r.token_ids}")


@case("generate: weight_version 'default' before any update")
async def _(s: ServerUnderTest) -> None:
    async with client(s) as c:
        r = await c.generate([1, 2], SP)
    check(r.weight_version == "default", repr(r.weight_version))


@case("generate: metadata echoed as request_metadata")
async def _(s: ServerUnderTest) -> None:
    async with client(s) as c:
        r = await c.generate([1, 2], SP, metadata={"uid": "p-7", "sample": 3})
    check(r.metadata == {"uid": "p-7", "sample": 3}, repr(r.metadata))


@case("generate: text decoded without the EOS token")
async def _(s: ServerUnderTest) -> None:
    async with client(s) as c:
        r = await c.generate([5, 6], {"max_new_tokens": 64, "temperature": 1.0})
    check(isinstance(r.text, str) and str(s.eos_token_id) not in r.text.split(), repr(r.text))


# ================================================================ /generate: sampling parameters


@case("sampling: max_new_tokens is required (never the server's 2048)")
async def _(s: ServerUnderTest) -> None:
    async with client(s) as c, expect(ClientValidationError, "max_new_tokens"):
        await c.generate([1, 2], {"temperature": 1.0})
    check(s.records() == [], "a request reached the server")


@case("sampling: explicit max_new_tokens reaches the engine")
async def _(s: ServerUnderTest) -> None:
    async with client(s) as c:
        await c.generate([1, 2], {"max_new_tokens": 5, "temperature": 1.0})
    check(s.records()[-1].sampling["max_new_tokens"] == 5, f"{s.records()[-1].sampling}")


@case("sampling: max_tokens alias folded into max_new_tokens")
async def _(s: ServerUnderTest) -> None:
    async with client(s) as c:
        r = await c.generate([1, 2], {"max_tokens": 2, "temperature": 1.0})
    check(r.completion_tokens <= 2 and s.records()[-1].sampling["max_new_tokens"] == 2, "alias")


@case("sampling: temperature always explicit (an omitted one is greedy on 0.1.9)")
async def _(s: ServerUnderTest) -> None:
    async with client(s) as c:
        await c.generate([1, 2], {"max_new_tokens": 4})
    check(s.records()[-1].sampling["temperature"] == 1.0, f"{s.records()[-1].sampling}")


@case("sampling: an omitted temperature is greedy on the server (raw)")
async def _(s: ServerUnderTest) -> None:
    async with raw(s) as http:
        r = await http.post(
            "/generate", json={"input_ids": [1], "sampling_params": {"max_new_tokens": 2}}
        )
    check(r.status_code == 200 and s.records()[-1].sampling["temperature"] == 0.0, r.text[:200])


@case("sampling: same seed, same sample; other seed, other sample")
async def _(s: ServerUnderTest) -> None:
    async with client(s) as c:
        sp = {"max_new_tokens": 16, "temperature": 1.0}
        a = await c.generate([1, 2, 3], {**sp, "seed": 11})
        b = await c.generate([1, 2, 3], {**sp, "seed": 11})
        d = await c.generate([1, 2, 3], {**sp, "seed": 12})
    check(a.token_ids == b.token_ids and a.token_ids != d.token_ids, "seed")


@case("sampling: greedy is deterministic")
async def _(s: ServerUnderTest) -> None:
    async with client(s) as c:
        a = await c.generate([4, 5], GREEDY)
        b = await c.generate([4, 5], GREEDY)
    check(a.token_ids == b.token_ids, "greedy differs")


@case("sampling: stop_token_ids reach the engine and end the sample with that token")
async def _(s: ServerUnderTest) -> None:
    async with client(s) as c:
        first = await c.generate([9, 9], {"max_new_tokens": 64, "temperature": 0.0})
        stop = first.token_ids[0]
        r = await c.generate(
            [9, 9], {"max_new_tokens": 64, "temperature": 0.0, "stop_token_ids": [stop]}
        )
    check(r.token_ids == [stop] and r.finish_reason == "stop", f"{r.token_ids} {r.finish_reason}")


@case("sampling: top_p/top_k/min_p accepted")
async def _(s: ServerUnderTest) -> None:
    async with client(s) as c:
        r = await c.generate([1], {**SP, "top_p": 0.9, "top_k": 20, "min_p": 0.05})
    check(r.completion_tokens >= 1, "no tokens")


@case("sampling: plain-sglang detokenisation keys dropped, request succeeds")
async def _(s: ServerUnderTest) -> None:
    async with client(s) as c:
        r = await c.generate([1], {**SP, "skip_special_tokens": True, "no_stop_trim": False})
    check(r.completion_tokens >= 1, "no tokens")


@case("sampling: an unknown key is refused locally (server: 422 extra_forbidden)")
async def _(s: ServerUnderTest) -> None:
    r = await sampling_refused(s, {"ignore_eos": True}, "ignore_eos")
    check(r.status_code == 422 and r.json()["detail"][0]["type"] == "extra_forbidden", r.text[:200])


@case("sampling: top_k 0 refused locally (server: 500, retried forever by a naive client)")
async def _(s: ServerUnderTest) -> None:
    r = await sampling_refused(s, {"top_k": 0}, "top_k")
    check(r.status_code == 500, f"{r.status_code}")


@case("sampling: repetition_penalty pinned to 1 (server: > 2 is a 500)")
async def _(s: ServerUnderTest) -> None:
    async with client(s) as c, expect(ClientValidationError, "repetition_penalty"):
        await c.generate([1], {**SP, "repetition_penalty": 1.1})
    async with raw(s) as http:
        r = await http.post(
            "/generate", json={"input_ids": [1], "sampling_params": {**SP, "repetition_penalty": 3}}
        )
    check(r.status_code == 500, f"{r.status_code}")


@case("sampling: more than 32 stop strings refused locally (server: 400)")
async def _(s: ServerUnderTest) -> None:
    r = await sampling_refused(s, {"stop": [f"s{i}" for i in range(33)]}, "at most 32")
    check(r.status_code == 400, f"{r.status_code} {r.text[:120]}")


@case("sampling: stop that is not str/list refused locally (server: 422)")
async def _(s: ServerUnderTest) -> None:
    r = await sampling_refused(s, {"stop": 12}, "stop")
    check(r.status_code == 422, f"{r.status_code}")


@case("sampling: seed with n > 1 refused (n identical samples); seeds=[...] give n distinct")
async def _(s: ServerUnderTest) -> None:
    async with client(s) as c:
        p = c.prepare([1, 2, 3])
        async with expect(ClientValidationError, "seed"):
            await c.generate_group(p, 3, {**SP, "seed": 1})
        group = await c.generate_group(
            p, 3, {"max_new_tokens": 16, "temperature": 1.0}, seeds=[1, 2, 3]
        )
    check(len({tuple(r.token_ids) for r in group}) == 3, "samples not distinct")


@case("generate_group: n samples of one encoded prompt, in order, none lost")
async def _(s: ServerUnderTest) -> str:
    async with client(s) as c:
        group = await c.generate_group(c.prepare([3, 4, 5]), 6, SP)
    check(len(group) == 6 and len(s.records()) == 6, f"{len(group)} {len(s.records())}")
    return "6/6"


# ===================================================================== /generate: input checks


@case("input: token id >= vocab refused (locally with vocab_size; server: 400 out-of-vocabulary)")
async def _(s: ServerUnderTest) -> None:
    vocab = s.options.vocab_size
    async with client(s, vocab_size=vocab) as c, expect(ClientValidationError):
        await c.generate([1, vocab], SP)
    async with client(s) as c, expect(ContractError) as got:
        await c.generate([1, vocab], SP)
    check(got[0].status_code == 400, f"{got[0].status_code}")


@case("input: empty / negative / >= 2**63 ids refused locally (server: 422)")
async def _(s: ServerUnderTest) -> None:
    async with client(s) as c:
        for bad in ([], [-1], [1 << 63]):
            async with expect(ClientValidationError):
                await c.generate(bad, SP)
    async with raw(s) as http:
        codes = [
            (
                await http.post("/generate", json={"input_ids": bad, "sampling_params": SP})
            ).status_code
            for bad in ([], [-1], [1 << 63])
        ]
    check(codes == [422, 422, 422], f"{codes}")


@case("input: context too long -> 400 ContractError, not retried")
async def _(s: ServerUnderTest) -> None:
    n = s.options.max_seq_len
    async with client(s) as c, expect(ContractError, "maximum context length") as got:
        await c.generate([1] * (n - 4), {**SP, "max_new_tokens": 8})
    check(got[0].status_code == 400 and s.records() == [], "retried or executed")


@case("input: exactly one of input_ids/prompt/messages (server: 400)")
async def _(s: ServerUnderTest) -> None:
    async with raw(s) as http:
        none = await http.post("/generate", json={"sampling_params": SP})
        both = await http.post(
            "/generate", json={"input_ids": [1], "prompt": "x", "sampling_params": SP}
        )
    check(
        none.status_code == 400 and both.status_code == 400,
        f"{none.status_code} {both.status_code}",
    )


@case("input: stream=true is a 400 on the Qwen3-Omni server; the client never streams")
async def _(s: ServerUnderTest) -> None:
    async with raw(s) as http:
        r = await http.post(
            "/generate", json={"input_ids": [1], "sampling_params": SP, "stream": True}
        )
    check(r.status_code == 400 and "stream" in r.text, r.text[:200])
    async with client(s) as c:
        await c.generate([1], SP)
    check(s.records()[-1].outcome == "ok", "client request failed")


@case("input: unknown top-level keys are ignored by the server (rid, image_data)")
async def _(s: ServerUnderTest) -> None:
    async with raw(s) as http:
        r = await http.post(
            "/generate",
            json={"input_ids": [1], "sampling_params": SP, "rid": "x", "image_data": []},
        )
    check(r.status_code == 200, f"{r.status_code}")


@case("input: return_omni_rollout=true is a 501 (Qwen3-Omni never produces it)")
async def _(s: ServerUnderTest) -> None:
    async with raw(s) as http:
        r = await http.post(
            "/generate", json={"input_ids": [1], "sampling_params": SP, "return_omni_rollout": True}
        )
    check(r.status_code == 501, f"{r.status_code}")


@case("input: metadata keys the server reads as media/sessions refused locally")
async def _(s: ServerUnderTest) -> None:
    async with client(s) as c:
        for key in ("images", "videos", "audios", "use_audio_in_video", "omni_session"):
            async with expect(ClientValidationError, key):
                await c.generate([1], SP, metadata={key: 1})
    async with raw(s) as http:
        r = await http.post(
            "/generate",
            json={"input_ids": [1], "sampling_params": SP, "metadata": {"omni_session": {}}},
        )
    check(r.status_code == 400, f"omni_session: {r.status_code}")


# ============================================================ /generate: multimodal payloads


async def post_bundle(s: ServerUnderTest, bundle: dict[str, Any]) -> httpx.Response:
    """``bundle`` sent raw as a request's ``multimodal_train_inputs``: what the server makes of a
    bundle the client would never send."""
    async with raw(s) as http:
        return await http.post(
            "/generate",
            json={"input_ids": [1], "sampling_params": SP, "multimodal_train_inputs": bundle},
        )


def _image(rng: np.random.Generator) -> dict[str, Any]:
    grid = np.array([[1, 4, 4]], dtype=np.int64)
    return {
        "pixel_values": rng.standard_normal((16, 1536), dtype=np.float32),
        "image_grid_thw": grid,
    }


def _audio(rng: np.random.Generator) -> dict[str, Any]:
    mask = np.ones((1, 40), dtype=np.int64)
    mask[0, 30:] = 0
    return {
        "input_features": rng.standard_normal((1, 128, 40), dtype=np.float32),
        "feature_attention_mask": mask,
    }


def _video(rng: np.random.Generator) -> dict[str, Any]:
    return {
        "pixel_values_videos": rng.standard_normal((32, 1536), dtype=np.float32),
        "video_grid_thw": np.array([[2, 4, 4]], dtype=np.int64),
        "video_second_per_grid": np.array([1.0], dtype=np.float32),
    }


async def _mm_roundtrip(s: ServerUnderTest, mm: dict[str, Any], *, bf16: bool) -> str:
    async with client(s) as c:
        p = c.prepare([1, 2, 3, 4], mm, bf16=bf16)
        r = await c.generate(p, SP)
    seen = s.records()[-1].tensors
    want = {
        name: (enc.dtype, list(enc.shape), _sha(np.ascontiguousarray(enc.raw).tobytes()))
        for name, enc in p.tensors.items()
    }
    check(seen == want, f"server decoded {seen}, sent {want}")
    check(r.prompt_tokens == 4, "prompt_tokens")
    return ", ".join(f"{k}:{v[0]}{v[1]}" for k, v in sorted(seen.items()))


@case("multimodal: image bundle decoded byte-exact by the server")
async def _(s: ServerUnderTest) -> str:
    return await _mm_roundtrip(s, _image(np.random.default_rng(0)), bf16=False)


@case("multimodal: image bundle as bfloat16 decoded byte-exact")
async def _(s: ServerUnderTest) -> str:
    return await _mm_roundtrip(s, _image(np.random.default_rng(1)), bf16=True)


@case("multimodal: audio bundle (audio_feature_lengths derived) decoded byte-exact")
async def _(s: ServerUnderTest) -> str:
    detail = await _mm_roundtrip(s, _audio(np.random.default_rng(2)), bf16=True)
    check("audio_feature_lengths" in s.records()[-1].tensors, "no audio_feature_lengths")
    return detail


@case("multimodal: video bundle decoded byte-exact")
async def _(s: ServerUnderTest) -> str:
    return await _mm_roundtrip(s, _video(np.random.default_rng(3)), bf16=True)


@case("multimodal: image + audio + video in one bundle")
async def _(s: ServerUnderTest) -> str:
    rng = np.random.default_rng(4)
    return await _mm_roundtrip(s, {**_image(rng), **_audio(rng), **_video(rng)}, bf16=True)


@case("multimodal: unknown tensor name refused locally (server: 400)")
async def _(s: ServerUnderTest) -> None:
    async with client(s) as c, expect(ClientValidationError, "unknown names"):
        c.prepare([1], {"pixel_values": np.zeros((4, 8), np.float32), "foo": np.zeros(1)})
    bundle = {
        "version": 1,
        "tensors": {"foo": {"dtype": "float32", "shape": [1], "data": "AAAAAA=="}},
    }
    r = await post_bundle(s, bundle)
    check(
        r.status_code == 400 and "unknown multimodal_train_inputs tensors" in r.text, r.text[:200]
    )


@case("multimodal: grid without pixels refused locally (server: 400)")
async def _(s: ServerUnderTest) -> None:
    async with client(s) as c, expect(ClientValidationError, "without"):
        c.prepare([1], {"image_grid_thw": np.array([[1, 2, 2]])})
    bundle = {
        "version": 1,
        "tensors": {
            "image_grid_thw": {
                "dtype": "int64",
                "shape": [1, 3],
                "data": "AQAAAAAAAAACAAAAAAAAAAIAAAAAAAAA",
            }
        },
    }
    r = await post_bundle(s, bundle)
    check(r.status_code == 400, f"{r.status_code} {r.text[:160]}")


@case("multimodal: 1-D feature_attention_mask / zero-element tensor refused locally (server: 500)")
async def _(s: ServerUnderTest) -> None:
    async with client(s) as c:
        async with expect(ClientValidationError, "2-D"):
            c.prepare(
                [1],
                {
                    "input_features": np.zeros((1, 128, 4), np.float32),
                    "feature_attention_mask": np.ones(4),
                },
            )
        async with expect(ClientValidationError, "zero-element"):
            c.prepare(
                [1],
                {
                    "pixel_values": np.zeros((0, 1536), np.float32),
                    "image_grid_thw": np.zeros((0, 3)),
                },
            )
    bundle = {
        "version": 1,
        "tensors": {
            "input_features": {"dtype": "float32", "shape": [1, 1, 1], "data": "AAAAAA=="},
            "feature_attention_mask": {"dtype": "int64", "shape": [1], "data": "AQAAAAAAAAA="},
        },
    }
    r = await post_bundle(s, bundle)
    check(r.status_code == 500, f"{r.status_code} {r.text[:160]}")


@case("multimodal: bad bundle encoding (byte length, version 2) is a 422")
async def _(s: ServerUnderTest) -> None:
    short = {
        "version": 1,
        "tensors": {"pixel_values": {"dtype": "float32", "shape": [1, 4], "data": "AAAAAA=="}},
    }
    v2 = {
        "version": 2,
        "tensors": {"pixel_values": {"dtype": "float32", "shape": [1], "data": "AAAAAA=="}},
    }
    codes = [(await post_bundle(s, b)).status_code for b in (short, v2)]
    check(codes == [422, 422], f"{codes}")


@case("multimodal: interleaved audio-in-video refused before sending (0.1.9 has no field)")
async def _(s: ServerUnderTest) -> None:
    m = QWEN3_OMNI_MEDIA_IDS
    ids = [1, m.vision_start, m.audio_start, 151656, m.audio_pad, m.vision_end]
    async with client(s) as c:
        async with expect(ClientValidationError, "audio-in-video"):
            await c.generate(ids, SP)
        async with expect(ClientValidationError, "use_audio_in_video"):
            c.prepare([1, 2], use_audio_in_video=True)
    check(s.records() == [], "sent")


# ================================================================= /generate: errors, retries


@case("errors: a stage's exception is a JSON 500 whose detail is its message")
async def _(s: ServerUnderTest) -> str:
    async with raw(s) as http:
        r = await http.post(
            "/generate", json={"input_ids": [1], "sampling_params": {**SP, "top_k": -5}}
        )
    check(
        r.status_code == 500 and "top_k must be -1 (disable) or at least 1" in r.json()["detail"],
        r.text[:200],
    )
    return r.json()["detail"]


@case("errors: out-of-vocabulary 400 names the id and its position")
async def _(s: ServerUnderTest) -> str:
    vocab = s.options.vocab_size
    async with raw(s) as http:
        r = await http.post(
            "/generate", json={"input_ids": [1, 2, vocab + 3], "sampling_params": SP}
        )
    detail = r.json()["detail"]
    check(r.status_code == 400 and f"token id {vocab + 3} at position 2" in detail, r.text[:200])
    return detail


@case("errors: a prompt alone over the context limit says so")
async def _(s: ServerUnderTest) -> str:
    n = s.options.max_seq_len
    async with raw(s) as http:
        r = await http.post("/generate", json={"input_ids": [1] * n, "sampling_params": SP})
    detail = r.json()["detail"]
    check(r.status_code == 400 and "longer than the model's context length" in detail, r.text[:200])
    return detail


@case("errors: 4xx never retried (one request reaches the server)")
async def _(s: ServerUnderTest) -> None:
    async with client(s) as c, expect(ContractError) as got:
        await c.generate([1] * s.options.max_seq_len, SP)
    check(got[0].status_code == 400, f"{got[0].status_code}")


@case(
    "errors: queue full (503) retried until a slot frees",
    max_in_flight=2,
    token_delay_s=0.02,
    long=True,
)
async def _(s: ServerUnderTest) -> str:
    async with client(
        s, retry=RetryPolicy(max_attempts=60, base_delay_s=0.05, max_delay_s=0.1)
    ) as c:
        group = await asyncio.gather(
            *(c.generate([i + 1], {"max_new_tokens": 5, "temperature": 1.0}) for i in range(4))
        )
    check(len(group) == 4 and all(r.completion_tokens == 5 for r in group), "lost")
    retried = sum(r.attempts > 1 for r in group)
    check(retried >= 1, "no 503 seen")
    return f"{retried} retried"


@case(
    "errors: a 503 with retries exhausted is a typed TransientServerError",
    max_in_flight=1,
    token_delay_s=0.05,
    long=True,
)
async def _(s: ServerUnderTest) -> None:
    async with client(
        s, retry=RetryPolicy(max_attempts=2, base_delay_s=0.01, max_delay_s=0.01)
    ) as c:
        blocker = asyncio.ensure_future(c.generate([1], {"max_new_tokens": 40, "temperature": 1.0}))
        await until(lambda: s.active_count() == 1, "blocker running")
        async with expect(TransientServerError) as got:
            await c.generate([2], SP)
        await blocker
    check(
        got[0].status_code == 503 and got[0].attempts == 2,
        f"{got[0].status_code} {got[0].attempts}",
    )


@case(
    "timeouts: a timed-out /generate is aborted on the server, the retry answers",
    token_delay_s=0.02,
    long=True,
)
async def _(s: ServerUnderTest) -> None:
    async with client(s, timeouts=Timeouts(generate=0.4)) as c:
        async with expect(TransientServerError) as got:
            await c.generate([1, 2], {"max_new_tokens": 200, "temperature": 1.0})
        await until(lambda: c.orphans_aborted >= 1, "orphans aborted")
        check(got[0].attempts == FAST.max_attempts, f"{got[0].attempts}")
        await until(lambda: s.active_count() == 0, "server idle")
        check(
            all(r.outcome == "aborted" for r in s.records()), f"{[r.outcome for r in s.records()]}"
        )
        ok = await c.generate([1, 2], {"max_new_tokens": 3, "temperature": 1.0})
    check(ok.completion_tokens == 3 and not s.engine_paused(), "not serving after the abort")


@case(
    "cancel: a cancelled group is aborted on the server (not run to completion)",
    token_delay_s=0.02,
    long=True,
)
async def _(s: ServerUnderTest) -> None:
    async with client(s) as c:
        task = asyncio.ensure_future(
            c.generate_group(c.prepare([1, 2, 3]), 4, {"max_new_tokens": 400, "temperature": 1.0})
        )
        await until(lambda: s.active_count() == 4, "4 running")
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await until(lambda: c.orphans_aborted == 4, "client aborted the 4")
        await until(lambda: s.active_count() == 0, "server idle")
        after = await c.generate([1], {"max_new_tokens": 2, "temperature": 1.0})
    outcomes = [r.outcome for r in s.records()[:4]]
    check(outcomes == ["aborted"] * 4 and after.completion_tokens == 2, f"{outcomes}")


@case(
    "cancel: the orphan abort waits for this client's in-flight requests",
    token_delay_s=0.02,
    long=True,
)
async def _(s: ServerUnderTest) -> str:
    async with client(s) as c:
        wanted = asyncio.ensure_future(c.generate([7], {"max_new_tokens": 30, "temperature": 1.0}))
        doomed = asyncio.ensure_future(c.generate([8], {"max_new_tokens": 400, "temperature": 1.0}))
        await until(lambda: s.active_count() == 2, "2 running")
        doomed.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await doomed
        kept = await wanted  # still needed: the abort must not drop it
        await until(lambda: c.orphans_aborted == 1, "orphan aborted after")
    check(
        kept.completion_tokens == 30 and kept.finish_reason == "length", f"{kept.completion_tokens}"
    )
    return "wanted sample finished, orphan aborted afterwards"


@case(
    "cancel: orphans are left running while the server also runs another caller's request",
    token_delay_s=0.02,
    long=True,
)
async def _(s: ServerUnderTest) -> str:
    async with client(s) as c, raw(s) as http:
        theirs = asyncio.ensure_future(
            http.post(
                "/generate",
                json={
                    "input_ids": [5],
                    "sampling_params": {"max_new_tokens": 40, "temperature": 1.0},
                },
            )
        )
        mine = asyncio.ensure_future(c.generate([6], {"max_new_tokens": 60, "temperature": 1.0}))
        await until(lambda: s.active_count() == 2, "2 running")
        mine.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await mine
        await until(lambda: c.orphans_spared == 1, "orphan spared")
        r = await theirs
    check(r.status_code == 200 and c.orphans_aborted == 0, f"{r.status_code} {r.text[:80]}")
    return "the other caller's sample finished"


@case("cancel: orphans that finished meanwhile cost no pause", token_delay_s=0.02, long=True)
async def _(s: ServerUnderTest) -> None:
    async with client(s) as c:
        wanted = asyncio.ensure_future(c.generate([7], {"max_new_tokens": 40, "temperature": 1.0}))
        doomed = asyncio.ensure_future(c.generate([8], {"max_new_tokens": 5, "temperature": 1.0}))
        await until(lambda: s.active_count() == 2, "2 running")
        doomed.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await doomed
        await wanted  # the orphan ended on the server long before
        await until(lambda: c.orphans_finished == 1, "orphan found finished")
    check(c.orphans_aborted == 0 and [r.outcome for r in s.records()] == ["ok", "ok"], "aborted")


@case(
    "abort: pause(abort) through this client fails its in-flight request, not retried",
    token_delay_s=0.02,
    long=True,
)
async def _(s: ServerUnderTest) -> str:
    async with client(s) as c:
        task = asyncio.ensure_future(c.generate([1], {"max_new_tokens": 400, "temperature": 1.0}))
        await until(lambda: s.active_count() == 1, "running")
        await c.pause_generation("abort")
        async with expect(GenerationAbortedError) as got:
            await task
        await c.continue_generation()
    check(len(s.records()) == 1, f"{len(s.records())} executions (retried?)")
    return str(got[0])[:80]


@case(
    "abort: a request dropped by someone else's pause(abort) is retried",
    token_delay_s=0.02,
    long=True,
)
async def _(s: ServerUnderTest) -> None:
    async with client(s) as c, raw(s) as http:
        task = asyncio.ensure_future(c.generate([1], {"max_new_tokens": 30, "temperature": 1.0}))
        await until(lambda: s.active_count() == 1, "running")
        r = await http.post("/pause_generation", json={"mode": "abort", "stages": ["thinker"]})
        check(r.status_code == 200, r.text[:200])
        await http.post("/continue_generation", json={"stages": ["thinker"]})
        result = await task
    check(result.completion_tokens == 30 and result.attempts == 2, f"{result.attempts}")


@case(
    "abort: a dropped /generate is a plain-text 500 (no partial sample)",
    token_delay_s=0.02,
    long=True,
)
async def _(s: ServerUnderTest) -> None:
    async with raw(s) as http:
        task = asyncio.ensure_future(
            http.post(
                "/generate",
                json={
                    "input_ids": [1],
                    "sampling_params": {"max_new_tokens": 400, "temperature": 1.0},
                },
            )
        )
        await until(lambda: s.active_count() == 1, "running")
        await http.post("/pause_generation", json={"mode": "abort", "stages": ["thinker"]})
        r = await task
        await http.post("/continue_generation", json={"stages": ["thinker"]})
    check(
        r.status_code == 500 and "Internal Server Error" in r.text, f"{r.status_code} {r.text[:80]}"
    )


@case(
    "abort: update with abort_all_requests drops in-flight requests", token_delay_s=0.02, long=True
)
async def _(s: ServerUnderTest) -> None:
    async with client(s) as c:
        task = asyncio.ensure_future(c.generate([1], {"max_new_tokens": 400, "temperature": 1.0}))
        await until(lambda: s.active_count() == 1, "running")
        await c.update_weights_from_disk(
            s.weights_dir(), weight_version="va", abort_all_requests=True
        )
        async with expect(GenerationAbortedError):
            await task
    check(s.stage_version("thinker") == "va" and not s.engine_paused(), "update/pause state")


@case("abort: no per-request abort route on 0.1.9 (/abort_request 404)")
async def _(s: ServerUnderTest) -> None:
    async with raw(s) as http:
        r = await http.post("/abort_request", json={"rid": "x"})
    check(r.status_code == 404, f"{r.status_code}")


# ================================================================= pause / continue


@case(
    "pause: retract, update, continue: the request finishes on the new version",
    token_delay_s=0.02,
    long=True,
)
async def _(s: ServerUnderTest) -> None:
    async with client(s) as c:
        task = asyncio.ensure_future(c.generate([1], {"max_new_tokens": 40, "temperature": 1.0}))
        await until(lambda: s.active_count() == 1, "running")
        reply = await c.pause_generation("retract")
        check(reply.stage_data("thinker")[0]["num_paused_requests"] == 1, f"{reply.body}")
        await c.update_weights_from_disk(s.weights_dir(), weight_version="v-retract")
        await c.continue_generation()
        r = await task
    check(r.weight_version == "v-retract" and r.completion_tokens == 40, f"{r.weight_version}")


@case(
    "pause: update while requests run (not retract-paused) -> ActiveRequestsError",
    token_delay_s=0.02,
    long=True,
)
async def _(s: ServerUnderTest) -> str:
    async with client(s) as c:
        task = asyncio.ensure_future(c.generate([1], {"max_new_tokens": 40, "temperature": 1.0}))
        await until(lambda: s.active_count() == 1, "running")
        async with expect(ActiveRequestsError) as got:
            await c.update_weights_from_disk(s.weights_dir(), weight_version="nope")
        r = await task
    check(len(got[0].active_request_ids) == 1 and r.weight_version == "default", "state")
    check(not s.engine_paused(), "left paused")
    return "1 active id reported"


@case(
    "pause: in_place pause still refuses an update with active requests",
    token_delay_s=0.02,
    long=True,
)
async def _(s: ServerUnderTest) -> None:
    async with client(s) as c:
        task = asyncio.ensure_future(c.generate([1], {"max_new_tokens": 40, "temperature": 1.0}))
        await until(lambda: s.active_count() == 1, "running")
        await c.pause_generation("in_place")
        async with expect(ActiveRequestsError):
            await c.update_weights_from_disk(s.weights_dir(), weight_version="nope")
        check(s.engine_paused(), "in_place pause lost")
        await c.continue_generation()
        r = await task
    check(r.completion_tokens == 40, "request lost")


@case("pause: in_place holds new requests until continue", token_delay_s=0.01)
async def _(s: ServerUnderTest) -> None:
    async with client(s) as c:
        await c.pause_generation("in_place")
        task = asyncio.ensure_future(c.generate([1], SP))
        await asyncio.sleep(0.3)
        check(not task.done(), "generated while paused")
        await c.continue_generation()
        r = await task
    check(r.completion_tokens >= 1, "no tokens")


@case("pause: reply data and engine state (pause -> paused, continue -> running)")
async def _(s: ServerUnderTest) -> None:
    async with client(s) as c:
        p = await c.pause_generation("retract")
        d = p.stage_data("thinker")[0]
        check(d["mode"] == "retract" and d["engine_paused"] is True and s.engine_paused(), f"{d}")
        q = await c.continue_generation()
        check(
            q.stage_data("thinker")[0]["engine_paused"] is False and not s.engine_paused(),
            "continue",
        )


@case("pause: invalid mode refused locally (server: 400 stage error)")
async def _(s: ServerUnderTest) -> None:
    async with client(s) as c, expect(ClientValidationError, "mode"):
        await c.pause_generation("hold")
    async with raw(s) as http:
        r = await http.post("/pause_generation", json={"mode": "hold", "stages": ["thinker"]})
    check(r.status_code == 400 and "invalid pause mode" in r.text, r.text[:200])


@case("pause: scoped to the thinker, with the server-side timeout_s")
async def _(s: ServerUnderTest) -> None:
    async with client(s) as c:
        reply = await c.pause_generation("retract")
        await c.continue_generation()
    stages = [r.stage for r in reply.stages]
    check(stages == ["thinker"], f"{stages}")


# ================================================================= model_info, health, ready


@case("model_info: scoped POST (stages + timeout_s) answers version, path, TP size")
async def _(s: ServerUnderTest) -> None:
    async with client(s) as c:
        info = await c.model_info()
    check(
        info.weight_version == "default" and info.thinker_tp_sizes == (1,) and info.model_path,
        f"{info}",
    )


@case("model_info: speech pipeline, thinker-only update: unscoped GET 409, scoped OK", speech=True)
async def _(s: ServerUnderTest) -> str:
    async with client(s) as c:
        await c.pause_generation("retract")
        await c.update_weights_from_disk(s.weights_dir(), weight_version="v1")
        await c.continue_generation()
        check(s.stage_version("talker_ar") == "default", "talker updated")
        async with raw(s) as http:
            r = await http.get("/model_info")
        check(r.status_code == 409, f"unscoped GET {r.status_code}")
        async with expect(ConflictError):
            await c.model_info(stages=None)
        info = await c.model_info()
    check(info.weight_version == "v1", f"{info.weight_version}")
    return "409 unscoped, v1 scoped"


@case("ready: wait_until_ready on a speech pipeline after a thinker-only update", speech=True)
async def _(s: ServerUnderTest) -> None:
    async with client(s) as c:
        await c.pause_generation("retract")
        await c.update_weights_from_disk(s.weights_dir(), weight_version="v1")
        await c.continue_generation()
        await c.wait_until_ready(timeout_s=5, poll_s=0.05)


@case("ready: /health 503 'starting' during start-up; wait_until_ready waits it out", starting=True)
async def _(s: ServerUnderTest) -> None:
    async with client(s) as c:
        h = await c.health()
        check(not h.ok and h.status_code == 503 and h.body.get("status") == "starting", f"{h}")
        waiter = asyncio.ensure_future(c.wait_until_ready(timeout_s=10, poll_s=0.05))
        await asyncio.sleep(0.3)
        check(not waiter.done(), "ready while starting")
        s.set_ready()
        status = await waiter
    check(status.ok, "not ready")


@case("ready: wait_until_ready gives up with a typed error naming /health", starting=True)
async def _(s: ServerUnderTest) -> None:
    async with client(s) as c, expect(TransientServerError, "not ready"):
        await c.wait_until_ready(timeout_s=0.3, poll_s=0.05)


@case("health: 200 {'status': 'healthy'} with no auth")
async def _(s: ServerUnderTest) -> None:
    async with client(s) as c:
        h = await c.health()
    check(h.ok and h.body.get("status") == "healthy", f"{h}")


@case("routes: plain-sglang routes are 404 (the client never calls them)")
async def _(s: ServerUnderTest) -> None:
    async with raw(s) as http:
        codes = [
            (await http.get(route)).status_code
            for route in (
                "/health_generate",
                "/get_server_info",
                "/flush_cache",
                "/get_weight_version",
            )
        ]
    check(codes == [404] * 4, f"{codes}")
    async with client(s) as c:
        await c.flush_cache()
        await c.get_server_info()


# ================================================================= auth


@case(
    "auth: admin without key 401, wrong key 403, right key OK; /generate and /health need none",
    admin_api_key=ADMIN_KEY,
)
async def _(s: ServerUnderTest) -> None:
    async with client(s) as c:
        async with expect(AdminAuthError) as got:
            await c.model_info()
        check(got[0].status_code == 401, f"{got[0].status_code}")
        r = await c.generate([1], SP)
        check(r.completion_tokens >= 1 and (await c.health()).ok, "public routes")
    async with client(s, admin_api_key="wrong") as c:
        async with expect(AdminAuthError) as got:
            await c.pause_generation("retract")
        check(got[0].status_code == 403, f"{got[0].status_code}")
    async with client(s, admin_api_key=ADMIN_KEY) as c:
        check((await c.model_info()).weight_version == "default", "with the key")


@case("auth: the key is never in an error message or repr", admin_api_key=ADMIN_KEY)
async def _(s: ServerUnderTest) -> None:
    async with client(s, admin_api_key=ADMIN_KEY) as c:
        async with expect(ContractError) as got:
            await c.update_weights_from_disk("/does/not/exist", weight_version="x")
        check(ADMIN_KEY not in str(got[0]) and ADMIN_KEY not in repr(c), "key leaked")


@case("auth: checked before the update_weights_from_tensor 501 stub", admin_api_key=ADMIN_KEY)
async def _(s: ServerUnderTest) -> None:
    async with raw(s) as http:
        no = await http.post("/update_weights_from_tensor", json={})
        bad = await http.post(
            "/update_weights_from_tensor", json={}, headers={"Authorization": "Bearer nope"}
        )
        ok = await http.post(
            "/update_weights_from_tensor", json={}, headers={"Authorization": f"Bearer {ADMIN_KEY}"}
        )
    check(
        (no.status_code, bad.status_code, ok.status_code) == (401, 403, 501),
        f"{no.status_code} {bad.status_code} {ok.status_code}",
    )


# ================================================================= weight updates


@case("disk: update sets the version in model_info and in the next sample")
async def _(s: ServerUnderTest) -> None:
    async with client(s) as c:
        await c.pause_generation("retract")
        reply = await c.update_weights_from_disk(s.weights_dir(), weight_version="step-1")
        await c.continue_generation()
        info = await c.model_info()
        r = await c.generate([1], SP)
    check(
        reply.success and info.weight_version == "step-1" == r.weight_version,
        f"{info} {r.weight_version}",
    )
    check(info.model_path == s.weights_dir(), f"{info.model_path}")


@case(
    "disk: a failed update is a WeightUpdateError naming the stage's reason; engine not left paused"
)
async def _(s: ServerUnderTest) -> str:
    async with client(s) as c:
        async with expect(WeightUpdateError) as got:
            await c.update_weights_from_disk("/does/not/exist", weight_version="bad")
        check(not isinstance(got[0], EnginePausedError), "disk failure said paused")
        info = await c.model_info()
    check(info.weight_version == "default" and not s.engine_paused(), f"{info.weight_version}")
    return str(got[0])[:100]


@case("disk: keep_pause leaves the engine paused after a successful update")
async def _(s: ServerUnderTest) -> None:
    async with client(s) as c:
        await c.update_weights_from_disk(s.weights_dir(), weight_version="kp", keep_pause=True)
        check(s.engine_paused(), "not paused")
        await c.continue_generation()
    check(not s.engine_paused(), "still paused")


@case("disk: timed-out update (server 500) recognised as applied by re-reading the version")
async def _(s: ServerUnderTest) -> str:
    s.slow_admin("/update_weights_from_disk", 1.4)
    async with client(s, timeouts=Timeouts(admin=1.0)) as c:
        reply = await c.update_weights_from_disk(s.weights_dir(), weight_version="v2")
        check(reply.success and "recovered_from" in reply.body, f"{reply.body}")
        check((await c.model_info()).weight_version == "v2", "model_info")
    return str(reply.body["recovered_from"])[:100]


@case("disk: a tiny timeout_s is a 500 while the scheduler still applies the update (raw)")
async def _(s: ServerUnderTest) -> str:
    s.slow_admin("/update_weights_from_disk", 0.5)
    async with raw(s) as http:
        r = await http.post(
            "/update_weights_from_disk",
            json={
                "model_path": s.weights_dir(),
                "weight_version": "raw3",
                "timeout_s": 0.1,
                "stages": ["thinker"],
            },
        )
        await asyncio.sleep(0.8)
        v = (await http.post("/model_info", json={"stages": ["thinker"]})).json()["weight_version"]
    check(r.status_code == 500 and v == "raw3", f"{r.status_code} then {v}")
    return f"{r.status_code} {r.text[:30]!r}, then {v}"


@case("disk: the client's server-side timeout_s outlives the server default (slow load succeeds)")
async def _(s: ServerUnderTest) -> None:
    s.slow_admin("/update_weights_from_disk", 0.6)
    async with client(s, timeouts=Timeouts(admin=30.0)) as c:
        reply = await c.update_weights_from_disk(s.weights_dir(), weight_version="slow")
    check(reply.success and "recovered_from" not in reply.body, f"{reply.body}")


@case("disk: a transient 500 is retried (same path, same version: idempotent)")
async def _(s: ServerUnderTest) -> None:
    s.fail_admin("/update_weights_from_disk", 1)
    async with client(s) as c:
        reply = await c.update_weights_from_disk(s.weights_dir(), weight_version="v4")
    check(reply.success and s.stage_version("thinker") == "v4", "not applied")


@case("disk: retries are bounded and the error says the version was checked")
async def _(s: ServerUnderTest) -> str:
    s.fail_admin("/update_weights_from_disk", 99)
    want = "does not report weight_version 'v5'"
    async with client(s) as c, expect(TransientServerError, want) as got:
        await c.update_weights_from_disk(s.weights_dir(), weight_version="v5")
    check(got[0].attempts == FAST.max_attempts, f"{got[0].attempts}")
    return str(got[0])[:100]


@case("distributed: init group, update (version set), destroy")
async def _(s: ServerUnderTest) -> None:
    async with client(s) as c:
        await c.init_weights_update_group("127.0.0.1", 29500, 2, rank_offset=1)
        await c.pause_generation("retract")
        await c.update_weights_from_distributed(
            ["model.norm.weight"], ["bfloat16"], [[8]], weight_version="d1"
        )
        await c.continue_generation()
        await c.destroy_weights_update_group()
        check((await c.model_info()).weight_version == "d1", "version")


@case(
    "distributed: a failed update leaves the engine paused (EnginePausedError); continue recovers"
)
async def _(s: ServerUnderTest) -> None:
    async with client(s) as c:
        async with expect(EnginePausedError) as got:
            await c.update_weights_from_distributed(
                ["w"], ["bfloat16"], [[2]], group_name="missing", weight_version="x"
            )
        check(got[0].engine_paused is True and s.engine_paused(), "not paused")
        await c.continue_generation()
        check(not s.engine_paused(), "still paused")


@case("distributed: unequal names/dtypes/shapes refused locally (server: 400, engine paused)")
async def _(s: ServerUnderTest) -> None:
    async with client(s) as c, expect(ClientValidationError, "equal length"):
        await c.update_weights_from_distributed(["a", "b"], ["bfloat16"], [[1], [1]])
    async with raw(s) as http:
        r = await http.post(
            "/update_weights_from_distributed",
            json={
                "names": ["a", "b"],
                "dtypes": ["bfloat16"],
                "shapes": [[1], [1]],
                "stages": ["thinker"],
            },
        )
        paused = s.engine_paused()
        await http.post("/continue_generation", json={"stages": ["thinker"]})
    check(r.status_code == 400 and paused, f"{r.status_code} paused={paused}")


@case("distributed: a timed-out update that applied is a success (not re-sent)")
async def _(s: ServerUnderTest) -> None:
    async with client(s, timeouts=Timeouts(admin=1.0)) as c:
        await c.init_weights_update_group("127.0.0.1", 29500, 2, rank_offset=1)
        s.slow_admin("/update_weights_from_distributed", 1.4)
        reply = await c.update_weights_from_distributed(
            ["w"], ["bfloat16"], [[2]], weight_version="d2"
        )
    check(reply.success and "recovered_from" in reply.body, f"{reply.body}")


@case("distributed: a 500 is not re-sent (the trainer would not broadcast again)")
async def _(s: ServerUnderTest) -> None:
    async with client(s) as c:
        await c.init_weights_update_group("127.0.0.1", 29500, 2, rank_offset=1)
        s.fail_admin("/update_weights_from_distributed", 1)
        async with expect(TransientServerError) as got:
            await c.update_weights_from_distributed(["w"], ["bfloat16"], [[2]], weight_version="d3")
    check(got[0].attempts == 1, f"{got[0].attempts}")


@case("tensor: update_weights_from_tensor is a 501 stub (the client offers no tensor update)")
async def _(s: ServerUnderTest) -> None:
    async with raw(s) as http:
        r = await http.post("/update_weights_from_tensor", json={"serialized_named_tensors": []})
    check(r.status_code == 501 and r.json()["error"]["code"] == "not_implemented", r.text[:200])
    check(
        not hasattr(OmniRolloutClient, "update_weights_from_tensor"), "client has a tensor update"
    )
    _ = NotSupportedError  # what a 501 maps to


@case("checker: weights_checker checksum per stage")
async def _(s: ServerUnderTest) -> None:
    async with client(s) as c:
        reply = await c.weights_checksum()
    check(reply.success and reply.stage_data("thinker"), f"{reply.body}")


# ================================================================= admin transport faults


@case("admin: unknown stage -> 500 (typed), the next pooled request still works")
async def _(s: ServerUnderTest) -> None:
    async with client(s) as c:
        async with expect(TransientServerError) as got:
            await c.pause_generation("retract", stages=["nope"])
        check(got[0].status_code == 500, f"{got[0].status_code}")
        check((await c.model_info()).weight_version == "default", "next request")


@case("admin: an empty stage list is a 500 (nothing to run it on)")
async def _(s: ServerUnderTest) -> None:
    async with raw(s) as http:
        r = await http.post("/pause_generation", json={"mode": "retract", "stages": []})
    check(r.status_code == 500, f"{r.status_code}")


@case("admin: unscoped calls reach every stage; stages without a scheduler answer skipped")
async def _(s: ServerUnderTest) -> None:
    async with client(s, stages=None) as c:
        reply = await c.pause_generation("in_place")
        await c.continue_generation()
    skipped = {r.stage for r in reply.stages if r.data.get("skipped")}
    acting = {r.stage for r in reply.stages if not r.data.get("skipped")}
    check(acting == {"thinker"} and {"preprocessing", "decode"} <= skipped, f"{acting} {skipped}")
    messages = {r.message for r in reply.stages if r.data.get("skipped")}
    check(messages == {"stage does not support admin operations"}, f"{messages}")


@case("admin: a transient 500 on pause is retried")
async def _(s: ServerUnderTest) -> None:
    s.fail_admin("/pause_generation", 1)
    async with client(s) as c:
        reply = await c.pause_generation("retract")
        await c.continue_generation()
    check(reply.success, "pause failed")


@case("admin: model_info queued behind a slow update waits for it (one scheduler)")
async def _(s: ServerUnderTest) -> None:
    s.slow_admin("/update_weights_from_disk", 0.5)
    async with client(s) as c:
        update = asyncio.ensure_future(
            c.update_weights_from_disk(s.weights_dir(), weight_version="q1")
        )
        await asyncio.sleep(0.15)
        info = await c.model_info()
        await update
    check(info.weight_version == "q1", f"{info.weight_version}")


def _selected(names: list[str] | None) -> list[Case]:
    if not names:
        return list(CASES)
    return [c for c in CASES if any(n in c.name for n in names)]


async def run_case(one: Case, make_server: ServerFactory) -> tuple[bool, str]:
    try:
        with make_server(one.options) as server:
            detail = await asyncio.wait_for(one.fn(server), 60)
        return True, detail or ""
    except Exception as exc:  # noqa: BLE001 - a failed case is reported, not raised
        return False, f"{type(exc).__name__}: {exc}"[:300]


def run_all(make_server: ServerFactory, names: list[str] | None = None) -> dict[str, Any]:
    """Run the cases (those whose name contains one of ``names``), print one line each and
    return the summary (also printed as one JSON line)."""
    results = []
    for one in _selected(names):
        ok, detail = asyncio.run(run_case(one, make_server))
        results.append({"case": one.name, "ok": ok, "detail": detail})
        print(("PASS" if ok else "FAIL"), one.name, ("- " + detail) if detail else "", flush=True)
    summary = {
        "passed": sum(r["ok"] for r in results),
        "total": len(results),
        "failed": [r["case"] for r in results if not r["ok"]],
    }
    print(json.dumps(summary))
    return summary


def iter_case_names() -> Iterator[str]:
    return (c.name for c in CASES)


# ===================================================================== this package's fake server


class FakeServerUnderTest(ServerUnderTest):
    """``ServerUnderTest`` over ``FakeOmniServer`` (the CI side of the comparison)."""

    def __init__(self, options: ServerOptions, weights_dir: str):
        from .generator import FakeGeneration
        from .serving import FakeOmniServer

        def long(req: Any) -> Any:
            return FakeGeneration(
                token_ids=[7] * req.max_new_tokens, logprobs=[-0.5] * req.max_new_tokens
            )

        self.options = options
        self._weights = weights_dir
        self.server = FakeOmniServer(
            vocab_size=options.vocab_size,
            max_seq_len=options.max_seq_len,
            token_delay_s=options.token_delay_s,
            max_inflight=options.max_in_flight,
            speech=options.speech,
            admin_api_key=options.admin_api_key,
            startup_delay_s=3600.0 if options.starting else 0.0,
            generator=long if options.long else None,
        )
        self.eos_token_id = self.server.engine.eos_token_id

    @property
    def url(self) -> str:  # type: ignore[override]
        return self.server.url

    def slow_admin(self, route: str, seconds: float) -> None:
        self.server.faults.slow_next(1, seconds=seconds, route=route)

    def fail_admin(self, route: str, count: int) -> None:
        self.server.faults.fail_next(count, status=500, route=route)

    def set_ready(self) -> None:
        self.server.worker.startup_delay_s = 0.0

    def active_count(self) -> int:
        return self.server.active_count()

    def records(self) -> list[Record]:
        return [
            Record(
                input_ids=list(r.input_ids),
                sampling=dict(r.sampling),
                tensors={k: (v[0], list(v[1]), v[2]) for k, v in r.tensor_digests.items()},
                outcome=r.outcome,
                token_ids=list(r.token_ids),
                weight_version=r.weight_version,
            )
            for r in self.server.records
        ]

    def stage_version(self, stage: str) -> str | None:
        return self.server.call(lambda: self.server.engine.weight_versions.get(stage))

    def engine_paused(self) -> bool:
        return self.server.engine_paused

    def weights_dir(self) -> str:
        return self._weights


@contextlib.contextmanager
def fake_server(options: ServerOptions) -> Iterator[ServerUnderTest]:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="omni-contract-") as weights:
        backend = FakeServerUnderTest(options, weights)
        backend.server.start()
        try:
            yield backend
        finally:
            backend.server.stop()

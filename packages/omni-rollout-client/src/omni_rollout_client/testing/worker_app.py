"""A fake sglang-omni 0.1.9 worker (thinker only, no model) as a Starlette app.

It reproduces the HTTP contract a rollout client depends on (contract §1-§4, §7, §10): status
codes and bodies of /generate, the admin envelope, pause/abort/retract semantics, the weight-update
lifecycle (refused while requests are active unless paused with retract, engine kept paused after
a failed distributed update), admin auth, and FastAPI-style 404s for plain-sglang routes.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import math
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from ..payload import MM_TENSOR_NAMES
from . import contract as C
from .admin_key import admin_key_refusal
from .faults import Faults
from .generator import FakeRequest, Generator, make_hash_generator
from .loader_names import check_disk_checkpoint

TEXT_ONLY_STAGES = (
    "preprocessing",
    "image_encoder",
    "audio_encoder",
    "mm_aggregate",
    "thinker",
    "decode",
)
SPEECH_STAGES = (*TEXT_ONLY_STAGES, "talker_ar", "code2wav")
AR_STAGES = frozenset({"thinker", "talker_ar"})
MM_NAMES = frozenset(MM_TENSOR_NAMES)
META_PAYLOAD = {
    "image_grid_thw": "image",
    "video_grid_thw": "image",
    "video_second_per_grid": "image",
    "feature_attention_mask": "audio",
    "audio_feature_lengths": "audio",
}
NUMPY_OF_WIRE = {
    "float64": "<f8",
    "float32": "<f4",
    "float16": "<f2",
    "bfloat16": "<u2",
    "int64": "<i8",
    "int32": "<i4",
    "int16": "<i2",
    "int8": "i1",
    "uint8": "u1",
    "bool": "?",
}
UPDATE_ACTIONS = frozenset(
    {
        "init_weights_update_group",
        "destroy_weights_update_group",
        "update_weights_from_distributed",
        "update_weights_from_disk",
    }
)
MAX_STOP_STRINGS = 32

# The coordinator's wait for an admin call when the request gives no ``timeout_s`` (0.1.9's
# ``timeout_or_default`` in serve/openai_api.py).
DEFAULT_ADMIN_TIMEOUT_S: dict[str, float] = {
    "model_info": 30.0,
    "pause_generation": 60.0,
    "continue_generation": 60.0,
    "update_weights_from_disk": 120.0,
    "init_weights_update_group": 300.0,
    "destroy_weights_update_group": 300.0,
    "update_weights_from_distributed": 300.0,
    "weights_checker": 120.0,
}


# The admin routes whose body is one request model, each at ``/<action>``.
ADMIN_ACTIONS: dict[str, type[BaseModel]] = {
    "pause_generation": C.PauseModel,
    "continue_generation": C.ContinueModel,
    "update_weights_from_disk": C.DiskUpdateModel,
    "update_weights_from_distributed": C.DistributedUpdateModel,
    "init_weights_update_group": C.InitGroupModel,
    "destroy_weights_update_group": C.DestroyGroupModel,
}


class HTTPError(Exception):
    def __init__(self, status: int, detail: Any, headers: dict[str, str] | None = None):
        self.status, self.detail, self.headers = status, detail, headers


class Aborted(Exception):
    """The request was dropped by pause(abort) or abort_all_requests."""


def _validation_422(exc: ValidationError) -> JSONResponse:
    errors = []
    for err in exc.errors(include_url=False):
        item: dict[str, Any] = {
            "type": err["type"],
            "loc": ["body", *err["loc"]],
            "msg": err["msg"],
        }
        if len(repr(err.get("input"))) < 200:
            item["input"] = err.get("input")
        if "ctx" in err:  # FastAPI's jsonable_encoder turns an exception into {}
            item["ctx"] = {
                k: {} if isinstance(v, BaseException) else v for k, v in err["ctx"].items()
            }
        errors.append(item)
    return JSONResponse({"detail": json.loads(json.dumps(errors, default=str))}, status_code=422)


@dataclass
class ActiveRequest:
    rid: str
    aborted: bool = False
    retracted: bool = False


@dataclass
class GenerationRecord:
    """What the server saw and produced for one executed /generate (for test assertions)."""

    rid: str
    request_index: int
    input_ids: list[int]
    sampling: dict[str, Any]
    metadata: dict[str, Any] | None
    tensor_digests: dict[str, tuple[str, list[int], str]]
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    weight_version: str | None = None
    outcome: str = "running"  # ok | aborted | dropped | error


# 0.1.9's answer to a request for logprobs it cannot produce (rollout logprobs, audio output).
NO_LOGPROBS = (
    "backend did not return requested logprobs; expected output_token_logprobs for text or "
    "meta_info.omni_rollout for audio (set return_omni_rollout=true for audio logprobs)"
)


def _refuse_unsupported(req: C.GenerateRequestModel) -> None:
    """What the server refuses before any stage sees the request: not exactly one input,
    streaming, and logprobs it cannot produce."""
    if sum(v is not None for v in (req.input_ids, req.prompt, req.messages)) != 1:
        raise HTTPError(400, "exactly one of input_ids, prompt, or messages is required")
    if req.stream:
        raise HTTPError(400, "stream=true is not supported by /generate yet")
    if req.return_omni_rollout:
        raise HTTPError(501, NO_LOGPROBS)
    if req.output_modalities and "audio" in req.output_modalities and req.return_logprob:
        raise HTTPError(501, NO_LOGPROBS)


def _decode_bundle(
    req: C.GenerateRequestModel,
) -> tuple[dict[str, np.ndarray], dict[str, tuple[str, list[int], str]]]:
    """The request's ``multimodal_train_inputs`` as arrays, and each tensor's (dtype, shape,
    sha256) for tests to compare with what the client encoded; empty without a bundle."""
    tensors: dict[str, np.ndarray] = {}
    digests: dict[str, tuple[str, list[int], str]] = {}
    if req.multimodal_train_inputs is None:
        return tensors, digests
    if req.input_ids is None:
        raise HTTPError(
            400,
            "multimodal_train_inputs requires prompt_token_ids (the processor-expanded input_ids)",
        )
    unknown = set(req.multimodal_train_inputs.tensors) - MM_NAMES
    if unknown:
        raise HTTPError(
            400, "unknown multimodal_train_inputs tensors: " + ", ".join(sorted(unknown))
        )
    for name, spec in sorted(req.multimodal_train_inputs.tensors.items()):
        raw = base64.b64decode(spec.data)
        if math.prod(spec.shape) == 0:  # torch.frombuffer of an empty buffer
            raise HTTPError(500, "both buffer length (0) and count (-1) must not be 0")
        tensors[name] = np.frombuffer(raw, dtype=NUMPY_OF_WIRE[spec.dtype]).reshape(spec.shape)
        digests[name] = (spec.dtype, list(spec.shape), hashlib.sha256(raw).hexdigest())
    return tensors, digests


def _check_bundle_metadata(tensors: dict[str, np.ndarray]) -> None:
    """Grids without pixels and audio lengths without features are the caller's 400; a 1-D
    ``feature_attention_mask`` fails inside the audio tower (a 500 with torch's message)."""
    if not tensors:
        return
    has_image = "pixel_values" in tensors or "pixel_values_videos" in tensors
    has_audio = "input_features" in tensors
    for meta, kind in META_PAYLOAD.items():
        if meta in tensors and kind == "image" and not has_image:
            raise HTTPError(
                400,
                "multimodal_train_inputs provides image/video metadata without pixel_values or pixel_values_videos",
            )
        if meta in tensors and kind == "audio" and not has_audio:
            raise HTTPError(
                400,
                "multimodal_train_inputs provides audio metadata without input_features",
            )
    if "feature_attention_mask" in tensors and tensors["feature_attention_mask"].ndim != 2:
        raise HTTPError(
            500, "Dimension out of range (expected to be in range of [-1, 0], but got 1)"
        )


def _check_sampling(sp: C.SamplingParamsModel, stop: list[str], temperature: float) -> None:
    """sglang's ``SamplingParams`` checks, with the status each reaches the caller with."""
    if len(stop) > MAX_STOP_STRINGS:
        raise HTTPError(
            400, f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stop)}"
        )
    if temperature > 0 and sp.top_k is not None and (sp.top_k == 0 or sp.top_k < -1):
        raise HTTPError(500, f"top_k must be -1 (disable) or at least 1, got {sp.top_k}.")
    if sp.repetition_penalty is not None and sp.repetition_penalty > 2:
        raise HTTPError(
            500,
            "repetition_penalty must be in (0, 2] (1.0 = no penalty), "
            f"got {float(sp.repetition_penalty)}.",
        )


def _generate_reply(
    req: C.GenerateRequestModel,
    prompt_tokens: int,
    tokens: list[int],
    logprobs: list[float],
    finish: str,
    record: GenerationRecord,
    eos_token_id: int,
) -> dict[str, Any]:
    """The /generate body 0.1.9 answers with: text without EOS, ``meta_info`` with the finish
    reason, token counts, weight version and (when asked) ``[logprob, token]`` pairs."""
    return {
        "text": " ".join(f"<{t}>" for t in tokens if t != eos_token_id),
        "audio": None,
        "meta_info": {
            "finish_reason": {
                "type": finish,
                "length": len(tokens) if finish == "length" else None,
            },
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(tokens),
            "cached_tokens": 0,
            "weight_version": record.weight_version,
            "request_metadata": req.metadata,
            "output_token_logprobs": [[lp, t] for lp, t in zip(logprobs, tokens, strict=True)]
            if req.return_logprob
            else None,
            "omni_rollout": None,
        },
    }


class FakeEngine:
    """Server state, touched only on the server's event loop (tests read snapshots)."""

    def __init__(
        self,
        *,
        vocab_size: int,
        eos_token_id: int,
        max_seq_len: int,
        generator: Generator | None,
        token_delay_s: float,
        max_inflight: int | None,
        tp_size: int,
        speech: bool,
        model_path: str,
    ):
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.max_seq_len = max_seq_len
        self.generator = generator or make_hash_generator(vocab_size, eos_token_id)
        self.token_delay_s = token_delay_s
        self.max_inflight = max_inflight
        self.tp_size = tp_size
        self.stages = SPEECH_STAGES if speech else TEXT_ONLY_STAGES
        self.weight_versions = {s: "default" for s in AR_STAGES if s in self.stages}
        self.model_path = model_path
        self.load_format: str | None = None
        self.last_disk_report: Any = None  # loader_names.LoaderReport of the last disk update
        self.paused = False
        self.pause_mode: str | None = None
        self.groups: dict[str, dict[str, Any]] = {}
        self.active: dict[str, ActiveRequest] = {}
        self.records: list[GenerationRecord] = []
        self.admin_log: list[tuple[str, dict[str, Any]]] = []
        self.request_counter = 0
        self.max_active = 0
        self._lock = threading.Lock()
        self._resume: asyncio.Event | None = None
        self._scheduler: asyncio.Lock | None = None

    def scheduler(self) -> asyncio.Lock:
        """The AR stage's scheduler thread: admin work runs on it one call at a time, so a
        /model_info sent while a slow update is loading waits for that update (as on 0.1.9)."""
        if self._scheduler is None:
            self._scheduler = asyncio.Lock()
        return self._scheduler

    # -- pause gate
    def _event(self) -> asyncio.Event:
        if self._resume is None:
            self._resume = asyncio.Event()
            self._resume.set()
        return self._resume

    async def gate(self, req: ActiveRequest) -> None:
        while True:
            if req.aborted:
                raise Aborted
            if not self.paused:
                return
            event = self._event()
            event.clear()
            await event.wait()

    def set_paused(self, paused: bool) -> None:
        self.paused = paused
        if not paused:
            self._event().set()

    def abort_all(self) -> int:
        for req in self.active.values():
            req.aborted = True
        self._event().set()  # wake blocked requests so they see the abort
        if self.paused:
            self._event().clear()
        return len(self.active)


class FakeWorkerApp:
    """Builds the Starlette app around a ``FakeEngine``."""

    def __init__(
        self,
        engine: FakeEngine,
        faults: Faults,
        *,
        admin_api_key: str | None = None,
        startup_delay_s: float = 0.0,
    ):
        self.engine = engine
        self.faults = faults
        self._admin_key = admin_api_key
        self.startup_delay_s = startup_delay_s
        self._started_at: float | None = None
        self._background: set[asyncio.Future[Any]] = set()
        routes = [
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/generate", self.generate, methods=["POST"]),
            Route("/model_info", self.model_info, methods=["GET", "POST"]),
            *(
                Route(f"/{action}", self.admin_route(action, model), methods=["POST"])
                for action, model in ADMIN_ACTIONS.items()
            ),
            Route("/weights_checker", self.weights_checker, methods=["GET", "POST"]),
            Route("/update_weights_from_tensor", self.update_from_tensor, methods=["POST"]),
        ]
        self.app = Starlette(
            routes=routes,
            exception_handlers={
                404: self._not_found,
                405: self._not_allowed,
                HTTPError: self._http_error,
            },
        )

    # -- plumbing
    async def _not_found(self, request: Request, exc: Exception) -> Response:
        self.engine.admin_log.append((request.url.path, {"status": 404}))
        return JSONResponse({"detail": "Not Found"}, status_code=404)

    async def _not_allowed(self, request: Request, exc: Exception) -> Response:
        return JSONResponse({"detail": "Method Not Allowed"}, status_code=405)

    async def _http_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPError)
        return JSONResponse({"detail": exc.detail}, status_code=exc.status, headers=exc.headers)

    def _check_auth(self, request: Request) -> None:
        refusal = admin_key_refusal(request.headers.get("authorization"), self._admin_key)
        if refusal is not None:
            raise HTTPError(*refusal)

    @staticmethod
    async def _json(request: Request) -> Any:
        raw = await request.body()
        if not raw:
            return {}
        try:
            return json.loads(raw)
        except json.JSONDecodeError as exc:
            raise HTTPError(
                422,
                [
                    {
                        "type": "json_invalid",
                        "loc": ["body", 0],
                        "msg": "JSON decode error",
                        "input": {},
                        "ctx": {"error": exc.msg},
                    }
                ],
            ) from exc

    def _starting(self) -> bool:
        loop_time = asyncio.get_running_loop().time()
        if self._started_at is None:
            self._started_at = loop_time
        return loop_time - self._started_at < self.startup_delay_s

    async def _apply_fault(self, route: str) -> Any:
        fault = self.faults.take(route)
        if fault is None:
            return None
        if fault.kind == "delay":
            await asyncio.sleep(fault.seconds)
            return None
        if fault.kind == "status":
            raise HTTPError(fault.status, f"injected fault: HTTP {fault.status}")
        return fault

    # -- public routes
    async def health(self, request: Request) -> Response:
        if self._starting():
            return JSONResponse(
                {"status": "starting", **self._coordinator_health()}, status_code=503
            )
        return JSONResponse({"status": "healthy", **self._coordinator_health()})

    def _coordinator_health(self) -> dict[str, Any]:
        """The coordinator's ``health()`` fields 0.1.9 merges into /health."""
        return {
            "running": True,
            "stages": list(self.engine.stages),
            "entry_stage": "preprocessing",
            "total_requests": len(self.engine.active),
            "pending_completions": len(self.engine.active),
            "request_states": {"running": len(self.engine.active)} if self.engine.active else {},
        }

    async def models(self, request: Request) -> Response:
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": "fake-qwen3-omni",
                        "object": "model",
                        "created": 0,
                        "owned_by": "sglang-omni",
                        "root": "fake-qwen3-omni",
                    }
                ],
            }
        )

    async def generate(self, request: Request) -> Response:
        fault = await self._apply_fault("/generate")
        body = await self._json(request)
        try:
            req = C.GenerateRequestModel.model_validate(body)
        except ValidationError as exc:
            return _validation_422(exc)
        _refuse_unsupported(req)
        # The checks run in the real server's order: the coordinator (session key), the
        # preprocessor (bundle decoding, context limit), then the thinker's request builder
        # (vocabulary, then sglang's SamplingParams). A stage's exception is a JSON 500 whose
        # detail is its message, unless the message marks a caller error (then 400).
        if "omni_session" in (req.metadata or {}):
            raise HTTPError(400, "request metadata key 'omni_session' is reserved")
        sp = req.sampling_params
        temperature = 0.0 if sp.temperature is None else sp.temperature  # omitted = greedy on 0.1.9
        stop = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop or [])
        max_new = sp.max_new_tokens or sp.max_tokens or 2048
        input_ids = self._prompt_ids(req)
        tensors, digests = _decode_bundle(req)
        self._check_context(len(input_ids), max_new)
        _check_bundle_metadata(tensors)
        self._check_vocabulary(input_ids)
        _check_sampling(sp, stop, temperature)

        record, active = self._admit(req, input_ids, temperature, max_new, digests)
        try:
            tokens, logprobs, finish = await self._sample(
                record, active, sp, tensors, temperature, max_new, fault
            )
        except Aborted:
            record.outcome = "aborted"
            return PlainTextResponse("Internal Server Error", status_code=500)
        finally:
            self.engine.active.pop(record.rid, None)
        record.token_ids, record.finish_reason = tokens, finish
        record.weight_version = self.engine.weight_versions["thinker"]
        content = _generate_reply(
            req, len(input_ids), tokens, logprobs, finish, record, self.engine.eos_token_id
        )
        if fault is not None and fault.kind == "drop":
            record.outcome = "dropped"
            return _DroppedResponse(json.dumps(content).encode())
        record.outcome = "ok"
        return JSONResponse(content)

    def _prompt_ids(self, req: C.GenerateRequestModel) -> list[int]:
        """The prompt's token ids: ``input_ids``, or chat ``messages`` folded into the vocabulary
        (a raw ``prompt`` is the preprocessor's 500 on Qwen3-Omni)."""
        if req.prompt is not None:  # Qwen3-Omni preprocessing cannot take a raw prompt
            raise HTTPError(500, "Preprocessing expects a list of chat messages")
        if req.messages is not None:
            text = json.dumps([m.model_dump() for m in req.messages])
            return [b % self.engine.vocab_size for b in text.encode()]
        return list(req.input_ids or [])

    def _check_vocabulary(self, input_ids: list[int]) -> None:
        for position, token in enumerate(input_ids):
            if token >= self.engine.vocab_size:
                raise HTTPError(
                    400,
                    f"prompt contains out-of-vocabulary token id {token} at position {position}. "
                    f"Valid token ids are in [0, {self.engine.vocab_size}).",
                )

    def _admit(
        self,
        req: C.GenerateRequestModel,
        input_ids: list[int],
        temperature: float,
        max_new: int,
        digests: dict[str, tuple[str, list[int], str]],
    ) -> tuple[GenerationRecord, ActiveRequest]:
        """Take the request in (or refuse it with a 503 when the queue is full): its index, its
        place among the active requests, and the record tests read."""
        engine = self.engine
        if engine.max_inflight is not None and len(engine.active) >= engine.max_inflight:
            raise HTTPError(503, "request queue is full")

        with engine._lock:
            index = engine.request_counter
            engine.request_counter += 1
        rid = str(uuid.uuid4())
        active = ActiveRequest(rid)
        engine.active[rid] = active
        engine.max_active = max(engine.max_active, len(engine.active))
        record = GenerationRecord(
            rid=rid,
            request_index=index,
            input_ids=input_ids,
            sampling={
                **req.sampling_params.model_dump(exclude_none=True),
                "temperature": temperature,
                "max_new_tokens": max_new,
            },
            metadata=req.metadata,
            tensor_digests=digests,
        )
        engine.records.append(record)
        return record, active

    async def _sample(
        self,
        record: GenerationRecord,
        active: ActiveRequest,
        sp: C.SamplingParamsModel,
        tensors: dict[str, np.ndarray],
        temperature: float,
        max_new: int,
        fault: Any,
    ) -> tuple[list[int], list[float], str]:
        """The completion's tokens, logprobs and finish reason, paced one token at a time through
        the engine's gate (where a pause holds it and an abort raises ``Aborted``)."""
        engine = self.engine
        fake_req = FakeRequest(
            record.request_index,
            record.input_ids,
            temperature,
            sp.seed,
            max_new,
            list(sp.stop_token_ids or []),
            tensors,
            record.metadata,
        )
        gen = engine.generator(fake_req)
        tokens, logprobs = list(gen.token_ids)[:max_new], list(gen.logprobs)[:max_new]
        if len(tokens) != len(logprobs):
            raise HTTPError(
                500,
                f"backend returned output_token_logprobs length {len(logprobs)} for completion_tokens={len(tokens)}",
            )
        finish = gen.finish_reason or (
            "length"
            if len(tokens) >= max_new and (not tokens or tokens[-1] != engine.eos_token_id)
            else "stop"
        )
        if fault is not None and fault.kind == "abort_finish":
            keep = min(fault.after_tokens, len(tokens))
            tokens, logprobs, finish = tokens[:keep], logprobs[:keep], "abort"
        for _ in range(max(1, len(tokens))):
            await engine.gate(active)
            if engine.token_delay_s:
                await asyncio.sleep(engine.token_delay_s)
        await engine.gate(active)
        return tokens, logprobs, finish

    def _check_context(self, prompt_len: int, max_new: int) -> None:
        limit = self.engine.max_seq_len
        if prompt_len >= limit:
            raise HTTPError(
                400,
                f"The input ({prompt_len} tokens) is longer than the model's context length ({limit} tokens).",
            )
        if prompt_len + max_new >= limit:
            raise HTTPError(
                400,
                f"Requested token count exceeds the model's maximum context length of {limit} tokens. You requested a total of {prompt_len + max_new} tokens: {prompt_len} tokens from the input messages and {max_new} tokens for the completion. Please reduce the number of tokens in the input messages or the completion to fit within the limit.",
            )

    # -- admin
    def _resolve_stages(self, stages: list[str] | None) -> list[str]:
        if stages is None:
            return sorted(self.engine.stages)  # the coordinator's order for "every stage"
        if not stages:  # "No stages registered for admin operation", uncaught
            raise HTTPError(500, "No stages registered for admin operation")
        unknown = sorted(set(stages) - set(self.engine.stages))
        if unknown:
            raise HTTPError(500, f"Unknown admin target stage(s): {unknown}")
        return list(dict.fromkeys(stages))

    def _envelope(
        self, action: str, stages: list[str], per_stage: dict[str, dict[str, Any]]
    ) -> dict[str, Any]:
        op_id = str(uuid.uuid4())
        results = []
        for stage in stages:
            res = per_stage.get(stage) or {
                "success": True,
                "message": "stage does not support admin operations",
                "data": {"skipped": True, "unsupported": True},
                "error": None,
                "rank": None,
            }
            results.append(
                {
                    "op_id": op_id,
                    "stage": stage,
                    "action": action,
                    "success": res["success"],
                    "message": res.get("message", ""),
                    "data": res.get("data", {}),
                    "error": res.get("error"),
                    "rank": res.get("rank", 0),
                    "role": "single",
                }
            )
        acting = [
            r for r in results if not r["data"].get("skipped") and not r["data"].get("unsupported")
        ]
        success = (
            bool(acting) and all(r["success"] for r in acting)
            if action in UPDATE_ACTIONS
            else all(r["success"] for r in results)
        )
        errors = [r["error"] for r in results if r["error"]]
        message = (
            "ok"
            if success
            else ("; ".join(errors) if errors else "admin operation did not complete successfully")
        )
        return {
            "op_id": op_id,
            "action": action,
            "success": success,
            "message": message,
            "results": results,
        }

    def admin_route(self, action: str, model: type[BaseModel]):
        async def handler(request: Request) -> Response:
            self._check_auth(request)
            fault = await self._apply_fault(request.url.path)
            try:
                req = model.model_validate(await self._json(request))
            except ValidationError as exc:
                return _validation_422(exc)
            if fault is not None and fault.kind == "slow":
                return await self._slow_admin(action, req, fault.seconds, handle)
            return await handle(req)

        async def handle(req: BaseModel, locked: bool = False) -> Response:
            if not locked:
                async with self.engine.scheduler():
                    return await handle(req, locked=True)
            payload = req.model_dump(exclude={"stages", "timeout_s"}, exclude_none=True)
            self.engine.admin_log.append(
                (
                    f"/{action}",
                    {
                        **payload,
                        "stages": getattr(req, "stages", None),
                        "timeout_s": getattr(req, "timeout_s", None),
                    },
                )
            )
            try:
                stages = self._resolve_stages(req.stages)
            except HTTPError:
                return PlainTextResponse(
                    "Internal Server Error", status_code=500, headers={"Connection": "close"}
                )
            per_stage = {
                s: getattr(self, f"_do_{action}")(s, payload) for s in stages if s in AR_STAGES
            }
            envelope = self._envelope(action, stages, per_stage)
            if not envelope["success"]:
                raise HTTPError(400, envelope)
            return JSONResponse(envelope)

        return handler

    async def _slow_admin(
        self, action: str, req: BaseModel, seconds: float, handle: Any
    ) -> Response:
        """The scheduler takes ``seconds``; the coordinator waits ``timeout_s`` at most, then the
        uncaught ``TimeoutError`` is a plain-text 500 — while the queued work still completes."""

        async def work() -> Response:
            async with self.engine.scheduler():
                await asyncio.sleep(seconds)
                try:
                    return await handle(req, locked=True)
                except HTTPError as exc:  # a failed envelope after the client stopped waiting
                    return JSONResponse({"detail": exc.detail}, status_code=exc.status)

        timeout = getattr(req, "timeout_s", None)
        timeout = DEFAULT_ADMIN_TIMEOUT_S[action] if timeout is None else float(timeout)
        task = asyncio.ensure_future(work())
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        done, _ = await asyncio.wait({task}, timeout=timeout)
        if not done:
            self.engine.admin_log.append((f"/{action}:timed_out", {"timeout_s": timeout}))
            return PlainTextResponse(
                "Internal Server Error", status_code=500, headers={"Connection": "close"}
            )
        result = task.result()
        if result.status_code >= 400:
            detail = json.loads(bytes(result.body))["detail"]
            raise HTTPError(result.status_code, detail)
        return result

    def _do_pause_generation(self, stage: str, payload: dict[str, Any]) -> dict[str, Any]:
        mode = str(payload.get("mode") or "abort")
        if mode not in {"abort", "retract", "in_place"}:
            return {
                "success": False,
                "message": f"invalid pause mode: {mode}",
                "error": f"invalid pause mode: {mode}",
            }
        engine = self.engine
        engine.set_paused(True)
        engine.pause_mode = mode
        num = 0
        if stage == "thinker":
            if mode == "abort":
                num = engine.abort_all()
            elif mode == "retract":
                for req in engine.active.values():
                    req.retracted = True
                num = len(engine.active)
        return {
            "success": True,
            "message": "generation paused",
            "data": {"mode": mode, "num_paused_requests": num, "engine_paused": True},
        }

    def _do_continue_generation(self, stage: str, payload: dict[str, Any]) -> dict[str, Any]:
        self.engine.set_paused(False)
        self.engine.pause_mode = None
        return {
            "success": True,
            "message": "generation continued",
            "data": {"engine_paused": False},
        }

    def _lifecycle(
        self,
        stage: str,
        payload: dict[str, Any],
        update,
        result_data: dict[str, Any],
        *,
        keep_pause_on_failure: bool,
    ) -> dict[str, Any]:
        engine = self.engine
        previous, previous_mode = engine.paused, engine.pause_mode
        keep_pause = bool(payload.get("keep_pause", False))
        engine.set_paused(True)
        num = 0
        if payload.get("abort_all_requests"):
            num = engine.abort_all() if stage == "thinker" else 0
        elif engine.active and stage == "thinker" and not (previous and previous_mode == "retract"):
            if not keep_pause:
                engine.set_paused(previous)
            ids = list(engine.active)[:16]
            return {
                "success": False,
                "message": "active requests are present; set abort_all_requests=true or pause_generation with mode=retract before updating weights",
                "error": "active requests present during weight update",
                "data": {
                    "active_request_count": len(engine.active),
                    "active_request_ids": ids,
                    "abort_all_requests": False,
                    "pause_mode": previous_mode,
                    "engine_paused": engine.paused,
                },
            }
        success, message = update(stage, payload)
        stay_paused = keep_pause or (keep_pause_on_failure and not success)
        engine.set_paused(True if stay_paused else previous)
        data = {
            "num_paused_requests": num,
            "flush_cache": payload.get("flush_cache", True),
            "flush_success": True if success else None,
            "keep_pause": keep_pause,
            "engine_paused": engine.paused,
            **result_data,
        }
        return {
            "success": success,
            "message": message,
            "data": data,
            "error": None if success else message,
        }

    def _set_version(self, stage: str, payload: dict[str, Any]) -> None:
        if payload.get("weight_version") is not None:
            self.engine.weight_versions[stage] = str(payload["weight_version"])

    def _do_update_weights_from_distributed(
        self, stage: str, payload: dict[str, Any]
    ) -> dict[str, Any]:
        def update(stage: str, p: dict[str, Any]) -> tuple[bool, str]:
            names, dtypes, shapes = p["names"], p["dtypes"], p["shapes"]
            if not names or not dtypes or not shapes:  # ModelWorker's own wording
                return False, "names, dtypes and shapes must be non-empty"
            if not (len(names) == len(dtypes) == len(shapes)):
                return False, "names, dtypes and shapes must have the same length"
            if p.get("group_name") not in self.engine.groups:
                return False, f"weight update group {p.get('group_name')!r} is not initialized"
            self._set_version(stage, p)
            return True, "Succeeded to update parameter online."

        return self._lifecycle(
            stage,
            payload,
            update,
            {"group_name": payload.get("group_name"), "names": payload.get("names", [])},
            keep_pause_on_failure=True,
        )

    def _do_update_weights_from_disk(self, stage: str, payload: dict[str, Any]) -> dict[str, Any]:
        def update(stage: str, p: dict[str, Any]) -> tuple[bool, str]:
            if not Path(p["model_path"]).exists():
                return (
                    False,
                    f"Failed to update weights: model path {p['model_path']!r} does not exist",
                )
            problem = self._check_disk_weights(Path(p["model_path"]))
            if problem is not None:
                return False, f"Failed to update weights: {problem}"
            self.engine.model_path = p["model_path"]
            self.engine.load_format = p.get("load_format")
            self._set_version(stage, p)
            return True, "Succeeded to update model weights."

        return self._lifecycle(
            stage,
            payload,
            update,
            {
                "model_path": payload.get("model_path"),
                "weight_version": payload.get("weight_version"),
                "token_step": payload.get("token_step"),
            },
            keep_pause_on_failure=False,
        )

    def _check_disk_weights(self, path: Path) -> str | None:
        """The real thinker loader's view of a weight directory (``loader_names``): shapes it
        cannot load fail the update as on the real server; names it would silently DROP fail it
        here too (the real server only logs), so a test never passes on weights that vanished."""
        if not path.is_dir() or not any(path.glob("*.safetensors")):
            return None
        config = None
        for candidate in (path, Path(self.engine.model_path)):
            if (candidate / "config.json").is_file():
                config = json.loads((candidate / "config.json").read_text())
                break
        report = check_disk_checkpoint(path, config)
        self.engine.last_disk_report = report
        if report.bad_shapes:
            return f"size mismatch for {report.bad_shapes[0]}"
        if report.dropped:
            return (
                f"{len(report.dropped)} tensor name(s) match no thinker parameter and would be "
                f"dropped silently, e.g. {report.dropped[0]!r}"
            )
        return None

    def _do_init_weights_update_group(self, stage: str, payload: dict[str, Any]) -> dict[str, Any]:
        world, offset = payload["world_size"], payload.get("rank_offset", 0)
        data = {"group_name": payload.get("group_name"), "world_size": world, "rank_offset": offset}
        if stage != "thinker":
            # A real speech pipeline would join the talker with the thinker's offset and hang.
            msg = f"rank collision: {stage} would join {payload.get('group_name')!r} with the thinker's rank_offset {offset}; scope the request to stages=['thinker']"
            return {"success": False, "message": msg, "data": data, "error": msg}
        if offset < 1 or offset + self.engine.tp_size > world:
            msg = f"invalid ranks: rank_offset {offset} + tp_size {self.engine.tp_size} must fit in world_size {world} with the trainer at rank 0"
            return {"success": False, "message": msg, "data": data, "error": msg}
        self.engine.groups[payload["group_name"]] = dict(payload)
        return {
            "success": True,
            "message": "Succeeded to initialize custom process group.",
            "data": data,
        }

    def _do_destroy_weights_update_group(
        self, stage: str, payload: dict[str, Any]
    ) -> dict[str, Any]:
        name = payload.get("group_name")
        if self.engine.groups.pop(name, None) is None:
            msg = f"weight update group {name!r} does not exist"
            return {"success": False, "message": msg, "data": {"group_name": name}, "error": msg}
        return {
            "success": True,
            "message": "Succeeded to destroy custom process group.",
            "data": {"group_name": name},
        }

    def _stage_info(self, stage: str) -> dict[str, Any]:
        engine = self.engine
        return {
            "stage_tp_rank": 0,
            "stage_tp_size": engine.tp_size,
            "engine_paused": engine.paused,
            "waiting_queue_size": sum(1 for r in engine.active.values() if engine.paused),
            "running_batch_size": 0 if engine.paused else len(engine.active),
            "model_path": engine.model_path,
            "load_format": engine.load_format,
            "weight_version": engine.weight_versions[stage],
        }

    async def model_info(self, request: Request) -> Response:
        self._check_auth(request)
        stages = timeout_s = None
        if request.method == "POST":
            try:
                envelope_req = C.AdminBase.model_validate(await self._json(request))
            except ValidationError as exc:
                return _validation_422(exc)
            stages, timeout_s = envelope_req.stages, envelope_req.timeout_s
        self.engine.admin_log.append(("/model_info", {"stages": stages, "timeout_s": timeout_s}))
        try:  # queued behind admin work on the scheduler, bounded by the coordinator's wait
            await asyncio.wait_for(
                self.engine.scheduler().acquire(),
                DEFAULT_ADMIN_TIMEOUT_S["model_info"] if timeout_s is None else timeout_s,
            )
        except TimeoutError:
            return PlainTextResponse(
                "Internal Server Error", status_code=500, headers={"Connection": "close"}
            )
        self.engine.scheduler().release()
        try:
            resolved = self._resolve_stages(stages)
        except HTTPError:
            return PlainTextResponse(
                "Internal Server Error", status_code=500, headers={"Connection": "close"}
            )
        per_stage = {
            s: {"success": True, "message": "ok", "data": self._stage_info(s)}
            for s in resolved
            if s in AR_STAGES
        }
        envelope = self._envelope("model_info", resolved, per_stage)
        infos = [r["data"] for r in envelope["results"] if not r["data"].get("skipped")]
        versions = {i["weight_version"] for i in infos if i.get("weight_version") is not None}
        if len(versions) > 1:
            raise HTTPError(
                409,
                {
                    "success": False,
                    "message": "mixed stage weight_version",
                    "mixed_state": {"weight_version": sorted(versions)},
                    "stages": infos,
                    "admin": envelope,
                },
            )

        def common(key: str) -> Any:
            values = {json.dumps(i.get(key)) for i in infos if i.get(key) is not None}
            return json.loads(next(iter(values))) if len(values) == 1 else None

        return JSONResponse(
            {
                **envelope,
                "weight_version": common("weight_version"),
                "model_path": common("model_path"),
                "load_format": common("load_format"),
                "stages": envelope["results"],
            }
        )

    async def weights_checker(self, request: Request) -> Response:
        self._check_auth(request)
        if request.method == "GET":
            payload = {"action": request.query_params.get("action", "checksum")}
            stages = None
        else:
            req = C.CheckerModel.model_validate(await self._json(request))
            payload, stages = {"action": req.action}, req.stages
        resolved = self._resolve_stages(stages)
        per_stage = {
            s: {
                "success": True,
                "message": "ok",
                "data": {
                    "action": payload["action"],
                    "checksum": hashlib.sha256(self.engine.weight_versions[s].encode()).hexdigest(),
                },
            }
            for s in resolved
            if s in AR_STAGES
        }
        envelope = self._envelope("weights_checker", resolved, per_stage)
        return JSONResponse(envelope)

    async def update_from_tensor(self, request: Request) -> Response:
        self._check_auth(request)
        return JSONResponse(
            {
                "error": {
                    "message": "update_weights_from_tensor is not yet implemented. Use update_weights_from_disk for the disk-based weight update path.",
                    "code": "not_implemented",
                }
            },
            status_code=501,
        )


class _DroppedResponse(Response):
    """Starts a response, sends half the body, then abandons it: the server closes the
    connection and the client sees a protocol error after the work was done."""

    def __init__(self, content: bytes):
        super().__init__(content=content, media_type="application/json")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        await send(
            {
                "type": "http.response.body",
                "body": self.body[: len(self.body) // 2],
                "more_body": True,
            }
        )
        # returning without completing the body makes uvicorn close the connection

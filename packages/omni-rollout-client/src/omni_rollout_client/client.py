"""``OmniRolloutClient``: the asyncio client a trainer calls thousands of times per step.

Retry policy, and why it is safe for rollouts: a /generate that failed with a 5xx, a dropped
connection or a timeout may still have run on the server, but its output never reached us, and a
rollout sample is consumed exactly once by the caller that awaited it. Re-sending produces one new
sample in its place; each ``generate`` call returns exactly one result, so samples are never lost
or duplicated. Requests dropped by an abort that *this* client issued are not retried (the caller
asked for them to stop): they raise ``GenerationAbortedError``.

Admin calls that move weights (group init, distributed update, disk update) are retried only when
the connection could not be opened, because re-sending a half-processed update could leave the
server waiting for a broadcast the trainer will never send. Read-only and pause/continue calls
retry on every transient failure (an unknown-stage 500 makes sglang-omni close the keep-alive
connection silently; the next pooled request then fails with a read error). A disk update of the
same path under the same version is idempotent, so it is retried on any transient failure within
the same budget; before each retry, and before any weight update is declared failed, the version is
re-read from ``/model_info``: sglang-omni answers a server-side timeout with a 500 although its
scheduler still applies the update.

Every admin call carries a server-side ``timeout_s`` derived from this client's own read timeout
(``Timeouts.server_admin_s``), so the server gives up (and says so) before the client does; the
server's own defaults (disk update 120 s, pause 60 s) would otherwise fail a slow load early.

Requests nobody will read are aborted on the server: sglang-omni 0.1.9 runs a /generate to the end
even after its HTTP request was cancelled or timed out, and has no per-request abort route
(``/abort_request`` is a 404, and no request id is returned either). The only abort is
``pause_generation("abort")``, which drops every request on the engine. So the client counts such
orphans and, as soon as none of its own requests is in flight (new ones wait meanwhile), reads the
thinker's load from ``/model_info``: nothing running -> nothing to do; at most as many requests as
orphans, engine not paused -> they can only be ours, so ``pause_generation("abort")`` +
``continue_generation``; more than that, or the engine paused by another caller (e.g. a weight
update that retracted requests it wants finished) -> the orphans are left to run and counted in
``orphans_spared``. Nothing another caller still needs is aborted (bar a request that arrives
between that read and the pause, which an ``OmniRolloutClient`` retries: the abort was not its own).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import httpx

from .admin import (
    DEFAULT_STAGES,
    PAUSE_MODES,
    AdminReply,
    RankPlan,
    admin_failure,
    parse_admin_reply,
    plan_weight_sync_ranks,
)
from .errors import (
    AdminAuthError,
    ClientValidationError,
    ConflictError,
    ContractError,
    GenerationAbortedError,
    NotSupportedError,
    ResponseContractError,
    RouteNotFoundError,
    ServerResponseError,
    TransientServerError,
)
from .payload import QWEN3_OMNI_MEDIA_IDS, MediaTokenIds, PreparedPrompt, build_generate_body
from .result import GenerateResult, concat_results, parse_generate_response
from .retry import RetryPolicy
from .sampling import filter_sampling_params

log = logging.getLogger(__name__)


class Retry(Enum):
    """What a route may retry."""

    ALL = "all"  # 5xx (not 501), connection errors, timeouts
    CONNECT = "connect"  # only when the request provably never reached the server
    NONE = "none"


# httpcore's pool rescans all of its connections (a socket check each) and all of its queued
# requests whenever a request enters or leaves it: per batch, cost ~ requests x connections. At 64
# concurrent /generate on one pool that was half of the client's CPU, on the thread (and under the
# GIL) that a trainer in the same process needs. Generation requests therefore spread over pools
# of POOL_CONNECTIONS connection(s) each: with one, a request's pool holds only its own
# connection (measured, 64 /generate against the fake: 0.100 s of client CPU at 8 per pool, 0.070 s
# at 1).
POOL_CONNECTIONS = 1
ADMIN_CONNECTIONS = 8

# Headers of a /generate sent by ``_send_direct`` (besides Host, Content-Type, Content-Length).
# No Accept-Encoding: the JSON answer comes back uncompressed (no gzip work on either side).
_DIRECT_HEADERS = {"Accept": "application/json", "User-Agent": "omni-rollout-client"}

_CONNECT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)

# A read timeout means the server got the whole request and may still be working on it.
_ORPHANING_ERRORS = (httpx.ReadTimeout,)

# Seconds the server-side admin timeout stays below the client's read timeout, so the server's
# answer (a 500 after its own timeout) arrives before the client stops listening.
SERVER_TIMEOUT_MARGIN_S = 5.0


@dataclass(frozen=True)
class Timeouts:
    """Seconds. ``generate`` reads may wait through a pause (requests block until continue);
    ``admin`` covers group init, which blocks until the trainer joins the NCCL group."""

    connect: float = 10.0
    write: float = 120.0
    generate: float = 1800.0
    admin: float = 600.0
    pool: float | None = None

    @property
    def server_admin_s(self) -> float:
        """The ``timeout_s`` sent with every admin call: a little below ``admin`` (at least 90% of
        it), so the server's timeout fires first and its reply still reaches us."""
        return max(self.admin * 0.9, self.admin - SERVER_TIMEOUT_MARGIN_S, 0.1)


@dataclass(frozen=True)
class HealthStatus:
    ok: bool
    status_code: int
    body: Any


@dataclass(frozen=True)
class ModelInfo:
    weight_version: str | None
    model_path: str | None
    load_format: str | None
    thinker_tp_sizes: tuple[int, ...]  # one per worker (one entry on a bare worker)
    reply: AdminReply = field(repr=False)


async def _aiter_chunks(chunks: Sequence[bytes]) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield chunk


# Body chunks below this size are joined before sending: each chunk is one awaited socket write
# (with its own cancel scope), ~20 per /generate body. Larger ones (the encoded media) are sent
# as they are, shared by every sample of the group.
COALESCE_BYTES = 1 << 16


def coalesce(chunks: Sequence[bytes], limit: int = COALESCE_BYTES) -> list[bytes]:
    """``chunks`` with every run of small ones joined into one; ``b"".join`` is unchanged."""
    out: list[bytes] = []
    run: list[bytes] = []
    for chunk in chunks:
        if len(chunk) >= limit:
            if run:
                out.append(b"".join(run))
                run = []
            out.append(chunk)
        else:
            run.append(chunk)
    if run:
        out.append(b"".join(run))
    return out


def _response_body(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return response.text


def _detail(body: Any) -> Any:
    if isinstance(body, Mapping):
        if "detail" in body:
            return body["detail"]
        if isinstance(body.get("error"), Mapping):
            return body["error"].get("message", body["error"])
    return body


_STATUS_ERRORS: dict[int, type[ServerResponseError]] = {
    400: ContractError,
    422: ContractError,
    401: AdminAuthError,
    403: AdminAuthError,
    404: RouteNotFoundError,
    409: ConflictError,
    413: ContractError,
    501: NotSupportedError,
}


class OmniRolloutClient:
    """Async client for one sglang-omni worker or its router.

    Use as ``async with OmniRolloutClient(url) as client:``. ``max_concurrency`` bounds in-flight
    /generate requests (admin calls bypass it so a pause is never stuck behind rollouts).
    """

    def __init__(
        self,
        base_url: str,
        *,
        admin_api_key: str | None = None,
        max_concurrency: int = 256,
        retry: RetryPolicy | None = None,
        timeouts: Timeouts | None = None,
        max_connections: int | None = None,
        max_keepalive_connections: int | None = None,
        stages: Sequence[str] | None = DEFAULT_STAGES,
        model: str | None = None,
        vocab_size: int | None = None,
        seed: int | None = None,
        media_ids: MediaTokenIds | None = QWEN3_OMNI_MEDIA_IDS,
    ):
        """``media_ids``: the checkpoint's media placeholder ids, used to refuse interleaved
        audio-in-video prompts (the released Qwen3-Omni ids by default)."""
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency: expected >= 1, got {max_concurrency}")
        self.base_url = base_url.rstrip("/")
        self.__admin_api_key = admin_api_key or None
        self.max_concurrency = max_concurrency
        self.retry = retry or RetryPolicy()
        self.timeouts = timeouts or Timeouts()
        self.stages = list(stages) if stages is not None else None
        self.model = model
        self.vocab_size = vocab_size
        self.media_ids = media_ids
        self._rng = random.Random(seed)
        self._slots = asyncio.Semaphore(max_concurrency)
        self._abort_epoch = 0
        # /generate requests on the wire, and ones given up (cancelled, read timeout) that the
        # server may still be running; see the module docstring.
        self._in_flight = 0
        self._orphans = 0
        # What became of them: aborted by us, found already finished, or left running because
        # the server also held requests that were not ours (see ``_reap_orphans``).
        self.orphans_aborted = 0
        self.orphans_finished = 0
        self.orphans_spared = 0
        self._reaping: asyncio.Event | None = None
        self._reap_tasks: set[asyncio.Task[None]] = set()
        generation = max_connections or max_concurrency
        self._per_pool = max(1, min(POOL_CONNECTIONS, generation))
        pools = -(-generation // self._per_pool)
        keepalive = max_keepalive_connections or generation
        self._pool_keepalive = max(1, min(self._per_pool, keepalive // pools))
        # One TLS context for all pools (httpx would build one per pool); pools open on first use.
        self._ssl = httpx.create_ssl_context()
        self._pools: list[httpx.AsyncClient | None] = [None] * pools
        self._pool_load = [0] * pools
        # Admin calls have a pool of their own: a pause is never queued behind rollouts.
        self._http = self._pool(ADMIN_CONNECTIONS, ADMIN_CONNECTIONS)
        self._urls: dict[str, httpx.URL] = {}  # route -> absolute URL (parsed once)

    def _pool(self, connections: int, keepalive: int) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=self.base_url,
            verify=self._ssl,
            limits=httpx.Limits(max_connections=connections, max_keepalive_connections=keepalive),
            timeout=httpx.Timeout(
                connect=self.timeouts.connect,
                read=self.timeouts.admin,
                write=self.timeouts.write,
                pool=self.timeouts.pool,
            ),
        )

    @contextlib.contextmanager
    def _generation_pool(self) -> Iterator[httpx.AsyncClient]:
        """The least busy generation pool. Every /generate attempt holds one of
        ``max_concurrency`` slots and the pools together hold that many connections (unless
        ``max_connections`` says fewer), so the least busy pool has a free connection: nothing
        waits in httpcore's queue."""
        index = min(range(len(self._pools)), key=self._pool_load.__getitem__)
        pool = self._pools[index]
        if pool is None:
            pool = self._pools[index] = self._pool(self._per_pool, self._pool_keepalive)
        self._pool_load[index] += 1
        try:
            yield pool
        finally:
            self._pool_load[index] -= 1

    @property
    def is_closed(self) -> bool:
        return self._http.is_closed and all(p is None or p.is_closed for p in self._pools)

    def __repr__(self) -> str:
        key = "<redacted>" if self.__admin_api_key else None
        return f"OmniRolloutClient(base_url={self.base_url!r}, admin_api_key={key}, max_concurrency={self.max_concurrency})"

    async def __aenter__(self) -> OmniRolloutClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._orphans and not self._in_flight:
            self._schedule_reap()
        if self._reap_tasks:
            await asyncio.gather(*self._reap_tasks, return_exceptions=True)
        for pool in (*self._pools, self._http):
            if pool is not None:
                await pool.aclose()

    def clone_for(self, base_url: str) -> OmniRolloutClient:
        """A client for another server with the same settings (e.g. one router worker)."""
        return OmniRolloutClient(
            base_url,
            admin_api_key=self.__admin_api_key,
            max_concurrency=self.max_concurrency,
            retry=self.retry,
            timeouts=self.timeouts,
            stages=self.stages,
            model=self.model,
            vocab_size=self.vocab_size,
            media_ids=self.media_ids,
        )

    # ------------------------------------------------------------------ transport

    def _admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.__admin_api_key}"} if self.__admin_api_key else {}

    async def _send(
        self,
        method: str,
        route: str,
        *,
        chunks: Sequence[bytes] | None = None,
        json_body: Any = None,
        admin: bool,
        retry: Retry,
        read_timeout: float,
        abort_epoch: int | None = None,
        limited: bool = False,
        generation: bool = False,
    ) -> tuple[int, Any, int]:
        """Send with retries; return ``(status, body, attempts)`` for 2xx, raise otherwise.

        ``limited`` requests hold a concurrency slot per attempt (not during backoff sleeps);
        ``abort_epoch`` marks a /generate whose failure after our own abort must not be retried.
        ``generation`` attempts are counted in flight; one cancelled or timed out on the read is an
        orphan the server keeps running (aborted once nothing of ours is in flight).
        """
        headers = self._admin_headers() if admin else {}
        if chunks is not None:
            chunks = coalesce(chunks)
        timeout = httpx.Timeout(
            connect=self.timeouts.connect,
            read=read_timeout,
            write=self.timeouts.write,
            pool=self.timeouts.pool,
        )
        attempt = 0
        while True:
            attempt += 1
            failure: str
            status: int | None = None
            body: Any = None
            try:
                content = headers_for_body = None
                if chunks is not None:
                    content = _aiter_chunks(chunks)  # a fresh stream per attempt, same buffers
                    headers_for_body = {
                        "Content-Type": "application/json",
                        "Content-Length": str(sum(len(c) for c in chunks)),
                    }
                async with self._slots if limited else contextlib.nullcontext():
                    pool = (
                        self._generation_pool() if limited else contextlib.nullcontext(self._http)
                    )
                    if generation:
                        await self._not_reaping()
                        self._in_flight += 1
                    request_headers = {**headers, **(headers_for_body or {})}
                    try:
                        with pool as http:
                            if limited and chunks is not None:
                                response = await self._send_direct(
                                    http, method, route, content, request_headers, timeout
                                )
                            else:
                                response = await http.request(
                                    method,
                                    route,
                                    content=content,
                                    json=json_body if chunks is None else None,
                                    headers=request_headers,
                                    timeout=timeout,
                                )
                    except (asyncio.CancelledError, *_ORPHANING_ERRORS):
                        if generation:
                            self._orphans += 1
                        raise
                    finally:
                        if generation:
                            self._in_flight -= 1
                            if self._orphans and not self._in_flight:
                                self._schedule_reap()
            except httpx.TransportError as exc:
                retryable = retry is Retry.ALL or (
                    retry is Retry.CONNECT and isinstance(exc, _CONNECT_ERRORS)
                )
                failure = f"{type(exc).__name__}: {exc}"
            else:
                status, body = response.status_code, _response_body(response)
                if status < 300:
                    return status, body, attempt
                # A router broadcast answers 502 when any worker failed: the per-worker bodies
                # carry the real reason (e.g. active requests), so it is not a transient error.
                broadcast = isinstance(body, Mapping) and "worker_count" in body
                if status < 500 or status == 501 or broadcast:
                    raise self._error(route, status, body)
                retryable = retry is Retry.ALL
                failure = f"HTTP {status}: {_detail(body)!r}"[:500]
            if abort_epoch is not None and self._abort_epoch != abort_epoch:
                raise GenerationAbortedError(
                    f"{route}: request dropped by pause_generation(mode='abort') issued through this client ({failure})"
                )
            if not retryable or attempt >= self.retry.max_attempts:
                raise TransientServerError(
                    f"{method} {route} failed after {attempt} attempt(s): {failure}",
                    route=route,
                    status_code=status,
                    attempts=attempt,
                    detail=_detail(body),
                )
            await asyncio.sleep(self.retry.delay(attempt, self._rng))

    async def _send_direct(
        self,
        http: httpx.AsyncClient,
        method: str,
        route: str,
        content: AsyncIterator[bytes],
        headers: Mapping[str, str],
        timeout: httpx.Timeout,
    ) -> httpx.Response:
        """One /generate attempt through the transport ``http`` would pick for the URL (its
        proxy, if the environment names one), read to the end.

        ``AsyncClient.send`` wraps every request in work that a /generate does not use: URL
        merging, the client's default headers, the auth and redirect flows and cookie
        extraction. That was ~40% of the client's CPU per request (py-spy, 64 concurrent
        /generate against the fake), all of it on the thread that shares the GIL with a
        trainer in the same process. httpx's own transport still maps every httpcore error to
        the httpx exception ``_send`` handles, so retries and orphan counting are unchanged.
        """
        url = self._urls.get(route)
        if url is None:
            url = self._urls[route] = httpx.URL(self.base_url + route)
        request = httpx.Request(
            method,
            url,
            content=content,
            headers={**_DIRECT_HEADERS, **headers},
            extensions={"timeout": timeout.as_dict()},
        )
        response = await http._transport_for_url(url).handle_async_request(request)
        response.request = request
        try:
            await response.aread()
        except BaseException:
            await response.aclose()
            raise
        return response

    async def _not_reaping(self) -> None:
        if self._reaping is not None:
            await self._reaping.wait()

    def _schedule_reap(self) -> None:
        """Called when orphans exist and none of our requests is on the wire: hold new sends
        (synchronously, so none slips in) and abort in the background."""
        if self._reaping is None:
            self._reaping = asyncio.Event()
            self._reaping.set()
        if not self._reaping.is_set():
            return  # one already running
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no running loop (interpreter shutdown): nothing we can send
            return
        self._reaping.clear()
        task = loop.create_task(self._reap_orphans())
        self._reap_tasks.add(task)
        task.add_done_callback(self._reap_tasks.discard)

    async def _reap_orphans(self) -> None:
        """Abort what the server still runs for requests we gave up. It does not bump the abort
        epoch: none of our requests is in flight, and a retry waiting to be sent is still wanted."""
        assert self._reaping is not None
        orphans, self._orphans = self._orphans, 0
        try:
            # 0.1.9 has no per-request abort, so pause(abort) drops EVERY request on the server.
            # Nothing of ours is in flight, so whatever the thinker still runs is either our
            # orphans or someone else's: abort only when it can all be ours, and never while the
            # engine is paused by someone else (a retract-paused update's requests must finish).
            active, paused = await self._thinker_load()
            if active == 0:
                self.orphans_finished += orphans
                return
            if paused or active > orphans:
                self.orphans_spared += orphans
                log.warning(
                    "%s: %d abandoned /generate request(s) left running: the server runs %d "
                    "request(s)%s, and sglang-omni 0.1.9 can only abort all of them",
                    self.base_url,
                    orphans,
                    active,
                    " and is paused by another caller" if paused else " (others' among them)",
                )
                return
            try:
                await self._admin("/pause_generation", {"mode": "abort"}, retry=Retry.ALL)
            finally:
                await self.continue_generation()
            self.orphans_aborted += orphans
            log.info(
                "%s: aborted %d abandoned /generate request(s) still running on the server",
                self.base_url,
                orphans,
            )
        except Exception as exc:  # noqa: BLE001 - best effort; the caller's own error matters more
            log.warning(
                "%s: could not abort %d abandoned /generate request(s): %s",
                self.base_url,
                orphans,
                exc,
            )
        finally:
            self._reaping.set()

    async def _thinker_load(self) -> tuple[int, bool]:
        """Requests the thinker holds (running + waiting, summed over workers) and whether it is
        paused, from a scoped ``/model_info``."""
        data = (await self.model_info()).reply.stage_data("thinker")
        active = sum(
            int(d.get("running_batch_size") or 0) + int(d.get("waiting_queue_size") or 0)
            for d in data
        )
        return active, any(bool(d.get("engine_paused")) for d in data)

    @staticmethod
    def _error(route: str, status: int, body: Any) -> ServerResponseError:
        detail = _detail(body)
        if isinstance(detail, Mapping) and "results" in detail:  # failed admin envelope
            return admin_failure(parse_admin_reply(route, status, body))
        cls = _STATUS_ERRORS.get(status, ContractError)
        hint = (
            " (sglang-omni has no such route; plain-sglang routes are not served)"
            if status == 404
            else ""
        )
        return cls(
            f"{route}: HTTP {status}: {detail!r}{hint}"[:2000],
            route=route,
            status_code=status,
            detail=detail,
        )

    # ------------------------------------------------------------------ generation

    def prepare(
        self,
        input_ids: Any,
        mm: Mapping[str, Any] | None = None,
        *,
        bf16: bool | Sequence[str] = True,
        use_audio_in_video: bool = False,
    ) -> PreparedPrompt:
        """Validate and encode a prompt once (see ``PreparedPrompt.build``); audio-in-video
        prompts are refused (the 0.1.9 server has no audio-in-video field)."""
        return PreparedPrompt.build(
            input_ids,
            mm,
            bf16=bf16,
            vocab_size=self.vocab_size,
            use_audio_in_video=use_audio_in_video,
            media_ids=self.media_ids,
        )

    async def generate(
        self,
        prompt: PreparedPrompt | Sequence[int] | Any,
        sampling_params: Mapping[str, Any] | None = None,
        *,
        metadata: Mapping[str, Any] | None = None,
        max_resumes: int = 0,
    ) -> GenerateResult:
        """One completion. Text-only output, logprobs always on.

        ``sampling_params['max_new_tokens']`` (or ``max_tokens``) is required: without it
        sglang-omni silently applies its own default (2048), and a sample's budget must be known
        to resume it. ``max_resumes`` > 0 continues a sample the server finished with ``abort``
        (up to that many times) using the remaining token budget; see ``resume``.
        """
        if not isinstance(prompt, PreparedPrompt):
            prompt = PreparedPrompt.build(
                prompt, None, vocab_size=self.vocab_size, media_ids=self.media_ids
            )
        sampling = filter_sampling_params(sampling_params)
        if "max_new_tokens" not in sampling:
            raise ClientValidationError(
                "sampling_params['max_new_tokens'] is required (the sample's token budget; "
                "sglang-omni would otherwise apply its own default of 2048)"
            )
        chunks = build_generate_body(prompt, sampling, metadata=metadata, model=self.model)
        _, body, attempts = await self._send(
            "POST",
            "/generate",
            chunks=chunks,
            admin=False,
            retry=Retry.ALL,
            read_timeout=self.timeouts.generate,
            abort_epoch=self._abort_epoch,
            limited=True,
            generation=True,
        )
        result = parse_generate_response(body, attempts=attempts)
        if result.prompt_tokens != len(prompt.input_ids):
            raise ResponseContractError(
                f"/generate: prompt_tokens={result.prompt_tokens} but {len(prompt.input_ids)} input_ids were sent",
                route="/generate",
                status_code=200,
                detail=body,
            )
        resumes = 0
        while result.finish_reason == "abort" and resumes < max_resumes:
            resumes += 1
            result = await self.resume(prompt, result, sampling_params, metadata=metadata)
        return result

    async def resume(
        self,
        prompt: PreparedPrompt,
        partial: GenerateResult,
        sampling_params: Mapping[str, Any] | None = None,
        *,
        metadata: Mapping[str, Any] | None = None,
    ) -> GenerateResult:
        """Continue an aborted or truncated sample: prompt + already generated ids as the new
        prompt, ``max_new_tokens`` reduced by what was generated, results concatenated.

        ``sampling_params['max_new_tokens']`` is the sample's TOTAL budget. A sample that stopped
        naturally, or already used the whole budget, is returned unchanged.
        """
        sampling = filter_sampling_params(sampling_params)
        if "max_new_tokens" not in sampling:
            raise ClientValidationError(
                "resume: sampling_params must give max_new_tokens (the sample's total token budget)"
            )
        remaining = sampling["max_new_tokens"] - len(partial.token_ids)
        if partial.finish_reason == "stop" or remaining <= 0:
            return partial
        continuation = await self.generate(
            prompt.continued(partial.token_ids),
            {**sampling, "max_new_tokens": remaining},
            metadata=metadata,
        )
        return concat_results(partial, continuation)

    async def generate_group(
        self,
        prompt: PreparedPrompt,
        n: int,
        sampling_params: Mapping[str, Any] | None = None,
        *,
        seeds: Sequence[int] | None = None,
        metadata: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
        max_resumes: int = 0,
    ) -> list[GenerateResult]:
        """``n`` samples of one prompt, encoded once, in order. If any sample fails for good the
        others are cancelled and the error raised (a group is never returned short)."""
        sampling = dict(sampling_params or {})
        if seeds is not None:
            if len(seeds) != n:
                raise ClientValidationError(f"seeds: expected {n} seeds, got {len(seeds)}")
        elif sampling.get("seed") is not None and n > 1:
            raise ClientValidationError(
                "sampling_params['seed'] with n > 1 would give n identical samples; pass seeds=[...] instead"
            )
        if metadata is None or isinstance(metadata, Mapping):
            metadatas = [metadata] * n
        else:
            metadatas = list(metadata)
            if len(metadatas) != n:
                raise ClientValidationError(
                    f"metadata: expected {n} mappings, got {len(metadatas)}"
                )
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [
                    tg.create_task(
                        self.generate(
                            prompt,
                            sampling if seeds is None else {**sampling, "seed": seeds[i]},
                            metadata=metadatas[i],
                            max_resumes=max_resumes,
                        )
                    )
                    for i in range(n)
                ]
        except BaseExceptionGroup as group:
            # Surface the first real failure as itself (callers catch our typed errors, not
            # ExceptionGroup); the siblings it cancelled are not errors of their own.
            raise group.exceptions[0] from group
        return [t.result() for t in tasks]

    # ------------------------------------------------------------------ health and info

    async def health(self) -> HealthStatus:
        """``GET /health`` (never /health_generate or /get_server_info: sglang-omni has neither)."""
        try:
            response = await self._http.get("/health", timeout=self.timeouts.connect + 5)
        except httpx.TransportError as exc:
            return HealthStatus(ok=False, status_code=0, body=f"{type(exc).__name__}: {exc}")
        return HealthStatus(
            ok=response.status_code == 200,
            status_code=response.status_code,
            body=_response_body(response),
        )

    async def wait_until_ready(
        self, timeout_s: float = 600.0, poll_s: float = 1.0, *, check_model_info: bool = True
    ) -> HealthStatus:
        """Poll /health until 200 (0.1.9 answers 503 "starting" while loading), then, with
        ``check_model_info``, until /model_info answers too (fork-main servers report healthy
        before every stage has loaded; upstream's own e2e test waits on /model_info)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        last: object = None
        while True:
            status = await self.health()
            last = (status.status_code, status.body)
            if status.ok:
                if not check_model_info:
                    return status
                try:
                    await self.model_info()
                    return status
                except (TransientServerError, ContractError) as exc:
                    if isinstance(exc, AdminAuthError):
                        raise
                    last = f"/model_info: {exc}"
            if loop.time() >= deadline:
                raise TransientServerError(
                    f"server not ready after {timeout_s}s: {last!r}"[:1000],
                    route="/health",
                    status_code=status.status_code or None,
                    attempts=0,
                )
            await asyncio.sleep(poll_s)

    async def model_info(self, stages: Sequence[str] | None | bool = True) -> ModelInfo:
        """``/model_info``: weight version, model path, and the thinker TP size per worker.

        Scoped like pause/continue (default: this client's ``stages``, i.e. the thinker): 0.1.9
        aggregates ``weight_version`` over every stage it is asked about and answers 409 when they
        differ, which on a speech pipeline is always the case after a thinker-only update (the
        talker keeps its version). ``stages=None`` asks every stage (GET, the server's default).
        """
        scope = self.stages if stages is True else (None if stages is False else stages)
        if scope is None:
            _, body, _ = await self._send(
                "GET", "/model_info", admin=True, retry=Retry.ALL, read_timeout=self.timeouts.admin
            )
        else:
            _, body, _ = await self._send(
                "POST",
                "/model_info",
                json_body={"stages": list(scope), "timeout_s": self.timeouts.server_admin_s},
                admin=True,
                retry=Retry.ALL,
                read_timeout=self.timeouts.admin,
            )
        if not isinstance(body, Mapping):
            raise ResponseContractError(
                f"/model_info: expected a JSON object, got {str(body)[:200]!r}",
                route="/model_info",
                status_code=200,
                detail=body,
            )
        reply = parse_admin_reply("/model_info", 200, body)
        tp = tuple(
            int(d["stage_tp_size"])
            for d in reply.stage_data("thinker")
            if d.get("stage_tp_size") is not None
        )
        return ModelInfo(
            weight_version=body.get("weight_version"),
            model_path=body.get("model_path"),
            load_format=body.get("load_format"),
            thinker_tp_sizes=tp,
            reply=reply,
        )

    async def weight_version(self) -> str | None:
        return (await self.model_info()).weight_version

    async def list_workers(self) -> list[dict[str, Any]]:
        """Router only: ``GET /workers`` (a bare worker answers 404)."""
        _, body, _ = await self._send(
            "GET", "/workers", admin=False, retry=Retry.ALL, read_timeout=self.timeouts.admin
        )
        return list(body.get("workers") or [])

    async def worker_clients(self) -> list[OmniRolloutClient]:
        """One client per routable router worker (multi-replica refit must address each)."""
        return [
            self.clone_for(w["url"]) for w in await self.list_workers() if w.get("routable", True)
        ]

    # ------------------------------------------------------------------ pause / continue

    async def _admin(
        self,
        route: str,
        payload: dict[str, Any],
        *,
        retry: Retry,
        stages: Sequence[str] | None | bool = True,
    ) -> AdminReply:
        body = dict(payload)
        scope = self.stages if stages is True else stages
        if scope is not None and scope is not False:
            body["stages"] = list(scope)
        body.setdefault("timeout_s", self.timeouts.server_admin_s)
        status, reply_body, _ = await self._send(
            "POST", route, json_body=body, admin=True, retry=retry, read_timeout=self.timeouts.admin
        )
        reply = parse_admin_reply(route, status, reply_body)
        if not reply.success:  # a 2xx whose envelope says failure (defensive; servers send 400/502)
            raise admin_failure(reply)
        return reply

    async def pause_generation(
        self, mode: str, *, stages: Sequence[str] | None | bool = True
    ) -> AdminReply:
        """``abort`` drops every active request (their /generate gets a 500), ``retract`` moves the
        running batch back to the queue (updates then allowed; the requests finish later with the
        new weights), ``in_place`` only pauses. New /generate calls block until continue."""
        if mode not in PAUSE_MODES:
            raise ClientValidationError(
                f"pause_generation: mode must be one of {sorted(PAUSE_MODES)}, got {mode!r}"
            )
        if mode == "abort":
            self._abort_epoch += 1
        return await self._admin(
            "/pause_generation", {"mode": mode}, retry=Retry.ALL, stages=stages
        )

    async def continue_generation(
        self, *, torch_empty_cache: bool = True, stages: Sequence[str] | None | bool = True
    ) -> AdminReply:
        return await self._admin(
            "/continue_generation",
            {"torch_empty_cache": torch_empty_cache},
            retry=Retry.ALL,
            stages=stages,
        )

    async def abort_all(self) -> AdminReply:
        """End-of-rollout abort: pause(abort) then continue (sglang-omni has no /abort_request).
        Continue is sent even if the pause failed, so the engine is not left paused. It also
        clears this client's orphan count (everything running was just dropped)."""
        self._orphans = 0
        try:
            await self.pause_generation("abort")
        finally:
            reply = await self.continue_generation()
        return reply

    # ------------------------------------------------------------------ weight updates

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        world_size: int,
        *,
        rank_offset: int = 0,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> AdminReply:
        """Blocks on the server until the trainer joins the group: run it concurrently with the
        trainer's own ``init_process_group``. On a router with several workers use
        ``init_weights_update_groups`` (one call per worker, distinct rank offsets)."""
        payload = {
            "master_address": master_address,
            "master_port": int(master_port),
            "world_size": int(world_size),
            "rank_offset": int(rank_offset),
            "group_name": group_name,
            "backend": backend,
        }
        return await self._admin("/init_weights_update_group", payload, retry=Retry.CONNECT)

    async def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[Any],
        shapes: Sequence[Sequence[int]],
        *,
        group_name: str = "weight_update_group",
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        weight_version: str | None = None,
        load_format: str | None = None,
    ) -> AdminReply:
        """The trainer must broadcast each tensor from rank 0 in ``names`` order meanwhile.
        Refused (``ActiveRequestsError``) while requests are active unless paused with retract;
        on failure the engine stays paused (``EnginePausedError``)."""
        dtype_names = [str(d).removeprefix("torch.") for d in dtypes]
        if not names or not (len(names) == len(dtype_names) == len(shapes)):
            raise ClientValidationError(
                f"update_weights_from_distributed: names/dtypes/shapes must be non-empty and equal length, got {len(names)}/{len(dtype_names)}/{len(shapes)}"
            )
        if abort_all_requests:
            self._abort_epoch += 1
        payload: dict[str, Any] = {
            "names": list(names),
            "dtypes": dtype_names,
            "shapes": [[int(d) for d in s] for s in shapes],
            "group_name": group_name,
            "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests,
        }
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)
        if load_format is not None:
            payload["load_format"] = load_format
        # Not idempotent (a re-send would wait for a broadcast the trainer will not repeat), but a
        # server-side timeout may still have applied it: re-read the version before failing.
        return await self._weight_update(
            "/update_weights_from_distributed", payload, idempotent=False
        )

    async def destroy_weights_update_group(
        self, group_name: str = "weight_update_group"
    ) -> AdminReply:
        return await self._admin(
            "/destroy_weights_update_group", {"group_name": group_name}, retry=Retry.CONNECT
        )

    async def update_weights_from_disk(
        self,
        model_path: str,
        *,
        weight_version: str | None = None,
        abort_all_requests: bool = False,
        keep_pause: bool = False,
        flush_cache: bool = True,
        load_format: str | None = None,
    ) -> AdminReply:
        if abort_all_requests:
            self._abort_epoch += 1
        payload: dict[str, Any] = {
            "model_path": str(model_path),
            "abort_all_requests": abort_all_requests,
            "keep_pause": keep_pause,
            "flush_cache": flush_cache,
        }
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)
        if load_format is not None:
            payload["load_format"] = load_format
        return await self._weight_update("/update_weights_from_disk", payload, idempotent=True)

    async def _weight_update(
        self, route: str, payload: dict[str, Any], *, idempotent: bool
    ) -> AdminReply:
        """Send a weight update; on a transient failure re-read the version, and retry an
        idempotent one (same path, same version) within ``retry.max_attempts``.

        A 500 or read timeout does not mean the update failed: the server's coordinator times
        out while its scheduler still loads the weights. If ``/model_info`` then reports the
        requested ``weight_version``, the update is done and is not sent again.
        """
        version = payload.get("weight_version")
        attempts = self.retry.max_attempts if idempotent else 1
        attempt = 0
        while True:
            attempt += 1
            try:
                return await self._admin(
                    route, payload, retry=Retry.NONE if idempotent else Retry.CONNECT
                )
            except TransientServerError as exc:
                failure = exc
            applied = version is not None and await self._version_is(version)
            if applied:
                log.warning(
                    "%s %s: %s; /model_info reports weight_version %r, so the update was applied",
                    self.base_url,
                    route,
                    failure,
                    version,
                )
                return AdminReply(
                    route=route,
                    status_code=failure.status_code or 0,
                    success=True,
                    body={"recovered_from": str(failure), "weight_version": version},
                )
            if attempt >= attempts:
                checked = (
                    f"; /model_info does not report weight_version {version!r}"
                    if version is not None
                    else ""
                )
                raise TransientServerError(
                    f"{route} failed after {attempt} attempt(s){checked}: {failure}",
                    route=route,
                    status_code=failure.status_code,
                    attempts=attempt,
                    detail=failure.detail,
                ) from failure
            await asyncio.sleep(self.retry.delay(attempt, self._rng))

    async def _version_is(self, version: str) -> bool:
        try:
            return (await self.model_info()).weight_version == version
        except (ServerResponseError, httpx.TransportError):
            return False

    async def weights_checksum(self) -> AdminReply:
        """``/weights_checker`` checksum (SHA256 over names, dtypes, shapes, bytes) per stage:
        the way to catch names the server dropped silently during a refit."""
        return await self._admin("/weights_checker", {"action": "checksum"}, retry=Retry.ALL)

    # ------------------------------------------------------------------ plain-sglang no-ops

    async def flush_cache(self) -> None:
        """No-op: sglang-omni has no /flush_cache (404); the update requests flush themselves
        (``flush_cache=True``)."""

    async def begin_weight_update(self) -> None:
        """No-op: /begin_weight_update does not exist on sglang-omni (404)."""

    async def end_weight_update(self) -> None:
        """No-op: /end_weight_update does not exist on sglang-omni (404)."""

    async def get_server_info(self) -> None:
        """No-op: /get_server_info is a 404 on sglang-omni (a client that retried it hung the
        original design's attach); use ``model_info()``."""


async def init_weights_update_groups(
    clients: Sequence[OmniRolloutClient],
    master_address: str,
    master_port: int,
    *,
    group_name: str = "weight_update_group",
    backend: str = "nccl",
    tp_sizes: Sequence[int] | None = None,
) -> tuple[RankPlan, list[AdminReply]]:
    """Join several workers to one group: each directly, with its own rank offset (the router
    refuses multi-worker init). The trainer is rank 0 and must run ``init_process_group`` with
    ``plan.world_size`` concurrently (call ``plan_weight_sync_ranks`` first to know it)."""
    if tp_sizes is None:
        infos = await asyncio.gather(*(c.model_info() for c in clients))
        tp_sizes = [max(info.thinker_tp_sizes or (1,)) for info in infos]
    plan = plan_weight_sync_ranks(tp_sizes)
    replies = await asyncio.gather(
        *(
            c.init_weights_update_group(
                master_address,
                master_port,
                plan.world_size,
                rank_offset=offset,
                group_name=group_name,
                backend=backend,
            )
            for c, offset in zip(clients, plan.rank_offsets, strict=True)
        )
    )
    return plan, list(replies)

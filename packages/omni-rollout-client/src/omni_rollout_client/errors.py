"""Typed failures of the sglang-omni RL contract.

Callers branch on the class, not on message text: a ``ContractError`` means "our request is wrong,
retrying cannot help"; a ``TransientServerError`` has already been retried and the budget is spent;
``ActiveRequestsError`` and ``EnginePausedError`` carry the one action that fixes them.
"""

from __future__ import annotations

from typing import Any


class OmniClientError(Exception):
    """Base class for every error this package raises."""


class ClientValidationError(OmniClientError, ValueError):
    """The request was refused locally, before anything was sent (names the offending field)."""


class ServerResponseError(OmniClientError):
    """A non-success HTTP reply. ``detail`` is the server's own explanation, verbatim."""

    def __init__(self, message: str, *, route: str, status_code: int | None, detail: Any = None):
        super().__init__(message)
        self.route = route
        self.status_code = status_code
        self.detail = detail


class ContractError(ServerResponseError):
    """400/422: the server rejected the request itself. Never retried."""


class AdminAuthError(ServerResponseError):
    """401/403 on an admin route: missing or wrong admin API key."""


class RouteNotFoundError(ServerResponseError):
    """404: the route does not exist on sglang-omni (plain-sglang routes such as /flush_cache)."""


class NotSupportedError(ServerResponseError):
    """501: the server knows the route but does not implement it (update_weights_from_tensor, ...)."""


class ConflictError(ServerResponseError):
    """409: mixed weight versions across stages/workers, or a router-side update in progress."""


class TransientServerError(ServerResponseError):
    """5xx, dropped connections or timeouts that outlived the retry budget."""

    def __init__(
        self,
        message: str,
        *,
        route: str,
        status_code: int | None,
        attempts: int,
        detail: Any = None,
    ):
        super().__init__(message, route=route, status_code=status_code, detail=detail)
        self.attempts = attempts


class ResponseContractError(ServerResponseError):
    """A 200 whose body breaks the contract (e.g. 3-element logprob pairs from plain sglang)."""


class GenerationAbortedError(OmniClientError):
    """A /generate in flight was dropped by ``pause_generation(mode="abort")`` issued through this
    client; it is not retried, because the caller asked for the abort."""


class ActiveRequestsError(ContractError):
    """A weight update was refused because requests are active on the engine.

    Fix: ``await client.pause_generation("retract")`` (or ``"abort"``) before updating, or pass
    ``abort_all_requests=True``.
    """

    def __init__(
        self,
        message: str,
        *,
        route: str,
        status_code: int | None,
        detail: Any = None,
        active_request_ids: list[str] | None = None,
    ):
        super().__init__(message, route=route, status_code=status_code, detail=detail)
        self.active_request_ids = active_request_ids or []


class WeightUpdateError(ContractError):
    """The server ran a weight update and it failed (see ``detail`` for each stage's reason)."""

    def __init__(
        self,
        message: str,
        *,
        route: str,
        status_code: int | None,
        detail: Any = None,
        engine_paused: bool | None = None,
    ):
        super().__init__(message, route=route, status_code=status_code, detail=detail)
        self.engine_paused = engine_paused


class EnginePausedError(WeightUpdateError):
    """A failed ``update_weights_from_distributed`` leaves the engine paused (sglang-omni keeps it
    paused on purpose). Call ``continue_generation()`` once the weights are in a known state."""

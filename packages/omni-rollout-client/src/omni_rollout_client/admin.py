"""Admin replies of a sglang-omni worker or router, unified, and failure -> typed error.

A worker answers ``{op_id, action, success, message, results: [per-stage]}`` (on failure the same
dict under ``detail`` with status 400). The router broadcasts to every live worker and answers
``{success, message, path, worker_count, results: [{worker, success, status_code, body}]}``
(502 if any worker failed). ``AdminReply`` flattens both into per-stage results tagged with the
worker, so callers and error mapping see one shape.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import ActiveRequestsError, ContractError, EnginePausedError, WeightUpdateError

# Default admin stage scope: only the thinker joins weight-update groups (a speech pipeline's
# talker would otherwise join with the same rank offset and collide).
DEFAULT_STAGES: tuple[str, ...] = ("thinker",)

PAUSE_MODES = frozenset({"abort", "retract", "in_place"})

# Update routes: failure -> WeightUpdateError; the distributed one leaves the engine paused.
UPDATE_ROUTES = frozenset(
    {
        "/update_weights_from_distributed",
        "/update_weights_from_disk",
        "/init_weights_update_group",
        "/destroy_weights_update_group",
    }
)
PAUSED_ON_FAILURE_ROUTES = frozenset({"/update_weights_from_distributed"})


@dataclass(frozen=True)
class StageResult:
    worker: str | None
    stage: str | None
    success: bool
    message: str
    data: dict[str, Any]
    error: str | None


@dataclass(frozen=True)
class AdminReply:
    """A parsed admin reply (worker or router)."""

    route: str
    status_code: int
    success: bool
    body: Any = field(repr=False)
    stages: list[StageResult] = field(default_factory=list, repr=False)

    def stage_data(self, stage: str = "thinker") -> list[dict[str, Any]]:
        """``data`` of every non-skipped result of ``stage`` (one per worker)."""
        return [r.data for r in self.stages if r.stage == stage and not r.data.get("skipped")]


def _envelope_stages(envelope: Any, worker: str | None) -> list[StageResult]:
    if isinstance(envelope, Mapping) and isinstance(envelope.get("detail"), Mapping):
        envelope = envelope["detail"]
    if not isinstance(envelope, Mapping):
        return []
    out = []
    for item in envelope.get("results") or []:
        if isinstance(item, Mapping):
            out.append(
                StageResult(
                    worker=worker,
                    stage=item.get("stage"),
                    success=bool(item.get("success")),
                    message=str(item.get("message") or ""),
                    data=dict(item.get("data") or {}),
                    error=item.get("error"),
                )
            )
    return out


def parse_admin_reply(route: str, status_code: int, body: Any) -> AdminReply:
    """Flatten a worker envelope or a router broadcast into per-stage results."""
    is_router = isinstance(body, Mapping) and "worker_count" in body
    stages: list[StageResult] = []
    if is_router:
        for item in body.get("results") or []:
            if isinstance(item, Mapping):
                stages.extend(_envelope_stages(item.get("body"), str(item.get("worker"))))
        success = bool(body.get("success")) and status_code < 300
    else:
        stages = _envelope_stages(body, None)
        envelope = (
            body.get("detail")
            if isinstance(body, Mapping) and isinstance(body.get("detail"), Mapping)
            else body
        )
        success = status_code < 300 and bool(
            isinstance(envelope, Mapping) and envelope.get("success", False)
        )
    return AdminReply(
        route=route, status_code=status_code, success=success, body=body, stages=stages
    )


def _summary(reply: AdminReply) -> str:
    failed = [r for r in reply.stages if not r.success]
    parts = [
        f"{r.worker + ' ' if r.worker else ''}{r.stage}: {r.error or r.message}" for r in failed
    ]
    if isinstance(reply.body, Mapping) and "worker_count" in reply.body:
        # router: workers that failed without a stage envelope (transport error, plain-text 500)
        for item in reply.body.get("results") or []:
            if (
                isinstance(item, Mapping)
                and not item.get("success")
                and not _envelope_stages(item.get("body"), None)
            ):
                reason = item.get("error") or item.get("body") or f"HTTP {item.get('status_code')}"
                parts.append(f"{item.get('worker')}: {str(reason)[:300]}")
    if not parts and isinstance(reply.body, Mapping):
        detail = reply.body.get("detail", reply.body)
        parts = [str(detail.get("message") if isinstance(detail, Mapping) else detail)]
    return "; ".join(parts) or "no reason given"


def admin_failure(reply: AdminReply) -> ContractError:
    """The typed error for a failed admin reply (400 from a worker, 502 from a router)."""
    route, status = reply.route, reply.status_code
    active = [
        r
        for r in reply.stages
        if not r.success
        and ("active_request_ids" in r.data or "active requests" in (r.error or r.message))
    ]
    if active and route in UPDATE_ROUTES:
        ids = [i for r in active for i in r.data.get("active_request_ids", [])]
        return ActiveRequestsError(
            f"{route} refused: requests are active on the engine ({_summary(reply)}). "
            "Call pause_generation('retract') (or 'abort') first, or pass abort_all_requests=True.",
            route=route,
            status_code=status,
            detail=reply.body,
            active_request_ids=ids,
        )
    # what the stages that say so report of the engine's pause after the failure
    paused = [
        r.data.get("engine_paused") for r in reply.stages if r.data.get("engine_paused") is not None
    ]
    if route in PAUSED_ON_FAILURE_ROUTES:
        return EnginePausedError(
            f"{route} failed ({_summary(reply)}); sglang-omni leaves the engine PAUSED after a failed distributed update: call continue_generation() once the weights are consistent.",
            route=route,
            status_code=status,
            detail=reply.body,
            engine_paused=any(paused) if paused else True,
        )
    if route in UPDATE_ROUTES:
        return WeightUpdateError(
            f"{route} failed: {_summary(reply)}",
            route=route,
            status_code=status,
            detail=reply.body,
            engine_paused=any(paused) if paused else None,
        )
    return ContractError(
        f"{route} failed: {_summary(reply)}", route=route, status_code=status, detail=reply.body
    )


@dataclass(frozen=True)
class RankPlan:
    """NCCL ranks for one trainer (rank 0) and several servers' thinker TP ranks."""

    world_size: int
    rank_offsets: tuple[int, ...]


def plan_weight_sync_ranks(tp_sizes: Sequence[int], *, trainer_ranks: int = 1) -> RankPlan:
    """``world_size = trainer_ranks + sum(tp)``; server k starts at ``trainer_ranks + sum(tp[:k])``.

    The router refuses group init with more than one live worker, so each worker must be called
    directly with its own offset.
    """
    if not tp_sizes or any(int(t) < 1 for t in tp_sizes):
        raise ValueError(f"tp_sizes: expected a non-empty list of ints >= 1, got {list(tp_sizes)}")
    if trainer_ranks < 1:
        raise ValueError(f"trainer_ranks: expected >= 1, got {trainer_ranks}")
    offsets, next_rank = [], trainer_ranks
    for tp in tp_sizes:
        offsets.append(next_rank)
        next_rank += int(tp)
    return RankPlan(world_size=next_rank, rank_offsets=tuple(offsets))

"""Does the run's layout fit the Ray it runs on? Checked before anything starts.

An actor that asks for more than any node has (``rollout.embedded.cpus_per_actor: 3`` on a Ray
of 2 CPUs) is never placed, and Ray does not say so: the driver waited for its start-up for the
whole start-up deadline (20 minutes by default) with no error. Now:

* :func:`check_resources` compares what every actor asks for (CPUs, GPUs per trainer rank,
  rollout actor and launched server; the trainer's placement group as a whole when it must
  share one node) with what the nodes have, and refuses in one line naming the config field;
* :func:`check_local_resources` runs it against the Ray ``train`` would start on this machine
  (``ray.num_cpus``, else the cores; the GPUs torch sees) — from ``--plan`` and at the very
  start of ``train``, before anything is prepared;
* :func:`check_cluster_resources` runs it against what a running Ray reports (``ray.nodes()``)
  right after the driver joins it;
* :func:`pending_actors` names the actors Ray still has not placed, for the start-up waits: one
  that stays pending past ``ray.start_timeout_s`` (the cluster is busy, or a node went away)
  stops the run with the same kind of line instead of waiting for the whole deadline.

The actors ask for no memory (Ray's ``memory`` resource), so there is no memory to compare.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from omni_grpo.ray.placement import PlacementError, PlacementPlan, plan_run


@dataclass(frozen=True)
class ActorRequest:
    """What ``count`` actors of one role ask Ray for, each, and the fields that set it."""

    role: str
    count: int
    cpus: float
    gpus: float
    cpu_field: str
    gpu_field: str
    count_field: str


def actor_requests(plan: PlacementPlan, cfg: Any) -> list[ActorRequest]:
    """Every role's request in ``plan`` (the values ``omni_grpo.ray.driver`` starts them with)."""
    out = [
        ActorRequest(
            "trainer rank",
            plan.world_size,
            float(plan.bundles[0].get("CPU", 0.0)) if plan.bundles else 0.0,
            float(plan.bundles[0].get("GPU", 0.0)) if plan.bundles else 0.0,
            "ray.cpus_per_trainer",
            "ray.gpus_per_trainer",
            "trainer.world_size",
        )
    ]
    actors = sum(1 for s in plan.servers if s.role == "embedded")
    if actors:
        out.append(
            ActorRequest(
                "rollout actor",
                actors,
                float(cfg.rollout.embedded.cpus_per_actor),
                float(cfg.rollout.embedded.gpus_per_actor) if plan.device == "GPU" else 0.0,
                "rollout.embedded.cpus_per_actor",
                "rollout.embedded.gpus_per_actor",
                "rollout.embedded.actors",
            )
        )
    launched = sum(1 for s in plan.servers if s.role == "launched")
    if launched:
        launch = cfg.rollout.sglang.launch
        out.append(
            ActorRequest(
                "launched server",
                launched,
                float(launch.cpus_per_server),
                float(launch.gpus_per_server),
                "rollout.sglang.launch.cpus_per_server",
                "rollout.sglang.launch.gpus_per_server",
                "rollout.sglang.launch.servers",
            )
        )
    return out


def _fmt(value: float) -> str:
    return f"{value:g}"


def check_resources(
    plan: PlacementPlan, cfg: Any, nodes: Sequence[dict[str, float]], where: str
) -> None:
    """Refuse a layout that ``nodes`` (each node's total resources, ``{"CPU": .., "GPU": ..}``)
    can never hold; ``where`` says whose numbers they are (for the message). A kind no node
    lists is unknown (``--plan`` for another machine) and not checked."""
    if not plan.distributed:
        return
    requests = [r for r in actor_requests(plan, cfg) if r.count]
    known = [k for k in ("CPU", "GPU") if any(k in n for n in nodes)]
    most = {k: max((float(n.get(k, 0.0)) for n in nodes), default=0.0) for k in known}
    total = {k: sum(float(n.get(k, 0.0)) for n in nodes) for k in known}
    for r in requests:
        for kind, need, fld in (("CPU", r.cpus, r.cpu_field), ("GPU", r.gpus, r.gpu_field)):
            if kind in most and need > most[kind]:
                raise PlacementError(
                    f"{fld}: a {r.role} asks for {_fmt(need)} {kind}(s) but no Ray node has "
                    f"more than {_fmt(most[kind])} ({where}); lower {fld} or give Ray more"
                )
    if plan.strategy == "STRICT_PACK" and plan.bundles:
        for kind, fld in (("CPU", "ray.cpus_per_trainer"), ("GPU", "ray.gpus_per_trainer")):
            need = sum(float(b.get(kind, 0.0)) for b in plan.bundles)
            if kind in most and need > most[kind]:
                raise PlacementError(
                    f"{fld}: the {plan.world_size} trainer ranks must share one node and ask "
                    f"for {_fmt(need)} {kind}(s) together, more than any Ray node has "
                    f"({_fmt(most[kind])}, {where}); lower {fld} or give Ray more"
                )
    for kind, fields in (("CPU", "cpu_field"), ("GPU", "gpu_field")):
        need = sum(r.count * (r.cpus if kind == "CPU" else r.gpus) for r in requests)
        if kind in total and need > total[kind]:
            parts = ", ".join(
                f"{r.count} {r.role}(s) [{r.count_field}] x "
                f"{_fmt(r.cpus if kind == 'CPU' else r.gpus)} [{getattr(r, fields)}]"
                for r in requests
                if (r.cpus if kind == "CPU" else r.gpus)
            )
            hint = " or raise ray.num_cpus" if kind == "CPU" and not cfg.ray.address else ""
            raise PlacementError(
                f"the run asks Ray for {_fmt(need)} {kind}(s) at once ({parts}) but it has "
                f"{_fmt(total[kind])} ({where}); lower those fields{hint}"
            )


def local_ray(cfg: Any) -> bool:
    """Whether ``train`` would start its own Ray on this machine: no address to join, and no
    Ray already running in this process (the driver joins that one, checked once joined)."""
    ray = sys.modules.get("ray")
    if ray is not None and getattr(ray, "is_initialized", lambda: False)():
        return False
    return not (cfg.ray.address or os.environ.get("RAY_ADDRESS"))


def _visible_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:  # pragma: no cover - torch is a core dependency
        return 0


def local_node(
    cfg: Any, plan: PlacementPlan, *, for_plan: bool = False, gpus: int | None = None
) -> tuple[dict[str, float], str]:
    """The resources of the Ray ``train`` starts here, and a phrase saying where they come from.

    ``for_plan`` (``--plan``, possibly run elsewhere than the run): a count is used only where
    it is known for the run's machine — ``ray.num_cpus``, this machine's cores for a CPU plan,
    ``--gpus`` — and left out (not checked) otherwise."""
    node: dict[str, float] = {}
    source = []
    if cfg.ray.num_cpus:
        node["CPU"] = float(cfg.ray.num_cpus)
        source.append(f"ray.num_cpus {cfg.ray.num_cpus}")
    elif not for_plan or plan.device == "CPU":
        node["CPU"] = float(os.cpu_count() or 1)
        source.append(f"ray.num_cpus unset: {os.cpu_count()} cores")
    if gpus is not None:
        node["GPU"] = float(gpus)
        source.append(f"--gpus {gpus}")
    elif not for_plan:
        node["GPU"] = float(_visible_gpus())
        source.append(f"{int(node['GPU'])} GPU(s) visible")
    return node, "a local Ray: " + ", ".join(source)


def check_local_resources(
    cfg: Any, plan: PlacementPlan | None = None, *, for_plan: bool = False, gpus: int | None = None
) -> None:
    """:func:`check_resources` against the local Ray ``train`` would start (nothing to check
    when the run is one process, or joins a cluster: that is checked once joined)."""
    plan = plan if plan is not None else plan_run(cfg)
    if not plan.distributed or not local_ray(cfg):
        return
    node, where = local_node(cfg, plan, for_plan=for_plan, gpus=gpus)
    check_resources(plan, cfg, [node], where)


def check_cluster_resources(plan: PlacementPlan, cfg: Any) -> None:
    """:func:`check_resources` against the running Ray the driver joined."""
    import ray

    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    address = cfg.ray.address or os.environ.get("RAY_ADDRESS") or "local"
    check_resources(plan, cfg, nodes, f"Ray at {address}: {len(nodes)} node(s)")


# Ray's actor states before the actor runs on a node.
PENDING_STATES = frozenset({"PENDING_CREATION", "DEPENDENCIES_UNREADY"})


def pending_actors(handles: Sequence[Any]) -> list[int]:
    """Indices of ``handles`` whose actor Ray has not placed yet (empty if Ray cannot tell).

    Ray reports ``PENDING_CREATION`` until the actor's ``__init__`` returns, so a placed actor
    still loading its model is pending too; only one without a worker process (pid 0: no node
    had the resources for it) counts as not placed."""
    try:
        from ray._private import state
    except ImportError:  # pragma: no cover - a Ray without the developer API
        return []
    out = []
    for i, handle in enumerate(handles):
        try:
            info = state.actors(actor_id=handle._actor_id.hex())
        except Exception:  # noqa: BLE001 - a diagnostic only: never a failure of its own
            return []
        if info.get("State") in PENDING_STATES and not info.get("Pid"):
            out.append(i)
    return out


def pending_error(role: str, indices: list[int], request_field: str, waited_s: float) -> str:
    """The one line for actors Ray did not place within the placement deadline."""
    import ray

    try:
        free = {k: round(v, 2) for k, v in ray.available_resources().items() if k in ("CPU", "GPU")}
    except Exception:  # noqa: BLE001
        free = {}
    return (
        f"{role} {indices} still not placed by Ray after {waited_s:g}s (ray.start_timeout_s): "
        f"what it asks for ({request_field}) is not free in the cluster (free now: {free}); "
        "lower it, free the cluster, or raise ray.start_timeout_s"
    )

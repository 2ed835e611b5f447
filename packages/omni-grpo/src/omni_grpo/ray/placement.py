"""Plan where every process of a run goes: trainer ranks, rollout servers, rollout actors.

Pure planning, testable without Ray; ``omni-grpo train --plan`` prints it and starts nothing.

Layout (trainer_facts §7, adapted to sglang-omni servers that have no sleep/offload routes):

* one Ray placement group for the trainer, one bundle per rank, strategy ``STRICT_PACK`` when
  the whole trainer fits one node (TP groups share NVLink) else ``PACK``; rank ``r`` runs in
  bundle ``r``. GPU ranks get ``{"GPU": g, "CPU": c}`` (``g`` = ``ray.gpus_per_trainer``, 1
  unless ranks share a GPU); CPU ranks (torch backend on ``cpu``, the
  CI path) get ``{"CPU": c}`` with a fractional ``c`` so that a 2-core box can hold them
  (trainer_facts §9: actors ask for a whole CPU by default, and four of them never start there);
* the rollout side is disaggregated (no colocation): launched sglang-omni servers are Ray actors
  with ``gpus_per_server`` GPUs each, external servers enter only by URL, and embedded rollout
  actors hold a CPU/GPU policy copy. Every rollout slot joins the weight-sync group after its
  source rank 0: server ``k`` at ``rank_offset = 1 + sum(thinker_tp of servers before it)``
  (``omni_rollout_client.admin.plan_weight_sync_ranks``, the rule of contract §4.3); a launched
  server's thinker TP is planned as its GPU count, an external one's as 1 — the live values come
  from ``/model_info`` when the sync group is built;
* Megatron coordinates follow megatron-core's default order ``tp-cp-ep-dp-pp`` with pp = cp = 1
  and expert-TP = 1: ``tp_rank = r % tp``, ``dp_rank = r // tp``, ``ep_rank = r % ep``,
  ``expert_dp_rank = r // ep``. A TP group must not straddle nodes. The torch backend is pure
  data parallel (``tp = ep = 1``, ``dp = world``).

Every refusal is a :class:`PlacementError` whose message names the config field to change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from omni_rollout_client.admin import plan_weight_sync_ranks


class PlacementError(ValueError):
    """The requested layout cannot be placed; the message names the config field."""


@dataclass(frozen=True)
class TrainerRank:
    rank: int
    bundle_index: int
    node_slot: int  # which node of the packed layout (rank // gpus_per_node); 0 for CPU ranks
    local_rank: int  # GPU index on that node (rank on the node for CPU ranks)
    tp_rank: int
    dp_rank: int
    ep_rank: int
    expert_dp_rank: int


@dataclass(frozen=True)
class ServerAttachment:
    """One rollout slot of the weight-sync group: a server (launched or external) or an actor."""

    url: str  # "" until a launched server reports it; "actor:<i>" for an embedded rollout actor
    thinker_tp: int
    rank_offset: int  # first rank of this slot in the weight-sync group (source = 0)
    role: Literal["external", "launched", "embedded"] = "external"
    gpus: int = 0


@dataclass(frozen=True)
class PlacementPlan:
    world_size: int
    tp: int
    ep: int
    dp: int
    bundles: tuple[dict[str, float], ...]
    strategy: Literal["PACK", "STRICT_PACK"]
    ranks: tuple[TrainerRank, ...]
    servers: tuple[ServerAttachment, ...]
    sync_world_size: int  # 1 (source rank) + every rollout slot's thinker TP ranks
    backend: str = "megatron"
    device: Literal["GPU", "CPU"] = "GPU"
    gpus_per_node: int = 8

    @property
    def sync_source_rank(self) -> int:
        """The trainer rank whose export feeds the weight sync (it holds every full tensor)."""
        return 0

    @property
    def trainer_gpus(self) -> int:
        """Whole GPUs the ranks take (ranks with a fraction each share them)."""
        if self.device != "GPU":
            return 0
        return math.ceil(sum(b.get("GPU", 0.0) for b in self.bundles) - 1e-9)

    @property
    def shares_gpus(self) -> bool:
        """Whether trainer ranks take fractions of a GPU: two of one group may share a device,
        which NCCL refuses, so their collectives go over gloo."""
        return self.device == "GPU" and any(b.get("GPU", 1.0) < 1.0 for b in self.bundles)

    @property
    def rollout_gpus(self) -> int:
        return sum(s.gpus for s in self.servers)

    @property
    def total_gpus(self) -> int:
        return self.trainer_gpus + self.rollout_gpus

    @property
    def distributed(self) -> bool:
        """Whether the run needs Ray: several trainer ranks, launched servers or rollout actors."""
        return self.world_size > 1 or any(s.role != "external" for s in self.servers)


def _trainer_layout(
    trainer: Any, gpus_per_node: int, trainer_gpus: int | None
) -> tuple[int, int, int]:
    """(world, tp, ep) of the trainer, or a PlacementError naming the field to change."""
    if trainer.backend != "megatron":
        world = int(trainer_gpus if trainer_gpus is not None else trainer.world_size)
        return world, 1, 1
    m = trainer.megatron
    tp, ep, pp = int(m.tp), int(m.ep), int(m.pp)
    if pp != 1:
        raise PlacementError(f"trainer.megatron.pp={pp}: pipeline parallelism is not supported")
    if trainer_gpus is not None:
        world = int(trainer_gpus)
    elif trainer.world_size > 1:
        world = int(trainer.world_size)
    else:
        world = math.lcm(tp * pp, ep)  # the smallest world that holds the layout
    if world < 1 or world % (tp * pp):
        raise PlacementError(
            f"trainer.world_size ({world}) must be a positive multiple of trainer.megatron.tp * pp = {tp * pp}"
        )
    if world % ep:
        raise PlacementError(
            f"trainer.world_size ({world}) must be a multiple of trainer.megatron.ep = {ep}"
        )
    if tp > gpus_per_node or (gpus_per_node % tp and world > gpus_per_node):
        raise PlacementError(
            f"trainer.megatron.tp={tp} cannot be placed on nodes of {gpus_per_node} GPUs "
            "(ray.gpus_per_node) without a TP group straddling nodes"
        )
    return world, tp, ep


def _uses_gpus(trainer: Any) -> bool:
    """``cuda`` ranks take a GPU bundle; ``auto`` does when this machine sees one (the driver
    plans for its own kind of machine; set trainer.device explicitly for a mixed cluster)."""
    if trainer.device == "cuda":
        return True
    if trainer.device == "cpu":
        return False
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:  # pragma: no cover - torch is a core dependency
        return False


def _rollout_slots(
    rollout: Any, backend: str, world: int, server_tp_sizes: list[int] | None
) -> list[tuple[str, int, str, int]]:
    """(url, thinker_tp, role, gpus) of every rollout slot in sync-group order."""
    emb = rollout.embedded
    if rollout.engine == "embedded":
        if emb.actors == 0 and (world > 1 or backend != "torch"):
            raise PlacementError(
                "rollout.engine 'embedded' with more than one trainer rank (or a non-torch "
                "backend) needs rollout.embedded.actors >= 1: the driver holds no policy to sample"
            )
        return [(f"actor:{i}", 1, "embedded", 0) for i in range(emb.actors)]
    if emb.actors:
        raise PlacementError(
            f"rollout.embedded.actors={emb.actors} is only for rollout.engine 'embedded' "
            f"(got {rollout.engine!r}): set it to 0"
        )
    if rollout.engine != "sglang-omni":
        return []  # a third-party engine manages its own processes
    sg = rollout.sglang
    urls = list(sg.urls)  # router-only configs: the sync asks the router for its workers
    sizes = list(server_tp_sizes) if server_tp_sizes is not None else [1] * len(urls)
    if len(sizes) != len(urls):
        raise PlacementError(
            f"server_tp_sizes has {len(sizes)} entries for {len(urls)} rollout.sglang.urls"
        )
    slots = [(url, int(tp), "external", 0) for url, tp in zip(urls, sizes, strict=True)]
    launch = sg.launch
    if launch is not None:
        from omni_grpo.serve import launched_thinker_tp  # gpus_per_server, or extra_args' TP

        slots += [
            ("", launched_thinker_tp(launch), "launched", launch.gpus_per_server)
            for _ in range(launch.servers)
        ]
    return slots


def plan_placement(
    trainer: Any,
    rollout: Any,
    *,
    trainer_gpus: int | None = None,
    gpus_per_node: int = 8,
    cpus_per_rank: float = 1.0,
    gpus_per_rank: float = 1.0,
    server_tp_sizes: list[int] | None = None,
    available_gpus: int | None = None,
) -> PlacementPlan:
    """The placement of ``trainer`` (``TrainerConfig``) next to ``rollout`` (``RolloutConfig``).

    ``trainer_gpus`` overrides ``trainer.world_size`` (megatron default: ``lcm(tp * pp, ep)``).
    ``server_tp_sizes`` lists each external server's thinker TP size in ``rollout.sglang.urls``
    order (from ``/model_info``); 1 each when unknown at planning time. ``available_gpus`` (the
    cluster's GPU count, when known) refuses a plan that needs more.
    """
    world, tp, ep = _trainer_layout(trainer, gpus_per_node, trainer_gpus)
    if world < 1:
        raise PlacementError(f"trainer.world_size ({world}) must be >= 1")
    gpu = _uses_gpus(trainer)
    slots = _rollout_slots(rollout, trainer.backend, world, server_tp_sizes)
    sync = plan_weight_sync_ranks([tp_ for _, tp_, _, _ in slots]) if slots else None
    per_node = gpus_per_node if gpu else max(world, 1)
    ranks = tuple(
        TrainerRank(
            rank=r,
            bundle_index=r,
            node_slot=r // per_node,
            local_rank=r % per_node,
            tp_rank=r % tp,
            dp_rank=r // tp,
            ep_rank=r % ep,
            expert_dp_rank=r // ep,
        )
        for r in range(world)
    )
    bundle: dict[str, float] = (
        {"GPU": float(gpus_per_rank), "CPU": float(cpus_per_rank)}
        if gpu
        else {"CPU": float(cpus_per_rank)}
    )
    plan = PlacementPlan(
        world_size=world,
        tp=tp,
        ep=ep,
        dp=world // tp,
        bundles=tuple(dict(bundle) for _ in range(world)),
        strategy="STRICT_PACK" if (not gpu or world <= gpus_per_node) else "PACK",
        ranks=ranks,
        servers=tuple(
            ServerAttachment(url, tp_, off, role, gpus)  # type: ignore[arg-type]
            for (url, tp_, role, gpus), off in zip(
                slots, sync.rank_offsets if sync else [], strict=True
            )
        ),
        sync_world_size=sync.world_size if sync else 1,
        backend=str(trainer.backend),
        device="GPU" if gpu else "CPU",
        gpus_per_node=gpus_per_node,
    )
    if available_gpus is not None and plan.total_gpus > available_gpus:
        raise PlacementError(
            f"the run needs {plan.total_gpus} GPUs ({plan.trainer_gpus} trainer "
            f"[trainer.world_size], {plan.rollout_gpus} rollout [rollout.sglang.launch]) but "
            f"{available_gpus} are available"
        )
    return plan


def plan_run(cfg: Any, *, available_gpus: int | None = None) -> PlacementPlan:
    """The plan of a whole ``OmniGRPOConfig`` (what ``omni-grpo train --plan`` prints)."""
    return plan_placement(
        cfg.trainer,
        cfg.rollout,
        gpus_per_node=cfg.ray.gpus_per_node,
        cpus_per_rank=cfg.ray.cpus_per_trainer,
        gpus_per_rank=cfg.ray.gpus_per_trainer,
        available_gpus=available_gpus,
    )


def format_plan(plan: PlacementPlan, cfg: Any | None = None) -> str:
    """The plan as text: one line per trainer rank and per rollout slot (for ``--plan``)."""
    nodes = max((r.node_slot for r in plan.ranks), default=0) + 1
    address = "" if cfg is None else (cfg.ray.address or "$RAY_ADDRESS or a local Ray")
    rollout, gpus = f"{plan.rollout_gpus} rollout", plan.total_gpus
    actors = sum(s.role == "embedded" for s in plan.servers)
    if actors and plan.device == "GPU" and cfg is not None:  # embedded actors: their own request
        share = cfg.rollout.embedded.gpus_per_actor
        rollout = f"{actors} rollout actor(s) x {share:g} GPU"
        trainer = sum(b.get("GPU", 0.0) for b in plan.bundles)
        gpus = math.ceil(trainer + actors * share - 1e-9)  # fractions share whole GPUs
    head = f"plan: {gpus} GPUs ({plan.trainer_gpus} trainer on {nodes} node(s) + {rollout}); " + (
        "one process (no Ray)" if not plan.distributed else f"Ray at {address or 'local'}"
    )
    lines = [
        head,
        f"trainer: backend {plan.backend}, {plan.world_size} rank(s) on {plan.device}, "
        f"tp {plan.tp} x ep {plan.ep} x dp {plan.dp}, placement group {plan.strategy} of "
        f"{plan.world_size} x {plan.bundles[0] if plan.bundles else {}}",
        "  rank  node  gpu  tp  dp  ep  expert_dp",
    ]
    if plan.shares_gpus:  # Ray places fractional actors; several may sit on one device
        lines[-1] += f"  (gpu: a {plan.bundles[0]['GPU']:g} share, placed by Ray)"
    for r in plan.ranks:
        gpu = str(r.local_rank) if plan.device == "GPU" and not plan.shares_gpus else "-"
        lines.append(
            f"  {r.rank:>4}  {r.node_slot:>4}  {gpu:>3}  {r.tp_rank:>2}  {r.dp_rank:>2}  "
            f"{r.ep_rank:>2}  {r.expert_dp_rank:>9}"
        )
    if plan.servers:
        sync_mode = "" if cfg is None else f" (sync_mode {_sync_mode(cfg)})"
        lines.append(
            f"rollout: {len(plan.servers)} slot(s); weight-sync group world {plan.sync_world_size}, "
            f"source rank 0 = trainer rank {plan.sync_source_rank}'s export{sync_mode}"
        )
        lines.append("  slot  role      gpus  thinker_tp  rank_offset  url")
        for i, s in enumerate(plan.servers):
            url = s.url or "(reported at launch)"
            gpus = f"{s.gpus}"
            if s.role == "embedded" and plan.device == "GPU" and cfg is not None:
                gpus = f"{cfg.rollout.embedded.gpus_per_actor:g}"  # an actor's own request
            lines.append(
                f"  {i:>4}  {s.role:<8}  {gpus:>4}  {s.thinker_tp:>10}  {s.rank_offset:>11}  {url}"
            )
    elif cfg is not None:
        lines.append(f"rollout: engine {cfg.rollout.engine} in the trainer process")
    return "\n".join(lines)


def _sync_mode(cfg: Any) -> str:
    if cfg.rollout.engine == "embedded":
        return "distributed (embedded rollout actors)"
    return str(cfg.rollout.sglang.sync_mode)


def rank_env(plan: PlacementPlan, rank: int, master_addr: str, master_port: int) -> dict[str, str]:
    """torch.distributed environment of one trainer rank (what torchrun would set)."""
    r = plan.ranks[rank]
    return {
        "RANK": str(r.rank),
        "WORLD_SIZE": str(plan.world_size),
        "LOCAL_RANK": "0",  # Ray gives each actor exactly its bundle's GPU as device 0
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "NCCL_CUMEM_ENABLE": "0",
        "NCCL_NVLS_ENABLE": "0",
    }


def create_placement_group(plan: PlacementPlan, timeout_s: float = 600.0) -> Any:
    """Reserve the trainer's bundles in the running Ray cluster and wait until they are placed."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group(list(plan.bundles), strategy=plan.strategy, name="omni_grpo_trainer")
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        what = "GPU" if plan.device == "GPU" else "CPU"
        raise PlacementError(
            f"Ray could not place {plan.world_size} {what} bundles {plan.bundles[0]} "
            f"({plan.strategy}) within {timeout_s}s (ray.start_timeout_s); cluster has "
            f"{ray.cluster_resources()}"
        )
    return pg


def actor_options(plan: PlacementPlan, rank: int, pg: Any) -> dict[str, Any]:
    """``.options(**...)`` for the trainer actor of ``rank``: its bundle and its GPU.

    The torch.distributed environment (:func:`rank_env`) is handed to the actor's ``setup``
    instead of a per-actor ``runtime_env``: rank 0's address is only known once it runs.
    """
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundle = plan.bundles[plan.ranks[rank].bundle_index]
    return {
        "num_gpus": bundle.get("GPU", 0.0),
        "num_cpus": bundle["CPU"],
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=plan.ranks[rank].bundle_index
        ),
    }

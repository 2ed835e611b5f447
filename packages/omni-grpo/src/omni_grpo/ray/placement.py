"""Plan where the Megatron trainer ranks run and how external rollout servers attach.

Layout (trainer_facts §7, adapted to external servers):

* one Ray placement group of ``{"GPU": 1, "CPU": cpus_per_rank}`` bundles, one per trainer rank,
  strategy ``PACK`` (``STRICT_PACK`` when the whole trainer fits one node, so TP groups share
  NVLink); trainer rank ``r`` runs in bundle ``r``;
* the rollout side is NOT in the placement group: sglang-omni servers are started outside Ray
  (disaggregated, no colocation — they have no sleep/offload routes) and only their URLs and
  thinker TP sizes enter the plan, which places them in the weight-sync group after the trainer's
  source rank (``omni_rollout_client.admin.plan_weight_sync_ranks``);
* Megatron coordinates follow megatron-core's default order ``tp-cp-ep-dp-pp`` with pp = cp = 1
  and expert-TP = 1: ``tp_rank = r % tp``, ``dp_rank = r // tp``, ``ep_rank = r % ep``,
  ``expert_dp_rank = r // ep``. A TP group must not straddle nodes.
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
    node_slot: int  # which node of the packed layout (rank // gpus_per_node)
    local_rank: int  # GPU index on that node
    tp_rank: int
    dp_rank: int
    ep_rank: int
    expert_dp_rank: int


@dataclass(frozen=True)
class ServerAttachment:
    url: str
    thinker_tp: int
    rank_offset: int  # first rank of this server in the weight-sync group (trainer source = 0)


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
    sync_world_size: int  # 1 (trainer source rank) + every server's thinker TP ranks

    @property
    def sync_source_rank(self) -> int:
        """The trainer rank that broadcasts weights (export gathers full tensors on every rank)."""
        return 0


def plan_placement(
    trainer: Any,
    rollout: Any,
    *,
    trainer_gpus: int | None = None,
    gpus_per_node: int = 8,
    cpus_per_rank: float = 1.0,
    server_tp_sizes: list[int] | None = None,
) -> PlacementPlan:
    """The placement of ``trainer`` (``TrainerConfig``) next to ``rollout`` (``RolloutConfig``) servers.

    ``trainer_gpus`` defaults to the smallest world that holds the layout, ``lcm(tp * pp, ep)``.
    ``server_tp_sizes`` lists each server's thinker TP size in ``rollout.sglang.urls`` order
    (from ``/model_info``); 1 each when unknown at planning time.
    """
    m = trainer.megatron
    if trainer.backend != "megatron":
        raise PlacementError(
            f"trainer.backend is {trainer.backend!r}: Ray placement is for the 'megatron' backend"
        )
    tp, ep, pp = int(m.tp), int(m.ep), int(m.pp)
    if pp != 1:
        raise PlacementError(f"trainer.megatron.pp={pp}: pipeline parallelism is not supported")
    world = int(trainer_gpus) if trainer_gpus is not None else math.lcm(tp * pp, ep)
    if world < 1 or world % (tp * pp):
        raise PlacementError(
            f"trainer GPUs ({world}) must be a positive multiple of trainer.megatron.tp * pp = {tp * pp}"
        )
    if world % ep:
        raise PlacementError(
            f"trainer GPUs ({world}) must be a multiple of trainer.megatron.ep = {ep}"
        )
    if tp > gpus_per_node or (gpus_per_node % tp and world > gpus_per_node):
        raise PlacementError(
            f"trainer.megatron.tp={tp} cannot be placed on nodes of {gpus_per_node} GPUs without a TP group straddling nodes"
        )
    if rollout.engine != "sglang-omni":
        raise PlacementError(
            f"rollout.engine is {rollout.engine!r}: the Ray layout attaches external sglang-omni servers "
            "(the embedded engine runs inside the trainer process; no placement needed)"
        )
    urls = list(rollout.sglang.urls)
    if not urls:
        raise PlacementError(
            "rollout.sglang.urls is empty: weight sync calls every worker directly (not the router)"
        )
    sizes = list(server_tp_sizes) if server_tp_sizes is not None else [1] * len(urls)
    if len(sizes) != len(urls):
        raise PlacementError(
            f"server_tp_sizes has {len(sizes)} entries for {len(urls)} rollout.sglang.urls"
        )
    sync = plan_weight_sync_ranks(sizes)
    ranks = tuple(
        TrainerRank(
            rank=r,
            bundle_index=r,
            node_slot=r // gpus_per_node,
            local_rank=r % gpus_per_node,
            tp_rank=r % tp,
            dp_rank=r // tp,
            ep_rank=r % ep,
            expert_dp_rank=r // ep,
        )
        for r in range(world)
    )
    return PlacementPlan(
        world_size=world,
        tp=tp,
        ep=ep,
        dp=world // tp,
        bundles=tuple({"GPU": 1.0, "CPU": float(cpus_per_rank)} for _ in range(world)),
        strategy="STRICT_PACK" if world <= gpus_per_node else "PACK",
        ranks=ranks,
        servers=tuple(
            ServerAttachment(url, int(tp_), off)
            for url, tp_, off in zip(urls, sizes, sync.rank_offsets, strict=True)
        ),
        sync_world_size=sync.world_size,
    )


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
    from ray.util.placement_group import placement_group

    pg = placement_group(list(plan.bundles), strategy=plan.strategy, name="omni_grpo_trainer")
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        raise PlacementError(
            f"Ray could not place {plan.world_size} GPU bundles ({plan.strategy}) within {timeout_s}s"
        )
    return pg


def actor_options(
    plan: PlacementPlan, rank: int, pg: Any, master_addr: str, master_port: int
) -> dict[str, Any]:
    """``.options(**...)`` for the trainer actor of ``rank``: its bundle, one GPU, its env."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundle = plan.bundles[plan.ranks[rank].bundle_index]
    return {
        "num_gpus": bundle["GPU"],
        "num_cpus": bundle["CPU"],
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=plan.ranks[rank].bundle_index
        ),
        "runtime_env": {"env_vars": rank_env(plan, rank, master_addr, master_port)},
    }

"""The driver of a multi-process run: Ray actors behind the interfaces the loop already speaks.

``omni-grpo train`` stays the one process that draws data, rollouts and rewards, logs, evaluates
and writes checkpoints: ``omni_grpo.trainer.train`` runs unchanged top to bottom. When the plan
(``omni_grpo.ray.placement.plan_run``) spans several processes, :func:`start_ray_run` starts them
and hands the loop three stand-ins:

* ``backend`` — :class:`RayTrainerGroup`, a ``TrainerBackend``. Its ``step(batch)`` cuts the
  batch into data-parallel shards balanced by token count (``omni_grpo.algo.shard.shard_batch``),
  runs ``step`` on every trainer actor at once, and returns the metrics once. The backend
  all-reduces the normalisers and metrics, so every rank returns the same values, those of the
  unsharded step. ``weights_for_sync()`` hands out rank 0's export unread: iterated, it streams
  bucket by bucket (a Ray streaming generator); no rank builds a full dict for the sync. Checkpoint state comes from
  rank 0, where the data-parallel ranks hold identical weights. The driver writes it through
  ``run.checkpoint``'s staged directory, so a checkpoint is either whole or absent.
* ``engine`` — the embedded engine over rollout actors (``omni_grpo.ray.rollout``), or the
  sglang-omni engine against the configured URLs plus those of the launched servers.
* ``sync`` — into the rollout actors (``ActorWeightSync``: the driver hosts the group and
  broadcasts what it streams from rank 0), or the configured ``rollout.sglang.sync_mode`` against
  every server, run by trainer rank 0 itself (``TrainerSideSync``): the rank that holds the full
  export, and for NCCL the GPU, sends it; the tensors never pass through the driver.

Faults: every wait on an actor goes through :meth:`ActorSet.get`. A dead actor (kill -9, OOM
kill) or an exception inside one stops the wait at once with :class:`ActorFailure`. Its message
is one line naming the role and rank, followed by that actor's last log lines. An exception that
arrives while a peer is dying (its collective broken by the death) waits a few seconds for Ray's
news of the death and names the dead actor, the cause (:meth:`ActorSet.peer_death`). The other actors
may be blocked in a collective with the dead one, so :meth:`RayRun.close` kills them all rather
than waiting for them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omni_grpo.ray.errors import ActorFailure
from omni_grpo.ray.placement import (
    PlacementError,
    PlacementPlan,
    actor_options,
    create_placement_group,
    plan_run,
    rank_env,
)
from omni_grpo.ray.resources import check_cluster_resources, pending_actors, pending_error
from omni_grpo.run.signals import find_interrupt, keep_signal_handlers
from omni_grpo.serve import tail

if TYPE_CHECKING:
    from omni_rollout_client.payload import MediaTokenIds

log = logging.getLogger(__name__)

#: Environment the driver hands to every actor (thread counts, determinism knobs).
PROPAGATED_ENV: tuple[str, ...] = (
    "OMNI_GRPO_TORCH_THREADS",
    "OMP_NUM_THREADS",
    "PYTHONHASHSEED",
    "CUBLAS_WORKSPACE_CONFIG",
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
)
POLL_S = 0.5
# how long an actor's exception waits for news of a peer's death (the likelier cause) before it is
# reported as the failure itself: Ray marks a killed actor dead within about a second
DEATH_GRACE_S = 5.0


def connect(ray_cfg: Any) -> bool:
    """Join ``ray.address`` / ``$RAY_ADDRESS``, else start a local Ray; True if we started it.

    A local Ray on one machine gets ``RAY_ENABLE_UV_RUN_RUNTIME_ENV=0``: the driver's venv
    already holds everything, and Ray would otherwise rebuild the workspace for every worker
    under ``uv run`` (trainer_facts §9). Actors log into the run directory, not to the driver.
    """
    import sys

    address = ray_cfg.address or os.environ.get("RAY_ADDRESS")
    if not address:
        # read by ray_constants when ray is imported: set it first (and on the module when some
        # other code imported ray already); without it each worker start runs `uv run` and, on
        # a 2-core box, the actors miss their start-up deadline
        os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
        if "ray" in sys.modules:
            from ray._private import ray_constants

            ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV = os.environ[
                "RAY_ENABLE_UV_RUN_RUNTIME_ENV"
            ] not in ("0", "false", "False")
    import ray

    if ray.is_initialized():
        return False
    env = {k: os.environ[k] for k in PROPAGATED_ENV if k in os.environ}
    # ray.init installs its own SIGTERM handlers (one exits, the core worker's dumps a native
    # stack and aborts): the run's own stop handlers (omni_grpo.run.signals) are put back.
    with keep_signal_handlers():
        try:
            if address:
                ray.init(address=address, runtime_env={"env_vars": env}, log_to_driver=False)
            else:
                ray.init(
                    num_cpus=ray_cfg.num_cpus or os.cpu_count(),
                    include_dashboard=False,
                    log_to_driver=False,
                    runtime_env={"env_vars": env},
                )
        except Exception as err:  # noqa: BLE001 - Ray raises a bare Exception ("node timed out")
            where = f"at {address}" if address else "on this machine"
            why = "; ".join(line.strip() for line in str(err).splitlines() if line.strip())
            raise RuntimeError(
                f"Ray did not start {where} ({why or type(err).__name__}); nothing of the run "
                "was started: rerun (a machine too busy delays Ray's own start-up), or set "
                "ray.address to a running Ray"
            ) from err
    return True


@dataclass
class ActorSet:
    """Handles of one role's actors, their names and log files; fault-aware waiting."""

    role: str  # "trainer rank" | "rollout actor" | "server"
    handles: list[Any] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)
    request: str = ""  # the config fields of what each actor asks Ray for (placement errors)

    def __len__(self) -> int:
        return len(self.handles)

    @property
    def names(self) -> list[str]:
        return [f"{self.role} {i}" for i in range(len(self.handles))]

    def failure(self, index: int, err: BaseException, what: str) -> ActorFailure:
        """The one-line error for actor ``index`` failing during ``what``, plus its last log lines."""
        import ray

        if isinstance(err, ray.exceptions.RayTaskError):
            cause = str(err).strip().splitlines()[-1]
            head = f"{self.role} {index} raised during {what}: {cause}"
        elif isinstance(err, ray.exceptions.OutOfMemoryError):
            head = f"{self.role} {index} was killed for memory (OOM) during {what}"
        else:
            head = f"{self.role} {index} died during {what} ({type(err).__name__})"
        path = self.logs[index] if index < len(self.logs) else None
        lines = tail(path, 15) if path is not None else ""
        where = f"; last lines of {path}:\n{lines}" if lines else f" (no log at {path})"
        return ActorFailure(head + where)

    def get(
        self,
        refs: Sequence[Any],
        indices: Any,
        what: str,
        timeout_s: float | None = None,
        placed_by: tuple[float, float] | None = None,
    ) -> list[Any]:
        """Results of ``refs`` (one per actor index in ``indices``), in order; the first actor to
        fail raises :class:`ActorFailure` at once, whatever the others are doing.

        ``placed_by`` = (monotonic time, the seconds it stands for): an actor Ray has still not
        placed on a node by then raises :class:`PlacementError` naming what it asks for."""
        import ray

        indices = list(indices)
        pending = {ref: k for k, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while pending:
            if placed_by is not None and time.monotonic() > placed_by[0]:
                waiting = sorted(indices[k] for k in pending.values())
                late = pending_actors([self.handles[i] for i in waiting])
                if late:
                    raise PlacementError(
                        pending_error(
                            self.role, [waiting[i] for i in late], self.request, placed_by[1]
                        )
                    )
                placed_by = None  # all placed: what is left is start-up time
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=POLL_S)
            for ref in ready:
                k = pending.pop(ref)
                try:
                    results[k] = ray.get(ref)
                except (ray.exceptions.RayError, ray.exceptions.RayTaskError) as err:
                    if isinstance(err, ray.exceptions.RayTaskError) and pending:
                        died = self.peer_death(pending, indices, what)
                        if died is not None:
                            raise died from None
                    raise self.failure(indices[k], err, what) from None
            if deadline is not None and time.monotonic() > deadline:
                late = sorted(indices[k] for k in pending.values())
                raise ActorFailure(f"{self.role} {late} did not finish {what} within {timeout_s}s")
        return results

    def peer_death(
        self, pending: dict[Any, int], indices: list[int], what: str, grace_s: float = DEATH_GRACE_S
    ) -> ActorFailure | None:
        """The failure of a still-pending actor that *died* within ``grace_s``, else None.

        Why: when one rank is killed mid-step, its peers' collectives break ("Connection reset by
        peer") and a peer's exception can reach the driver before Ray has marked the dead actor:
        the error to report is the death (the cause), not the peer's broken collective."""
        import ray

        deadline = time.monotonic() + grace_s
        left = dict(pending)
        while left and time.monotonic() < deadline:
            ready, _ = ray.wait(list(left), num_returns=1, timeout=0.2)
            for ref in ready:
                k = left.pop(ref)
                try:
                    ray.get(ref)
                except ray.exceptions.RayTaskError:
                    continue  # raised too: not the cause
                except ray.exceptions.RayError as err:
                    return self.failure(indices[k], err, what)
        return None

    def wait_works(self, works: list[Any], refs: Sequence[Any], timeout_s: float) -> None:
        """Wait for the driver's side of collectives while watching the actors' side for faults."""
        import ray

        deadline = time.monotonic() + timeout_s
        try:
            while not all(w.is_completed() for w in works):
                ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0.01)
                for ref in ready:
                    try:
                        ray.get(ref)
                    except ray.exceptions.RayError as err:
                        raise self.failure(list(refs).index(ref), err, "weight sync") from None
                if time.monotonic() > deadline:
                    raise ActorFailure(
                        f"weight broadcast to {self.role}s not done after {timeout_s}s"
                    )
            for w in works:
                w.wait()
        except ActorFailure:
            raise
        except Exception as err:  # noqa: BLE001 - the collective broke: say which actor broke it
            if find_interrupt(err) is not None:
                raise  # a stop signal, not a broken collective
            raise self.collective_failure(refs, err, "weight sync") from None

    def collective_failure(
        self, refs: Sequence[Any], err: BaseException, what: str, grace_s: float = 10.0
    ) -> ActorFailure:
        """The error for a collective that failed on the driver's side ("Connection closed by
        peer" when an actor died mid-broadcast): the actor whose call failed, named with its
        log, if Ray reports one within ``grace_s``; else the collective's own error, one line."""
        import ray

        refs = list(refs)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0.2)
            for ref in ready:
                try:
                    ray.get(ref)
                except ray.exceptions.RayError as actor_err:
                    return self.failure(refs.index(ref), actor_err, what)
            if len(ready) == len(refs):
                break
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        return ActorFailure(
            f"{what} with the {self.role}s failed: {type(err).__name__}: {'; '.join(lines)}"
        )

    def kill(self) -> None:
        import ray

        for h in self.handles:
            with contextlib.suppress(Exception):  # already gone
                ray.kill(h, no_restart=True)


class RayTrainerGroup:
    """``TrainerBackend`` over trainer actors (see module doc)."""

    name = "ray"
    policy = None  # the weights live in the actors: the loop samples through an engine
    is_driver = True

    def __init__(
        self, actors: ActorSet, plan: PlacementPlan, bucket_bytes: int, layout: str
    ) -> None:
        import torch

        self.actors = actors
        self.plan = plan
        self.bucket_bytes = int(bucket_bytes)
        self.layout = layout  # rank 0 backend's SourceLayout (from its setup)
        self.device = torch.device("cpu")

    def _all(
        self, what: str, method: str, *args_per_rank: Sequence[Any], shared: tuple = ()
    ) -> list[Any]:
        refs = [
            getattr(h, method).remote(*(a[r] for a in args_per_rank), *shared)
            for r, h in enumerate(self.actors.handles)
        ]
        return self.actors.get(refs, range(len(refs)), what)

    def step(self, batch: Any) -> dict[str, float]:
        if self.plan.dp == 1:
            shards = [batch]
        else:
            from omni_grpo.algo.shard import shard_batch

            shards = shard_batch(batch, self.plan.dp)
        # model-parallel ranks of one data-parallel replica see the same shard
        per_rank = [shards[r.dp_rank] for r in self.plan.ranks]
        return self._all("step", "step", per_rank)[0]

    def supervised_step(self, prompts: list[Any], targets: list[list[int]], lr: float) -> float:
        from omni_grpo.ray.rollout import split_evenly

        parts = split_evenly(list(zip(prompts, targets, strict=True)), self.plan.dp)
        p = [[x for x, _ in parts[r.dp_rank]] for r in self.plan.ranks]
        t = [[y for _, y in parts[r.dp_rank]] for r in self.plan.ranks]
        return self._all("supervised_step", "supervised_step", p, t, shared=(lr,))[0]

    def weights_for_sync(self) -> tuple[RankExport, str]:
        """Rank 0's export, not yet sent anywhere: iterating it streams the tensors to this
        process bucket by bucket (what the rollout actors' sync does); a ``TrainerSideSync``
        instead has rank 0 push it straight to the servers (nothing passes through here)."""
        return RankExport(self), self.layout

    def _stream(self) -> Iterator[tuple[str, Any]]:
        gens = [
            h.weights_for_sync.options(num_returns="streaming").remote(self.bucket_bytes)
            for h in self.actors.handles
        ]
        while (bucket := self._next(gens[0], 0)) is not None:
            yield from bucket
        for r, gen in enumerate(gens[1:], start=1):  # the others only drain their export
            while self._next(gen, r) is not None:
                pass

    def _next(self, gen: Any, rank: int) -> Any:
        try:
            ref = next(gen)
        except StopIteration:
            return None
        return self.actors.get([ref], [rank], "weights_for_sync")[0]

    def trainable_state(self) -> dict[str, Any]:
        return self.actors.get(
            [self.actors.handles[0].trainable_state.remote()], [0], "checkpoint"
        )[0]

    def optimizer_state(self) -> dict[str, Any]:
        return self.actors.get(
            [self.actors.handles[0].optimizer_state.remote()], [0], "checkpoint"
        )[0]

    def load_trainable_state(self, state: dict[str, Any]) -> None:
        import ray

        ref = ray.put(state)  # one copy in the object store, read by every rank
        self._all("resume", "load_trainable_state", shared=(ref,))

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        import ray

        ref = ray.put(state)
        self._all("resume", "load_optimizer_state", shared=(ref,))

    def set_reference(self, state: dict[str, Any]) -> None:
        """The KL reference on every rank (``trainer.anchor_reference``, after the warm-up)."""
        import ray

        self._all("set_reference", "set_reference", shared=(ray.put(state),))

    def close(self) -> None:
        """The actors end with the run (:meth:`RayRun.close`)."""


class RankExport:
    """The trainer's export as ``(name, tensor)`` pairs, streamed from rank 0 on iteration."""

    def __init__(self, group: RayTrainerGroup) -> None:
        self.group = group

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return self.group._stream()


class TrainerSideSync:
    """``WeightSync`` run by trainer rank 0 itself: the rank that holds the full export (and the
    GPU, for NCCL into the servers) builds ``rollout.sglang.sync_mode``'s sync in its own process
    and pushes there, while every other rank drains its export for the collectives. The driver
    only says when and under which version."""

    def __init__(self, trainers: ActorSet, sglang_cfg: Any, run_dir: Path) -> None:
        self.trainers = trainers
        self.mode = str(sglang_cfg.sync_mode)
        refs = [h.open_sync.remote(sglang_cfg, str(run_dir)) for h in trainers.handles]
        trainers.get(refs, range(len(refs)), "weight-sync set-up")

    def push(self, named_tensors: Any, version: str, *, layout: str = "hf_memory") -> Any:
        if not isinstance(named_tensors, RankExport):
            raise TypeError("TrainerSideSync pushes the trainer ranks' own export only")
        refs = [h.push_weights.remote(str(version)) for h in self.trainers.handles]
        return self.trainers.get(refs, range(len(refs)), f"weight sync {version}")[0]

    def close(self) -> None:
        """Close rank 0's sync; after a failed run a dead rank must not hide the first error."""
        refs = [h.close_sync.remote() for h in self.trainers.handles]
        try:
            self.trainers.get(refs, range(len(refs)), "weight-sync close", 120)
        except ActorFailure as err:
            log.warning("closing the weight sync: %s", str(err).splitlines()[0])


@dataclass
class RayRun:
    """What :func:`start_ray_run` started: the loop's stand-ins, and everything to tear down."""

    plan: PlacementPlan
    backend: Any
    engine: Any
    sync: Any
    rollout: Any  # the RolloutConfig the loop uses (launched servers' URLs included)
    groups: list[ActorSet] = field(default_factory=list)
    placement_group: Any = None
    owns_ray: bool = False

    def close(self) -> None:
        """Stop the servers cleanly, kill every actor, release the placement group and Ray."""
        import ray

        for group in self.groups:
            if group.role == "server":
                try:
                    group.get(
                        [h.stop.remote() for h in group.handles], range(len(group)), "stop", 60
                    )
                except Exception as err:  # noqa: BLE001 - killed below anyway
                    log.warning("stopping the servers: %s", err)
        for group in self.groups:
            group.kill()
        if self.placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.placement_group)
        if self.owns_ray:
            ray.shutdown()


def start_servers(cfg: Any, run_dir: Path) -> tuple[ActorSet, list[Any]]:
    """One ``ServerActor`` per launched server, each starting its server; returns the set and the
    refs of their URLs (servers take longest to come up: the rest starts meanwhile)."""
    import ray

    from omni_grpo.ray.actors import ServerActor

    servers = ActorSet(
        "server",
        request="rollout.sglang.launch.cpus_per_server / gpus_per_server",
    )
    refs: list[Any] = []
    launch = cfg.rollout.sglang.launch if cfg.rollout.engine == "sglang-omni" else None
    if launch is None:
        return servers, refs
    model_path = str(launch.model_path or cfg.model.omni_checkpoint or run_dir / "model" / "omni")
    remote = ray.remote(ServerActor)
    for i in range(launch.servers):
        path = Path(run_dir) / "logs" / f"server-{i}.log"
        handle = remote.options(
            num_cpus=launch.cpus_per_server, num_gpus=launch.gpus_per_server
        ).remote(i, launch, model_path, str(path))
        servers.handles.append(handle)
        servers.logs.append(path)
        refs.append(handle.start.remote())
    return servers, refs


def start_trainers(
    cfg: Any, plan: PlacementPlan, run_dir: Path, pad_token_id: int
) -> tuple[ActorSet, Any, list[Any]]:
    """The trainer ranks in their placement group, set up with rank 0 hosting the rendezvous;
    returns the set, the placement group and the refs of their ``setup`` (not waited for)."""
    import ray

    from omni_grpo.ray.actors import TrainerActor

    trainers = ActorSet("trainer rank", request="ray.cpus_per_trainer")
    pg = create_placement_group(plan, cfg.ray.start_timeout_s)
    remote = ray.remote(TrainerActor)
    for r in range(plan.world_size):
        path = Path(run_dir) / "logs" / f"trainer-{r}.log"
        opts = actor_options(plan, r, pg)
        trainers.handles.append(remote.options(**opts).remote(cfg, r, plan.world_size, str(path)))
        trainers.logs.append(path)
    try:
        master, port = trainers.get([trainers.handles[0].address.remote()], [0], "start-up")[0]
    except BaseException:
        from ray.util.placement_group import remove_placement_group

        trainers.kill()
        remove_placement_group(pg)  # the caller never got it: release it here
        raise
    setups = [
        h.setup.remote(rank_env(plan, r, master, port), pad_token_id)
        for r, h in enumerate(trainers.handles)
    ]
    return trainers, pg, setups


def start_rollout_actors(
    cfg: Any, plan: PlacementPlan, run_dir: Path, eos_token_ids: list[int]
) -> tuple[ActorSet, list[Any]]:
    """``rollout.embedded.actors`` rollout actors and the refs of their ``setup``."""
    import ray

    from omni_grpo.ray.actors import RolloutActor

    rollouts = ActorSet("rollout actor", request="rollout.embedded.cpus_per_actor")
    refs: list[Any] = []
    if cfg.rollout.engine != "embedded":
        return rollouts, refs
    emb = cfg.rollout.embedded
    remote = ray.remote(RolloutActor)
    gpus = emb.gpus_per_actor if plan.device == "GPU" else 0
    for i in range(emb.actors):
        path = Path(run_dir) / "logs" / f"rollout-{i}.log"
        handle = remote.options(num_cpus=emb.cpus_per_actor, num_gpus=gpus).remote(
            cfg, i, str(path)
        )
        rollouts.handles.append(handle)
        rollouts.logs.append(path)
        refs.append(handle.setup.remote(eos_token_ids))
    return rollouts, refs


def start_ray_run(
    cfg: Any,
    run_dir: Path,
    *,
    pad_token_id: int,
    eos_token_ids: list[int],
    decode_fn: Any,
    vocab_size: int | None = None,
    media_ids: MediaTokenIds | None = None,
) -> RayRun:
    """Start every process of the plan and return the loop's stand-ins (see module doc)."""
    import ray

    from omni_grpo.rollout import IN_PROCESS, create_engine

    plan = plan_run(cfg)
    run = RayRun(plan, None, None, None, cfg.rollout, owns_ray=connect(cfg.ray))
    deadline = cfg.ray.start_timeout_s * 4  # model loading on a busy machine included
    try:
        check_cluster_resources(plan, cfg)  # what can never be placed: refused before starting
        # an actor that could be placed but is not (a busy cluster): refused after this
        placed_by = (time.monotonic() + cfg.ray.start_timeout_s, cfg.ray.start_timeout_s)
        servers, server_urls = start_servers(cfg, run_dir)
        run.groups.append(servers)
        trainers, run.placement_group, trainer_setups = start_trainers(
            cfg, plan, run_dir, pad_token_id
        )
        run.groups.append(trainers)
        rollouts, rollout_setups = start_rollout_actors(cfg, plan, run_dir, eos_token_ids)
        run.groups.append(rollouts)
        infos = trainers.get(trainer_setups, range(len(trainers)), "start-up", deadline, placed_by)
        run.backend = RayTrainerGroup(
            trainers, plan, cfg.rollout.sglang.bucket_mb << 20, infos[0]["layout"]
        )
        if rollouts.handles:
            from omni_grpo.ray.rollout import ActorWeightSync, RayRolloutEngine

            rollouts.get(rollout_setups, range(len(rollouts)), "start-up", deadline, placed_by)
            run.engine = RayRolloutEngine(rollouts, decode_fn)
            backend = cfg.rollout.embedded.sync_backend
            if backend == "auto":  # a shared GPU: NCCL refuses two ranks of a group on it
                shared = plan.shares_gpus or cfg.rollout.embedded.gpus_per_actor < 1
                backend = "nccl" if plan.device == "GPU" and not shared else "gloo"
            run.sync = ActorWeightSync(
                rollouts,
                master_address=ray.util.get_node_ip_address(),
                backend=backend,
                bucket_bytes=cfg.rollout.sglang.bucket_mb << 20,
                timeout_s=cfg.rollout.sglang.timeout_s,
            )
            return run
        # sglang-omni (or a third-party engine) in the driver, against every server's URL
        urls = (
            servers.get(server_urls, range(len(servers)), "launch", None, placed_by)
            if server_urls
            else []
        )
        sg = cfg.rollout.sglang
        run.rollout = cfg.rollout.model_copy(
            update={"sglang": sg.model_copy(update={"urls": [*sg.urls, *urls]})}
        )
        log.info("rollout servers: %s", run.rollout.sglang.urls)
        run.engine = create_engine(
            run.rollout,
            policy=None,
            eos_token_ids=eos_token_ids,
            banned_token_ids=infos[0]["banned_token_ids"],
            decode_fn=decode_fn,
            device="cpu",
            vocab_size=vocab_size,
            media_ids=media_ids,
        )
        if run.rollout.engine not in IN_PROCESS:
            run.sync = TrainerSideSync(trainers, run.rollout.sglang, run_dir)
        return run
    except BaseException:
        run.close()
        raise

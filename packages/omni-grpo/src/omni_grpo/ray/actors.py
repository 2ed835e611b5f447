"""The processes of a multi-process run, as Ray actors: trainer ranks, rollout workers, servers.

Plain classes: the driver (``omni_grpo.ray.driver``) wraps them with ``ray.remote`` when it starts
them, so importing this module needs neither Ray nor a cluster, and the classes are testable as
they are. Every actor writes its stdout, stderr and logging into its own file under
``<run.dir>/logs/`` (``trainer-<rank>.log``, ``rollout-<i>.log``, ``server-<i>.log``): when one
dies, the driver quotes the end of that file in its one-line error.

* :class:`TrainerActor` — one trainer rank. ``setup`` sets the ``torch.distributed`` environment
  of the plan (``omni_grpo.ray.placement.rank_env``), initialises the default process group
  (gloo on CPU, NCCL on GPU) and builds the configured backend, which is data-parallel-aware
  (``omni_grpo.types.TrainerBackend``: every rank runs every ``step`` on its shard; weights and
  optimizer state stay identical on all ranks).
* :class:`RolloutActor` — the embedded engine on its own copy of the policy (loaded from the same
  extracted checkpoint as the trainer's), refreshed after every step over a real process group
  by ``omni_grpo.ray.rollout.ActorWeightSync``.
* :class:`ServerActor` — owns one launched rollout server (``omni_grpo.serve``): the GPUs Ray gave
  this actor are the server's (``CUDA_VISIBLE_DEVICES`` is inherited).
"""

from __future__ import annotations

import logging
import math
import os
import sys
from collections.abc import Iterator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def log_to_file(path: str | os.PathLike[str], role: str) -> None:
    """Send this process's stdout, stderr (file descriptors too) and logging to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(line_buffering=True)
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s %(levelname)s [{role} pid {os.getpid()}] %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )


def node_address() -> str:
    """This node's IP as Ray sees it (what other actors can connect to)."""
    import ray

    return str(ray.util.get_node_ip_address())


class TrainerActor:
    """One trainer rank (see module doc). Methods mirror ``TrainerBackend``."""

    def __init__(self, cfg: Any, rank: int, world_size: int, log_path: str) -> None:
        log_to_file(log_path, f"trainer rank {rank}")
        self.cfg = cfg
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.backend: Any = None
        self._store: Any = None  # rank 0: the rendezvous store it hosts (see ``address``)

    def ping(self) -> int:
        return os.getpid()

    def _in_group(self) -> bool:
        """Whether this rank joins a process group (several ranks, or Megatron's parallel state)."""
        return self.world_size > 1 or self.cfg.trainer.backend == "megatron"

    def address(self) -> tuple[str, int]:
        """(node IP, port) of the process group's rendezvous, which rank 0 hosts.

        The store is bound here, on a port the OS picks, and kept open until ``setup``: a port
        that was merely free when asked could be taken before the store bound it (on an H200 host
        a Megatron rank's start-up failed with EADDRINUSE while Ray was starting processes)."""
        from datetime import timedelta

        import torch.distributed as dist

        from omni_grpo.serve import free_port

        ip = node_address()
        if not self._in_group():
            return ip, free_port(ip)  # no group: the port is only passed on in the environment
        if self._store is None:
            self._store = dist.TCPStore(
                ip,
                0,
                self.world_size,
                is_master=True,
                timeout=timedelta(seconds=self.cfg.ray.start_timeout_s * 4),
                wait_for_workers=False,
            )
        return ip, int(self._store.port)

    def setup(self, env: dict[str, str], pad_token_id: int) -> dict[str, Any]:
        """Join the trainer's process group and build the backend; returns facts for the driver."""
        import torch
        import torch.distributed as dist

        from omni_grpo.backends import create_backend
        from omni_grpo.backends.torch_backend import resolve_device
        from omni_grpo.models.sideband import media_token_ids
        from omni_grpo.run.process import configure_threads, seed_everything

        os.environ.update(env)
        configure_threads(self.cfg.trainer.device)
        device = resolve_device(self.cfg.trainer.device)
        if device.type == "cuda":
            torch.cuda.set_device(0)  # Ray exposes exactly this actor's GPU as device 0
        if self._in_group():
            # Every rank hands init_process_group a store: rank 0 the one it bound in
            # ``address``, the others a client of it. (Left to ``env://``, torch would put its
            # own key prefix on a store it built and none on one it was given: the ranks would
            # wait for each other under different keys.)
            timeout = timedelta(seconds=self.cfg.ray.start_timeout_s * 4)
            store = self._store
            if store is None:
                store = dist.TCPStore(
                    env["MASTER_ADDR"],
                    int(env["MASTER_PORT"]),
                    self.world_size,
                    is_master=False,
                    timeout=timeout,
                )
            # ranks with fractions of one GPU (ray.gpus_per_trainer < 1) may share a device,
            # which NCCL refuses ("Duplicate GPU detected"): they reduce over gloo
            nccl = device.type == "cuda" and self.cfg.ray.gpus_per_trainer >= 1
            dist.init_process_group(
                "nccl" if nccl else "gloo",
                store=store,
                rank=self.rank,
                world_size=self.world_size,
                timeout=timeout,
            )
        seed_everything(self.cfg.run.seed)
        cfg = self.cfg
        self.backend = create_backend(
            cfg.trainer.backend, cfg.model, cfg.trainer, cfg.algo, pad_token_id=pad_token_id
        )
        if cfg.rollout.exact_logprobs is True:  # resolved by the driver (loop.components)
            from omni_grpo.exact import enable_exact_logprobs

            enable_exact_logprobs(self.backend.policy)  # raises where the device cannot
            if cfg.rollout.max_staleness:  # samples one version old: inexact by construction
                self.backend.exact_watch.enabled = False
        log.info("rank %d/%d ready on %s", self.rank, self.world_size, self.backend.device)
        # the layout only: the export itself is lazy (a Megatron generator starts no collective
        # until iterated) and is dropped unread
        _, layout = self.backend.weights_for_sync()
        self.sync: Any = None
        return {
            "layout": layout,
            "device": str(self.backend.device),
            "banned_token_ids": media_token_ids(getattr(self.backend, "policy", None)),
            "pid": os.getpid(),
        }

    # ---------------------------------------------------------------- the backend, rank-wise
    def step(self, shard: Any) -> dict[str, float]:
        return self.backend.step(shard)

    def supervised_step(self, prompts: list[Any], targets: list[list[int]], lr: float) -> float:
        return self.backend.supervised_step(prompts, targets, lr)

    def trainable_state(self) -> dict[str, Any]:
        return self.backend.trainable_state()

    def optimizer_state(self) -> dict[str, Any]:
        return self.backend.optimizer_state()

    def load_trainable_state(self, state: dict[str, Any]) -> None:
        self.backend.load_trainable_state(state)

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        self.backend.load_optimizer_state(state)

    def set_reference(self, state: dict[str, Any]) -> None:
        set_reference = getattr(self.backend, "set_reference", None)  # torch backend, KL on
        if set_reference is not None:
            set_reference(state)

    def weights_for_sync(self, bucket_bytes: int) -> Iterator[Any]:
        """A streaming generator of lists of ``(name, tensor)``, at most ``bucket_bytes`` each
        (the layout is known from ``setup``). Only rank 0 yields: the data-parallel ranks hold
        the same weights, and model-parallel backends gather the full tensors there. Every other
        rank drains its own export, so that a collective export (Megatron TP/EP) completes."""
        weights, _layout = self.backend.weights_for_sync()
        pairs = weights.items() if isinstance(weights, Mapping) else weights
        if self.rank != 0:
            for _ in pairs:
                pass
            return
        bucket: list[tuple[str, Any]] = []
        size = 0
        for name, tensor in pairs:
            t = tensor.detach().to("cpu")
            bucket.append((name, t))
            size += t.numel() * t.element_size()
            if size >= bucket_bytes:
                yield bucket
                bucket, size = [], 0
        if bucket:
            yield bucket

    # ---------------------------------------------------------------- weight sync, sending end
    def open_sync(self, sglang_cfg: Any, run_dir: str) -> None:
        """Rank 0 builds ``rollout.sglang.sync_mode``'s sync here (``TrainerSideSync``)."""
        if self.rank == 0:
            from omni_grpo.sync import make_weight_sync

            self.sync = make_weight_sync(sglang_cfg, run_dir=Path(run_dir))

    def push_weights(self, version: str) -> Any:
        """Rank 0 pushes its export under ``version``; the other ranks drain theirs."""
        weights, layout = self.backend.weights_for_sync()
        if self.rank != 0:
            for _ in weights.items() if isinstance(weights, Mapping) else weights:
                pass
            return None
        return self.sync.push(weights, version=version, layout=layout)

    def close_sync(self) -> None:
        sync, self.sync = self.sync, None
        if sync is not None:
            sync.close()

    def close(self) -> None:
        import torch.distributed as dist

        if self.backend is not None:
            close = getattr(self.backend, "close", None)
            if close is not None:
                close()
        if dist.is_initialized():
            dist.destroy_process_group()


class RolloutActor:
    """The embedded engine on a policy copy (see module doc)."""

    def __init__(self, cfg: Any, index: int, log_path: str) -> None:
        log_to_file(log_path, f"rollout actor {index}")
        self.cfg = cfg
        self.index = int(index)
        self.engine: Any = None
        self.policy: Any = None
        self.exact = self.lora = False
        self.params: dict[str, Any] = {}
        self.group: Any = None
        self.version = "default"

    def ping(self) -> int:
        return os.getpid()

    def setup(self, eos_token_ids: list[int]) -> dict[str, Any]:
        """Load the policy copy exactly as the torch backend loads it, and wrap it in the engine.

        With ``rollout.exact_logprobs`` (resolved to true by the driver) the copy is the
        trainer's module as it trains: LoRA adapters injected the same way (the sync sends them
        unmerged, ``TorchBackend.weights_for_sync``) and the exact kernels switched on."""
        from omni_grpo.backends.torch_backend import load_policy, resolve_device
        from omni_grpo.models.sideband import media_token_ids
        from omni_grpo.rollout.embedded import EmbeddedEngine
        from omni_grpo.run.process import configure_threads

        configure_threads(self.cfg.trainer.device)
        device = resolve_device(self.cfg.trainer.device)
        policy = load_policy(self.cfg.model, device)
        self.exact = self.cfg.rollout.exact_logprobs is True
        self.lora = self.exact and self.cfg.trainer.lora is not None
        if self.lora:
            from omni_grpo.models.lora import apply_lora

            apply_lora(policy, self.cfg.trainer.lora)
        if self.exact:
            from omni_grpo.exact import enable_exact_logprobs

            enable_exact_logprobs(policy)  # raises where the device cannot
        policy.eval()
        self.policy = policy
        # Every tensor of the module by name: the sync sends the trainer's own names (the module
        # class is the same), and towers too, since this engine CAN refit its encoders.
        self.params = dict(policy.state_dict())
        banned = media_token_ids(policy)
        self.engine = EmbeddedEngine.from_rollout_config(
            self.cfg.rollout,
            policy=policy,
            eos_token_ids=eos_token_ids,
            device=str(device),
            version_fn=lambda: self.version,
            banned_token_ids=banned,
        )
        log.info("rollout actor %d ready on %s", self.index, device)
        return {"device": str(device), "banned_token_ids": banned, "pid": os.getpid()}

    def generate(
        self, prompts: list[Any], n: int, sampling: Any, seeds: list[int]
    ) -> list[list[tuple[list[int], list[float], str, str]]]:
        """``n`` completions per prompt, each prompt's sampling seeded by ``seeds[i]``: the result
        depends on the prompt and its seed only, not on which actor drew it or when.

        Returns ``(token_ids, logprobs, finish_reason, weight_version)`` per completion: the
        driver still holds the prompts, so they are not sent back.
        """
        import torch

        out = []
        for prompt, seed in zip(prompts, seeds, strict=True):
            torch.manual_seed(seed)
            (group,) = self.engine.generate([prompt], n, sampling)
            out.append(
                [(c.token_ids, c.logprobs, c.finish_reason, c.weight_version) for c in group]
            )
        return out

    # ---------------------------------------------------------------- weight sync, receiving end
    def join_weight_group(
        self, master_address: str, master_port: int, world_size: int, rank: int, group_name: str,
        backend: str, timeout_s: float,
    ) -> None:  # fmt: skip
        """Join the driver's weight-update group (blocks until every rank has joined)."""
        from omni_grpo.sync.group import build_group, join_store

        store = join_store(master_address, master_port, world_size, timeout_s)
        self.group = build_group(
            store,
            group_name=group_name,
            world_size=world_size,
            rank=rank,
            backend=backend,
            timeout_s=timeout_s,
        )

    def receive_bucket(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], version: str | None
    ) -> int:
        """Receive one bucket (one flat broadcast per dtype from group rank 0, ``dtype_runs``)
        into the policy."""
        import torch

        from omni_grpo.sync.buckets import dtype_runs, unflatten

        unknown = [n for n in names if n not in self.params]
        received: list[tuple[str, Any]] = []
        for dtype, idx in dtype_runs(dtypes):
            dev = (
                "cpu"
                if self.group.backend == "gloo"
                else self.params.get(names[idx[0]], torch.empty(0)).device
            )
            numel = sum(math.prod(shapes[i]) for i in idx)
            flat = torch.empty(numel, dtype=getattr(torch, dtype), device=dev)
            self.group.broadcast(flat, src=0).wait()
            views = unflatten(flat, [shapes[i] for i in idx])
            received.extend((names[i], t) for i, t in zip(idx, views, strict=True))
        if unknown:  # after receiving, so the sender's collectives complete either way
            raise KeyError(f"rollout actor {self.index}: weights not in the policy: {unknown[:5]}")
        with torch.no_grad():
            for name, t in received:
                target = self.params[name]
                if tuple(target.shape) != tuple(t.shape):
                    raise ValueError(
                        f"rollout actor {self.index}: {name} has shape {tuple(target.shape)}, "
                        f"received {tuple(t.shape)}"
                    )
                target.copy_(t)
        if self.lora:  # the grouped experts' bf16 factors are cached per optimizer step
            from omni_grpo.models.grouped_experts import invalidate_factor_caches

            invalidate_factor_caches(self.policy)
        if version is not None:
            self.version = version
        return len(received)

    def weight_version(self) -> str:
        return self.version

    def leave_weight_group(self) -> None:
        if self.group is not None:
            self.group.destroy()
            self.group = None


class ServerActor:
    """One launched rollout server (``omni_grpo.serve.launch``) and its lifetime."""

    def __init__(self, index: int, launch_cfg: Any, model_path: str, log_path: str) -> None:
        log_to_file(Path(log_path).with_suffix(".actor.log"), f"server actor {index}")
        self.index = int(index)
        self.cfg = launch_cfg
        self.model_path = model_path
        self.log_path = Path(log_path)
        self.server: Any = None

    def start(self) -> str:
        """Start the server on this node, wait until it serves; returns its URL."""
        from omni_grpo.serve import launch, launch_args

        self.server = launch(
            self.cfg.kind,
            self.model_path,
            self.log_path,
            ready_timeout_s=self.cfg.ready_timeout_s,
            host=node_address(),
            extra_args=launch_args(self.cfg),  # the thinker TP over its GPUs, then extra_args
            name=f"rollout server {self.index}",
        )
        log.info("server %d serving at %s", self.index, self.server.url)
        return self.server.url

    def returncode(self) -> int | None:
        return None if self.server is None else self.server.returncode()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

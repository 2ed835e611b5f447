"""The embedded engine spread over Ray rollout actors, and the weight sync that keeps them current.

:class:`RayRolloutEngine` is a ``RolloutEngine`` for the driver's loop. It splits a step's prompts
into contiguous chunks, one per actor, and reassembles the groups in prompt order. Each prompt
gets its own sampling seed, drawn from the driver's torch RNG, which every checkpoint saves. So
what comes back depends only on the data order and the seed: not on the number of actors, not
on which actor finishes first, and a resumed run samples what the uninterrupted one would.

:class:`ActorWeightSync` is a ``WeightSync`` (``push(named_tensors, version, layout)`` /
``close``) that uses the same parts as ``sync.distributed`` against real servers:

* a weight-update group whose rendezvous store the driver hosts (``sync.group.host_store`` /
  ``build_group``, kept apart from any default process group), joined by actor ``i`` at rank
  ``1 + i``;
* size-bounded buckets (``sync.buckets``) sent from rank 0 as one flat broadcast per dtype
  (``dtype_runs``; a server needs one per tensor, these actors do not);
* the version set with the last bucket only.

Unlike a sglang-omni server, a rollout actor holds the same module class as the trainer. So
tensors go under the trainer's own names, and the vision tower goes too (a server's encoder
stages cannot be refit, contract §4.7; these actors can, and ``examples/tiny.yaml`` trains the
vision tower). The source must therefore be in the module's own ``hf_memory`` layout.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from omni_grpo.ray.errors import ActorFailure
from omni_grpo.run.signals import find_interrupt
from omni_grpo.sync.base import NamedTensors, SourceLayout, SyncReport, WeightSyncError
from omni_grpo.sync.buckets import buckets, dtype_runs, flatten
from omni_grpo.sync.group import build_group, host_store
from omni_grpo.types import Completion, PromptInputs, SamplingParams

log = logging.getLogger(__name__)


def split_evenly(items: list[Any], parts: int) -> list[list[Any]]:
    """Contiguous chunks whose sizes differ by at most one, in order (empty chunks at the end)."""
    q, r = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + q + (1 if i < r else 0)
        out.append(items[start:end])
        start = end
    return out


class RayRolloutEngine:
    """``RolloutEngine`` over rollout actors (see module doc)."""

    def __init__(self, actors: Any, decode_fn: Any = None) -> None:
        self.actors = actors  # omni_grpo.ray.driver.ActorSet of RolloutActor
        self.decode_fn = decode_fn

    def generate(
        self, prompts: list[PromptInputs], n: int, sampling: SamplingParams
    ) -> list[list[Completion]]:
        seeds = torch.randint(0, 2**62, (len(prompts),)).tolist()
        chunks = split_evenly(list(range(len(prompts))), len(self.actors))
        calls = [
            (
                i,
                handle.generate.remote(
                    [prompts[j] for j in idx], n, sampling, [seeds[j] for j in idx]
                ),
            )
            for i, (handle, idx) in enumerate(zip(self.actors.handles, chunks, strict=True))
            if idx
        ]
        results = self.actors.get([ref for _, ref in calls], [i for i, _ in calls], "generate")
        groups: list[list[Completion]] = []
        for (i, _), chunk in zip(calls, results, strict=True):
            for j, rows in zip(chunks[i], chunk, strict=True):
                groups.append(
                    [
                        Completion(
                            prompt=prompts[j],
                            token_ids=ids,
                            logprobs=lps,
                            finish_reason=reason,
                            weight_version=version,
                            text=self.decode_fn(ids) if self.decode_fn is not None else "",
                        )
                        for ids, lps, reason, version in rows
                    ]
                )
        return groups

    def close(self) -> None:
        """The actors belong to the run (``RayRun.close``); nothing is held here."""


class ActorWeightSync:
    """``WeightSync`` from the driver (rank 0) into every rollout actor (see module doc)."""

    mode = "distributed"

    def __init__(
        self,
        actors: Any,
        *,
        master_address: str,
        backend: str = "gloo",
        bucket_bytes: int = 512 << 20,
        timeout_s: float = 600.0,
    ) -> None:
        self.actors = actors
        self.master_address = master_address
        self.backend = backend
        self.bucket_bytes = int(bucket_bytes)
        self.timeout_s = float(timeout_s)
        self.group: Any = None

    def connect(self) -> Any:
        if self.group is not None:
            return self.group
        world = 1 + len(self.actors)
        name = f"omni_grpo_rollout_{uuid.uuid4().hex[:8]}"
        store = host_store(self.master_address, world, self.timeout_s)
        joins = [
            a.join_weight_group.remote(
                self.master_address, store.port, world, 1 + i, name, self.backend, self.timeout_s
            )
            for i, a in enumerate(self.actors.handles)
        ]
        self.group = build_group(
            store,
            group_name=name,
            world_size=world,
            rank=0,
            backend=self.backend,
            timeout_s=self.timeout_s,
        )
        self.actors.get(joins, range(len(joins)), "join the weight-update group")
        log.info("rollout weight sync: group %s, world %d via %s", name, world, self.backend)
        return self.group

    def push(
        self, named_tensors: NamedTensors, version: str, *, layout: SourceLayout = "hf_memory"
    ) -> SyncReport:
        if layout != "hf_memory":
            raise WeightSyncError(
                f"embedded rollout actors load the trainer module's own tensors (layout "
                f"'hf_memory'); got {layout!r}: use rollout.engine 'sglang-omni' for this backend"
            )
        start = time.perf_counter()
        group = self.connect()
        pairs: Iterable[tuple[str, torch.Tensor]] = (
            named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        )
        report = SyncReport(version=str(version), mode=self.mode, servers=self.actors.names)
        device = "cpu" if self.backend == "gloo" else "cuda"
        for bucket in buckets(((n, t.detach().contiguous()) for n, t in pairs), self.bucket_bytes):
            refs = [
                a.receive_bucket.remote(
                    bucket.names,
                    bucket.dtypes,
                    bucket.shapes,
                    str(version) if bucket.last else None,
                )
                for a in self.actors.handles
            ]
            try:
                works = [
                    group.broadcast(flatten(bucket.tensors, idx).to(device), src=0)
                    for _, idx in dtype_runs(bucket.dtypes)
                ]
            except Exception as err:  # noqa: BLE001 - a peer is gone: name the actor
                if find_interrupt(err) is not None:
                    raise  # a stop signal, not a broken collective
                raise self.actors.collective_failure(refs, err, "weight sync") from None
            self.actors.wait_works(works, refs, self.timeout_s)
            self.actors.get(refs, range(len(refs)), "receive weights")
            report.buckets += 1
            report.tensors += len(bucket.names)
            report.bytes += bucket.nbytes
        if report.tensors == 0:
            raise WeightSyncError(
                "rollout weight sync got zero tensors: refusing to bump the version"
            )
        report.seconds = time.perf_counter() - start
        return report

    def close(self) -> None:
        group, self.group = self.group, None
        if group is None:
            return
        try:
            self.actors.get(
                [a.leave_weight_group.remote() for a in self.actors.handles],
                range(len(self.actors)),
                "leave the weight-update group",
                120,
            )
        except ActorFailure as err:  # after a failed run: keep the first error in front
            log.warning("closing the rollout weight sync: %s", str(err).splitlines()[0])
        finally:
            group.destroy()

"""``sync_mode: distributed`` — bucketed broadcasts from the trainer into every thinker TP rank.

The sequence (contract §4 and §6.2, trainer_facts §6.2), per server list ``S_1..S_k``:

Once (lazily, on the first push):
  1. ``/model_info`` on each worker -> its thinker TP size ``tp_j``; ``world = 1 + sum(tp)``,
     server ``j`` gets ``rank_offset = 1 + sum(tp_<j)``. Workers are called directly: the router
     refuses group init with more than one live worker.
  2. Host the rendezvous store (rank 0 = trainer) on a free port, POST
     ``/init_weights_update_group`` to every worker (scoped to ``stages=["thinker"]``) and, while
     those requests block server-side, build the trainer's end of the group
     (``omni_grpo.sync.group``: never the trainer's default process group).

Per push(version):
  3. ``/pause_generation {"mode": "retract"}`` on every worker (updates are refused while
     requests are active; retracted requests resume afterwards with the new weights).
  4. For each bucket (default 512 MiB): POST ``/update_weights_from_distributed {names, dtypes,
     shapes, group_name, flush_cache, weight_version}`` to every worker, concurrently with one
     broadcast per tensor from rank 0 in ``names`` order. ``flush_cache`` and ``weight_version``
     go on the LAST bucket only, so the server reports the new version only once every tensor
     has landed (a failure mid-way leaves the old version visible, never a half-new one).
  5. ``/continue_generation`` on every worker — always, also after a failure: sglang-omni keeps
     the engine paused after a failed distributed update.
  6. Verify ``/model_info`` ``weight_version == version`` on every worker.

On any failure the group is considered poisoned (a broadcast may be half-received), so it is
dropped and rebuilt under a fresh group name on the next push; the error is raised.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import Future

import torch
from omni_rollout_client.admin import plan_weight_sync_ranks
from omni_rollout_client.client import OmniRolloutClient, init_weights_update_groups

from omni_grpo.aio import BackgroundLoop, Prefetch, gather
from omni_grpo.sync.base import (
    NamedTensors,
    ServerTensors,
    SourceLayout,
    SyncReport,
    WeightSyncError,
    check_names,
    close_clients,
)
from omni_grpo.sync.buckets import Bucket, buckets
from omni_grpo.sync.group import WeightUpdateGroup, build_group, host_store, reachable_address

log = logging.getLogger(__name__)

DEFAULT_GROUP_NAME = "omni_grpo_weights"
_POLL_S = 0.0005


def default_backend() -> str:
    """NCCL between GPUs; gloo (CPU tensors) when this process has no CUDA device."""
    return "nccl" if torch.cuda.is_available() else "gloo"


class DistributedWeightSync:
    """Weight sync over a torch.distributed group shared with every worker's thinker ranks."""

    mode = "distributed"

    def __init__(
        self,
        clients: Sequence[OmniRolloutClient],
        loop: BackgroundLoop,
        *,
        bucket_bytes: int = 512 << 20,
        backend: str | None = None,
        master_address: str | None = None,
        group_name: str = DEFAULT_GROUP_NAME,
        timeout_s: float = 600.0,
        send_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        verify: bool = True,
        owns_loop: bool = False,
    ) -> None:
        if not clients:
            raise ValueError(
                "distributed weight sync needs the worker URLs (rollout.sglang.urls): each worker "
                "joins the group directly with its own rank offset"
            )
        self.clients = list(clients)
        self.loop = loop
        self.owns_loop = owns_loop
        self._closed = False
        self.bucket_bytes = int(bucket_bytes)
        self.backend = backend or default_backend()
        self.master_address = master_address or reachable_address(self.clients[0].base_url)
        self.group_name = group_name
        self.timeout_s = float(timeout_s)
        self.send_dtype = send_dtype
        if device is None:
            device = "cuda" if self.backend == "nccl" else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            # Pinned now: buckets are moved on a helper thread, whose current device may differ.
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.verify = verify
        self._group: WeightUpdateGroup | None = None
        self._generation = 0

    # ------------------------------------------------------------------ group setup

    @property
    def group(self) -> WeightUpdateGroup | None:
        return self._group

    def connect(self) -> WeightUpdateGroup:
        """Create the weight-update group with every worker (idempotent while it is healthy)."""
        if self._group is not None:
            return self._group
        infos = self.loop.run(gather(c.model_info() for c in self.clients), self.timeout_s)
        tp_sizes = [max(info.thinker_tp_sizes or (1,)) for info in infos]
        plan = plan_weight_sync_ranks(tp_sizes)
        # Unique per process and attempt: torch keeps a dropped (poisoned) group's name registered,
        # and a server may still hold an old group under its name.
        name = f"{self.group_name}_{self._generation}_{uuid.uuid4().hex[:8]}"
        self._generation += 1
        store = host_store(self.master_address, plan.world_size, self.timeout_s)
        log.info(
            "weight sync: group %s world %d (servers %s, rank offsets %s) at %s:%d via %s",
            name,
            plan.world_size,
            [c.base_url for c in self.clients],
            plan.rank_offsets,
            self.master_address,
            store.port,
            self.backend,
        )
        init = self.loop.submit(
            init_weights_update_groups(
                self.clients,
                self.master_address,
                store.port,
                group_name=name,
                backend=self.backend,
                tp_sizes=tp_sizes,
            )
        )
        group = _run_beside(
            lambda: build_group(
                store,
                group_name=name,
                world_size=plan.world_size,
                rank=0,
                backend=self.backend,
                timeout_s=self.timeout_s,
            ),
            init,
            self.timeout_s,
            what="init_weights_update_group",
        )
        self._group = group
        return group

    # ------------------------------------------------------------------ push

    def push(
        self, named_tensors: NamedTensors, version: str, *, layout: SourceLayout = "hf_memory"
    ) -> SyncReport:
        """Send every text/lm_head tensor to every worker under ``version`` (see module doc)."""
        start = time.perf_counter()
        version = str(version)
        check_names(named_tensors)  # a Mapping is checked whole before anything is sent
        source = ServerTensors(named_tensors, layout, self.send_dtype)
        pending = buckets(source, self.bucket_bytes)
        # The first bucket is mapped before the servers are touched: a wrong source (unmapped
        # names, zero tensors, wrong layout) fails without pausing anyone.
        first = next(pending)
        group = self.connect()
        report = SyncReport(
            version=version, mode=self.mode, servers=[c.base_url for c in self.clients]
        )
        error: BaseException | None = None
        try:
            # Inside the try: if one server fails to pause, the others are resumed again.
            self.loop.run(
                gather(c.pause_generation("retract") for c in self.clients), self.timeout_s
            )
            # Bucket k+1 is renamed, transposed and moved to the device on a helper thread while
            # bucket k is on the wire (the conversion would otherwise serialise with it).
            with Prefetch(self._on_device(pending), depth=1) as rest:
                for bucket in itertools.chain([self._to_device(first)], rest):
                    self._send_bucket(group, bucket, version)
                    report.buckets += 1
        except BaseException as exc:
            error = exc
            self._drop_group()
        finally:
            self._resume(error)
        report.tensors, report.bytes = source.tensors, source.bytes
        report.skipped_tower_tensors = source.skipped_towers
        if self.verify:
            self._verify(version)
        report.seconds = time.perf_counter() - start
        return report

    def _to_device(self, bucket: Bucket) -> Bucket:
        bucket.tensors = [t.to(self.device) for t in bucket.tensors]
        return bucket

    def _on_device(self, pending: Iterator[Bucket]) -> Iterator[Bucket]:
        for bucket in pending:
            yield self._to_device(bucket)

    def _send_bucket(self, group: WeightUpdateGroup, bucket: Bucket, version: str) -> None:
        tensors = bucket.tensors
        request = self.loop.submit(
            gather(
                c.update_weights_from_distributed(
                    bucket.names,
                    bucket.dtypes,
                    bucket.shapes,
                    group_name=group.group_name,
                    flush_cache=bucket.last,
                    weight_version=version if bucket.last else None,
                )
                for c in self.clients
            )
        )
        works = [group.broadcast(t) for t in tensors]
        deadline = time.monotonic() + self.timeout_s
        # Wait for both sides; a server that refused the bucket never joins the broadcasts, so
        # its error must surface instead of a hang until the collective times out.
        while not all(w.is_completed() for w in works):
            if request.done() and request.exception() is not None:
                raise request.exception()  # type: ignore[misc]
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"broadcast of {len(works)} tensors not done after {self.timeout_s}s"
                )
            time.sleep(_POLL_S)
        for w in works:
            w.wait()
        remaining = max(1.0, deadline - time.monotonic())
        request.result(remaining)

    def _resume(self, error: BaseException | None) -> None:
        """Continue generation on every worker; chain a failure to the original error if any."""
        try:
            self.loop.run(
                gather((c.continue_generation() for c in self.clients), return_exceptions=False),
                self.timeout_s,
            )
        except BaseException as cont_exc:
            if error is None:
                raise WeightSyncError(
                    f"continue_generation failed after a weight update: {cont_exc}"
                ) from cont_exc
            log.error("continue_generation also failed after a failed weight sync: %s", cont_exc)
        if error is not None:
            raise WeightSyncError(f"distributed weight sync failed: {error}") from error

    def _verify(self, version: str) -> None:
        infos = self.loop.run(gather(c.model_info() for c in self.clients), self.timeout_s)
        got = {c.base_url: i.weight_version for c, i in zip(self.clients, infos, strict=True)}
        bad = {url: v for url, v in got.items() if v != version}
        if bad:
            raise WeightSyncError(
                f"after pushing weight version {version!r}, /model_info reports {bad}: the update "
                "did not take effect on those servers"
            )

    def _drop_group(self) -> None:
        # A broadcast may be half-received: the group's state is unknown, so it is abandoned
        # (not destroyed: destroying with collectives pending can hang) and rebuilt next push.
        self._group = None

    def close(self) -> None:
        """Drop the group on both ends, then close the clients (and the loop, if owned)."""
        if self._closed:
            return
        self._closed = True
        group, self._group = self._group, None
        try:
            if group is not None:
                try:
                    self.loop.run(
                        gather(
                            c.destroy_weights_update_group(group.group_name) for c in self.clients
                        ),
                        self.timeout_s,
                    )
                finally:
                    group.destroy()
        finally:
            close_clients(self.clients, self.loop, owns_loop=self.owns_loop)


def _run_beside(fn, request: Future, timeout_s: float, *, what: str):  # type: ignore[no-untyped-def]
    """Run blocking ``fn`` on a helper thread while ``request`` is in flight; fail fast if the
    request fails (the servers will then never join, and ``fn`` would block to its timeout)."""
    result: dict[str, object] = {}

    def target() -> None:
        try:
            result["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            result["error"] = exc

    thread = threading.Thread(target=target, name=f"omni-grpo-{what}", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while thread.is_alive():
        if request.done() and request.exception() is not None:
            raise WeightSyncError(f"{what} failed: {request.exception()}") from request.exception()
        if time.monotonic() > deadline:
            request.cancel()
            raise WeightSyncError(f"{what}: the servers did not join within {timeout_s}s")
        thread.join(0.01)
    if "error" in result:
        request.cancel()
        raise WeightSyncError(
            f"{what}: building the trainer's end failed: {result['error']}"
        ) from result["error"]  # type: ignore[arg-type]
    try:
        request.result(max(1.0, deadline - time.monotonic()))
    except BaseException as exc:
        raise WeightSyncError(f"{what} failed: {exc}") from exc
    return result["value"]

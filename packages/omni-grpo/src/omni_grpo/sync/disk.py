"""``sync_mode: disk`` — write the thinker weights as safetensors, then ``/update_weights_from_disk``.

Sequence per push(version):
  1. Stream the server-named tensors into ``<sync_dir>/.tmp-<version>-*`` in size-bounded
     shards with an index, rename to ``<sync_dir>/<version>`` (atomic: a server never reads a
     half-written version). Writing happens BEFORE pausing, so rollouts keep running meanwhile.
  2. ``/pause_generation {"mode": "retract"}`` on every target (updates are refused otherwise).
  3. ``/update_weights_from_disk {model_path, weight_version, flush_cache: true}`` scoped to
     ``stages=["thinker"]``, on every target concurrently.
  4. ``/continue_generation`` — always, also after a failure.
  5. Verify ``/model_info`` ``weight_version``; delete older version directories (the servers
     have loaded the new one), keeping ``keep_last``.

The names are the hub Omni ``thinker.*`` names the thinker stage loads (fused experts in the VL
hub layout). ``model_path`` must be readable by the servers under the same path: put ``sync_dir``
on a filesystem they share. Targets are the router (which broadcasts admin calls) when
configured, else each worker URL.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from omni_rollout_client.client import OmniRolloutClient

from omni_grpo.aio import BackgroundLoop, gather
from omni_grpo.sync.base import (
    NamedTensors,
    ServerTensors,
    SourceLayout,
    SyncReport,
    WeightSyncError,
    check_names,
    close_clients,
)
from omni_grpo.sync.disk_writer import DEFAULT_SHARD_BYTES, version_dirname, write_weights_dir

log = logging.getLogger(__name__)


class DiskWeightSync:
    """Weight sync through a shared directory and ``/update_weights_from_disk``."""

    mode = "disk"

    def __init__(
        self,
        clients: Sequence[OmniRolloutClient],
        loop: BackgroundLoop,
        sync_dir: Path,
        *,
        shard_bytes: int = DEFAULT_SHARD_BYTES,
        timeout_s: float = 600.0,
        send_dtype: torch.dtype | None = None,
        keep_last: int = 1,
        verify: bool = True,
        owns_loop: bool = False,
    ) -> None:
        if not clients:
            raise ValueError(
                "disk weight sync needs rollout.sglang.urls or rollout.sglang.router_url"
            )
        if keep_last < 1:
            raise ValueError(
                f"keep_last must be >= 1 (the servers read the newest), got {keep_last}"
            )
        self.clients = list(clients)
        self.owns_loop = owns_loop
        self._closed = False
        self.loop = loop
        self.sync_dir = Path(sync_dir).absolute()
        self.shard_bytes = shard_bytes
        self.timeout_s = float(timeout_s)
        self.send_dtype = send_dtype
        self.keep_last = keep_last
        self.verify = verify
        self._written: list[Path] = []

    def push(
        self, named_tensors: NamedTensors, version: str, *, layout: SourceLayout = "hf_memory"
    ) -> SyncReport:
        start = time.perf_counter()
        version = str(version)
        dst = self.sync_dir / version_dirname(version)
        check_names(named_tensors)
        if dst.exists():
            # A resumed run re-pushing its step, or a retry after a failed load: the servers hold
            # weights in memory, not in these files, so the old copy can go.
            log.warning(
                "weight sync: replacing existing %s (version %r pushed again)", dst, version
            )
            shutil.rmtree(dst)
        source = ServerTensors(named_tensors, layout, self.send_dtype)
        write_weights_dir(source, dst, version=version, shard_bytes=self.shard_bytes)
        report = SyncReport(
            version=version,
            mode=self.mode,
            servers=[c.base_url for c in self.clients],
            tensors=source.tensors,
            bytes=source.bytes,
            skipped_tower_tensors=source.skipped_towers,
            buckets=1,
        )
        error: BaseException | None = None
        try:
            # Inside the try: if one server fails to pause, the others are resumed again.
            self.loop.run(
                gather(c.pause_generation("retract") for c in self.clients), self.timeout_s
            )
            self.loop.run(
                gather(
                    c.update_weights_from_disk(str(dst), weight_version=version, flush_cache=True)
                    for c in self.clients
                ),
                self.timeout_s,
            )
        except BaseException as exc:
            error = exc
        finally:
            try:
                self.loop.run(gather(c.continue_generation() for c in self.clients), self.timeout_s)
            except BaseException as cont_exc:
                if error is None:
                    raise WeightSyncError(
                        f"continue_generation failed after loading {dst}: {cont_exc}"
                    ) from cont_exc
                log.error(
                    "continue_generation also failed after a failed disk update: %s", cont_exc
                )
        if error is not None:
            raise WeightSyncError(f"update_weights_from_disk({dst}) failed: {error}") from error
        if self.verify:
            infos = self.loop.run(gather(c.model_info() for c in self.clients), self.timeout_s)
            bad = {
                c.base_url: i.weight_version
                for c, i in zip(self.clients, infos, strict=True)
                if i.weight_version != version
            }
            if bad:
                raise WeightSyncError(
                    f"after loading {dst}, /model_info reports weight versions {bad}, expected {version!r}"
                )
        self._written.append(dst)
        while len(self._written) > self.keep_last:
            old = self._written.pop(0)
            shutil.rmtree(old, ignore_errors=True)
        report.seconds = time.perf_counter() - start
        return report

    def close(self) -> None:
        """Close the clients (and the loop, if owned); idempotent."""
        if not self._closed:
            self._closed = True
            close_clients(self.clients, self.loop, owns_loop=self.owns_loop)

"""Weight sync from the trainer to the rollout engine (``rollout.sglang.sync_mode``).

``make_weight_sync(cfg.rollout.sglang, run_dir=...)`` returns a ``WeightSync`` whose
``push(named_tensors, version, layout=...)`` the trainer calls after each optimizer step:

* ``skip``        — nothing is sent (logged once);
* ``disk``        — safetensors under ``sync_dir`` (default ``<run_dir>/weight_sync``), then
                    ``/update_weights_from_disk`` (``omni_grpo.sync.disk``);
* ``distributed`` — bucketed ``torch.distributed`` broadcasts into every thinker TP rank,
                    driven by ``/update_weights_from_distributed`` (``omni_grpo.sync.distributed``).

Any source works — a transformers thinker's ``state_dict()`` / ``named_parameters()``
(``layout="hf_memory"``), or an iterator of HF names from a Megatron-Bridge export
(``layout="vl_hub"``): names go through omni-extract's one name table, unknown names fail loud,
tower tensors are skipped (the server cannot refit its encoders). The embedded engine shares the
trainer's module and needs no sync at all.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from omni_grpo.sync.base import (
    NamedTensors,
    SourceLayout,
    SyncReport,
    WeightSync,
    WeightSyncError,
    check_names,
)
from omni_grpo.sync.skip import SkipWeightSync

__all__ = [
    "NamedTensors",
    "SourceLayout",
    "SyncReport",
    "WeightSync",
    "WeightSyncError",
    "SkipWeightSync",
    "check_names",
    "make_weight_sync",
]


def make_weight_sync(
    cfg: Any,
    *,
    run_dir: Path,
    loop: Any = None,
    send_dtype: torch.dtype | None = None,
    **kwargs: Any,
) -> WeightSync:
    """Build the configured weight sync from ``SglangOmniConfig`` (``cfg.rollout.sglang``).

    ``kwargs`` go to the implementation (e.g. ``master_address``, ``backend`` for distributed).
    The sync owns its clients and its event-loop thread unless ``loop`` is given.
    """
    if cfg.sync_mode == "skip":
        return SkipWeightSync()
    from omni_grpo.aio import BackgroundLoop
    from omni_grpo.sglang import make_clients

    own_loop = loop is None
    loop = loop or BackgroundLoop("omni-grpo-weight-sync")
    if cfg.sync_mode == "disk":
        from omni_grpo.sync.disk import DiskWeightSync

        sync: Any = DiskWeightSync(
            make_clients(cfg),
            loop,
            Path(cfg.sync_dir or Path(run_dir) / "weight_sync"),
            send_dtype=send_dtype,
            owns_loop=own_loop,
            **{"timeout_s": cfg.timeout_s, **kwargs},
        )
    elif cfg.sync_mode == "distributed":
        from omni_grpo.sync.distributed import DistributedWeightSync

        clients = make_clients(cfg, workers=True)
        if not clients and cfg.router_url:
            router = make_clients(cfg)[0]
            clients = loop.run(router.worker_clients(), cfg.timeout_s)
        options = {"bucket_bytes": cfg.bucket_mb << 20, "timeout_s": cfg.timeout_s, **kwargs}
        sync = DistributedWeightSync(
            clients, loop, send_dtype=send_dtype, owns_loop=own_loop, **options
        )
    else:
        raise ValueError(
            f"rollout.sglang.sync_mode: expected skip|disk|distributed, got {cfg.sync_mode!r}"
        )
    return sync

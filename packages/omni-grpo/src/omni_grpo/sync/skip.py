"""``sync_mode: skip`` — push nothing (benchmarks, debugging, or a frozen-policy eval run)."""

from __future__ import annotations

import time

from omni_grpo.sync.base import LogOnce, NamedTensors, SourceLayout, SyncReport


class SkipWeightSync:
    """No-op weight sync; says once that the servers keep serving their startup weights."""

    mode = "skip"

    def __init__(self) -> None:
        self._warn = LogOnce()

    def push(
        self, named_tensors: NamedTensors, version: str, *, layout: SourceLayout = "hf_memory"
    ) -> SyncReport:
        start = time.perf_counter()
        self._warn(
            "weight sync is 'skip': the rollout servers keep their startup weights, so rollouts "
            "come from a stale policy (version %r not pushed; further pushes are silent)",
            version,
        )
        return SyncReport(version=str(version), mode=self.mode, seconds=time.perf_counter() - start)

    def close(self) -> None:
        pass

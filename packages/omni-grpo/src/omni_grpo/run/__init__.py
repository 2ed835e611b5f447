"""Run management: atomic resumable checkpoints, metrics (jsonl / TensorBoard / W&B), progress, plots."""

from omni_grpo.run.checkpoint import (
    CheckpointError,
    DataCursor,
    latest_checkpoint,
    load_checkpoint,
    restore_rng,
    rng_state,
    save_checkpoint,
)
from omni_grpo.run.metrics import MetricsLogger, read_metrics

__all__ = [
    "CheckpointError",
    "DataCursor",
    "MetricsLogger",
    "latest_checkpoint",
    "load_checkpoint",
    "read_metrics",
    "restore_rng",
    "rng_state",
    "save_checkpoint",
]

"""Per-process setup shared by the loop (``trainer.train``), ``eval`` and the Ray actors.

Every process that runs the model sets its intra-op threads and seeds the same way; the helpers
live here, below both the loop and the actors, so neither has to import the other.
"""

from __future__ import annotations

import os
import random

import numpy as np
import torch


def configure_threads() -> None:
    """Intra-op threads for CPU runs: ``OMNI_GRPO_TORCH_THREADS`` (default 1).

    The embedded CPU path runs tiny models whose ops take microseconds; there OpenMP threads only
    add synchronisation, and on a shared or oversubscribed machine their spin-waits made one
    rollout 30-100x slower than a single thread (measured: 0.5-2 s vs 17 ms per group of 8).
    """
    threads = int(os.environ.get("OMNI_GRPO_TORCH_THREADS", "1"))
    if threads > 0:
        torch.set_num_threads(threads)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)

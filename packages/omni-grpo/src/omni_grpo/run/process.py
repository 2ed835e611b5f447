"""Per-process setup shared by the loop (``trainer.train``), ``eval`` and the Ray actors.

Every process that runs the model sets its intra-op threads and seeds the same way; the helpers
live here, below both the loop and the actors, so neither has to import the other.
"""

from __future__ import annotations

import os
import random

import numpy as np
import torch


def configure_threads(device: str = "cpu") -> None:
    """Intra-op threads for CPU runs: ``OMNI_GRPO_TORCH_THREADS`` (default 1); on a GPU, torch's
    own default unless that variable is set.

    The embedded CPU path runs tiny models whose ops take microseconds; there OpenMP threads only
    add synchronisation, and on a shared or oversubscribed machine their spin-waits made one
    rollout 30-100x slower than a single thread (measured: 0.5-2 s vs 17 ms per group of 8).
    A GPU run is the opposite case: its CPU work (media preprocessing, packing micro-batches,
    host copies) is large and the GPU waits for it. One thread there made ``omni-grpo train``'s
    4-layer step 24 % slower than the same step in ``benchmarks/one_gpu_thinker.py`` on an H200.
    ``device``: ``trainer.device`` (``auto`` is a GPU run when torch sees one).
    """
    on_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    raw = os.environ.get("OMNI_GRPO_TORCH_THREADS")
    if raw is None and not on_cpu:
        return
    threads = int(raw if raw is not None else "1")
    if threads > 0:
        torch.set_num_threads(threads)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)

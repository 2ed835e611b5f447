"""A local data-parallel world for tests: N spawned processes with a gloo default process group.

The product starts trainer ranks as Ray actors; tests of the collective maths (the torch
backend's DP step against the single-process one) only need N processes that run one function
with ``torch.distributed`` initialised from the usual env (``MASTER_ADDR`` / ``MASTER_PORT`` /
``RANK`` / ``WORLD_SIZE``), exactly what a trainer actor sets up. ``run_world`` spawns them with
``torch.multiprocessing``, collects each rank's return value, and re-raises a rank's exception.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from omni_grpo.serve import free_port


def _entry(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    out_dir: str,
    timeout_s: float,
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size)
    )
    torch.set_num_threads(int(os.environ.get("OMNI_GRPO_TORCH_THREADS", "1")))
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    try:
        torch.save(fn(rank, world_size, *args), Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_world(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 300.0
) -> list[Any]:
    """``[fn(rank, world_size, *args) for each rank]``, each rank in its own process (gloo).

    ``fn`` must be importable by name (a module-level function): spawned children re-import it.
    A collective that does not complete within ``timeout_s`` fails the rank instead of hanging.
    """
    with tempfile.TemporaryDirectory(prefix="omni-grpo-dp-") as out:
        mp.spawn(
            _entry,
            args=(world_size, free_port(), fn, args, out, timeout_s),
            nprocs=world_size,
            join=True,
        )
        return [
            torch.load(Path(out) / f"rank{r}.pt", weights_only=False) for r in range(world_size)
        ]


def torch_backend_steps(
    rank: int,
    world_size: int,
    vl_dir: str,
    audio_dir: str,
    trainer_cfg: dict[str, Any],
    algo_cfg: dict[str, Any],
    pad_token_id: int,
    shards: list[list[Any]],
    warmup: tuple[list[Any], list[Any], float] | None = None,
    freeze_visual: bool = True,
) -> dict[str, Any]:
    """On one rank: build the torch backend from the extracted checkpoint, optionally run one
    ``supervised_step(prompts[rank], targets[rank], lr)`` (``warmup``), then
    ``step(shards[s][rank])`` for each step ``s``; returns the warm-up NLL, the metrics of every
    step and the trainable weights after each."""
    from omni_grpo.backends.torch_backend import TorchBackend
    from omni_grpo.config import AlgoConfig, TrainerConfig
    from omni_grpo.models import load_thinker

    model = load_thinker(vl_dir, audio_dir=audio_dir, freeze_visual=freeze_visual)
    backend = TorchBackend(
        model, TrainerConfig(**trainer_cfg), AlgoConfig(**algo_cfg), pad_token_id=pad_token_id
    )
    nll = None
    if warmup is not None:
        prompts, targets, lr = warmup
        nll = backend.supervised_step(prompts[rank], targets[rank], lr)
    metrics, weights = [], []
    for step in shards:
        metrics.append(backend.step(step[rank]))
        weights.append(backend.trainable_state())
    return {"nll": nll, "metrics": metrics, "weights": weights, "is_driver": backend.is_driver}

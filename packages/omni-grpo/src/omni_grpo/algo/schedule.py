"""The learning rate of each GRPO step, from the step number alone.

The loop computes it (``lr_at``) and hands it to the backend in ``GRPOBatch.lr``; every backend
sets it on its optimizer right before the update (``omni_grpo.algo.step.apply_lr``). Keeping the
schedule a pure function of the step, not an optimizer-side scheduler object, means it needs no
state in the checkpoint, is identical on every data-parallel rank and for both backends, and a
resumed run continues on the same curve.

Why a decay at all: GRPO at a constant, high learning rate keeps taking full-size steps after a
task is solved, and each one moves the shared weights of the other tasks too; a late decay lets a
converged policy settle instead of wobbling around its solution (the tiny demo's sampled reward
dipped for a few steps after learning at a constant lr, ``benchmarks/demo_seeds.py``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from omni_grpo.config import LrScheduleConfig


def lr_at(step: int, total_steps: int, base_lr: float, schedule: LrScheduleConfig) -> float:
    """The learning rate of GRPO step ``step`` (1-based) of ``total_steps``.

    ``warmup_steps`` ramp linearly up to ``base_lr`` (step 1 gets ``base_lr / warmup_steps``);
    after them ``constant`` stays at ``base_lr``; ``cosine`` and ``linear`` start at ``base_lr``
    on the first step after the ramp and fall to ``min_lr_ratio * base_lr``, reached at
    ``total_steps`` (and kept beyond it).
    """
    if step < 1:
        raise ValueError(f"GRPO steps count from 1, got {step}")
    warm = schedule.warmup_steps
    if warm and step <= warm:
        return base_lr * step / warm
    if schedule.kind == "constant":
        return base_lr
    # the first step after the ramp trains at base_lr, the last one at the floor
    span = max(total_steps - warm - 1, 1)
    progress = min((step - warm - 1) / span, 1.0)
    floor = schedule.min_lr_ratio
    if schedule.kind == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        shape = 1.0 - progress
    return base_lr * (floor + (1.0 - floor) * shape)

"""The GRPO learning-rate schedule (``omni_grpo.algo.schedule``) and how it reaches the optimizer."""

from __future__ import annotations

import math

import pytest
import torch
from omni_grpo.algo.schedule import lr_at
from omni_grpo.algo.shard import shard_batch
from omni_grpo.algo.step import apply_lr, current_lr
from omni_grpo.config import LrScheduleConfig, TrainerConfig
from omni_grpo.types import Completion, GRPOBatch, PromptInputs, Sample
from pydantic import ValidationError


def test_constant_is_the_default_and_ignores_the_step() -> None:
    sched = TrainerConfig().lr_schedule
    assert sched.kind == "constant"
    assert {lr_at(s, 100, 2e-3, sched) for s in (1, 50, 100)} == {2e-3}


def test_cosine_falls_from_lr_to_the_floor_at_the_last_step() -> None:
    sched = LrScheduleConfig(kind="cosine", min_lr_ratio=0.1)
    assert lr_at(1, 161, 1.0, sched) == 1.0
    assert lr_at(41, 161, 1.0, sched) == pytest.approx(0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2)
    assert lr_at(81, 161, 1.0, sched) == pytest.approx(0.55)  # half-way: the mean of lr and floor
    assert lr_at(161, 161, 1.0, sched) == pytest.approx(0.1)
    assert lr_at(500, 161, 1.0, sched) == pytest.approx(0.1)  # past the end: the floor, not a rise
    values = [lr_at(s, 161, 1.0, sched) for s in range(1, 162)]
    assert values == sorted(values, reverse=True)


def test_linear_decay_and_the_warmup_ramp() -> None:
    sched = LrScheduleConfig(kind="linear", warmup_steps=4)
    assert [lr_at(s, 13, 1.0, sched) for s in (1, 2, 4, 5)] == [0.25, 0.5, 1.0, 1.0]
    assert lr_at(9, 13, 1.0, sched) == pytest.approx(0.5)
    assert lr_at(13, 13, 1.0, sched) == 0.0
    ramp_only = LrScheduleConfig(warmup_steps=3)  # constant after the ramp
    assert [lr_at(s, 10, 3.0, ramp_only) for s in (1, 3, 4, 10)] == [1.0, 3.0, 3.0, 3.0]


def test_bad_schedules_are_refused() -> None:
    with pytest.raises(ValidationError, match="min_lr_ratio"):
        LrScheduleConfig(kind="cosine", min_lr_ratio=1.5)
    with pytest.raises(ValidationError, match="kind"):
        LrScheduleConfig(kind="exponential")
    with pytest.raises(ValueError, match="from 1"):
        lr_at(0, 10, 1.0, LrScheduleConfig())


def test_the_batch_lr_reaches_the_optimizer_and_every_shard() -> None:
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
    apply_lr(opt, None)  # a hand-built batch: the optimizer keeps trainer.lr
    assert current_lr(opt) == 1e-3
    apply_lr(opt, 2.5e-4)
    assert current_lr(opt) == 2.5e-4
    p = PromptInputs(Sample("u", "p", "A"), [1, 2, 3])
    groups = [[Completion(p, [7] * n, [-1.0] * n, "stop") for n in (1, 2)] for _ in range(3)]
    batch = GRPOBatch(groups, torch.ones(3, 2), temperature=0.7, lr=2.5e-4)
    assert {s.lr for s in shard_batch(batch, 2)} == {2.5e-4}

"""The shared step policy (``omni_grpo.algo.step``) against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch
from omni_grpo.algo.step import (
    MetricSums,
    StepCounts,
    current_lr,
    global_counts,
    local_counts,
    should_step,
    step_metrics,
)
from omni_grpo.config import AlgoConfig
from omni_grpo.types import Completion, GRPOBatch, PromptInputs, Sample


def _batch(lengths: list[list[int]], advantages: list[list[float]]) -> GRPOBatch:
    p = PromptInputs(Sample("u", "p", "A"), [1, 2, 3])
    groups = [[Completion(p, [7] * n, [-1.0] * n, "stop") for n in g] for g in lengths]
    return GRPOBatch(groups, torch.tensor(advantages))


def test_counts_include_empty_completions_as_samples() -> None:
    c = local_counts(_batch([[3, 0], [2, 5]], [[1.0, -1.0], [0.5, -0.5]]))
    assert c == StepCounts(num_samples=4.0, num_tokens=10.0, has_signal=True)


def test_signal_needs_a_completion_with_tokens() -> None:
    # the only non-zero advantage sits on an empty completion: its gradient is exactly zero
    assert not local_counts(_batch([[3, 0]], [[0.0, 1.0]])).has_signal
    assert local_counts(_batch([[3, 0]], [[1.0, 0.0]])).has_signal
    assert not local_counts(GRPOBatch([], torch.zeros(0, 4))).has_signal  # an empty shard


def test_global_counts_is_the_identity_in_one_process() -> None:
    c = StepCounts(3.0, 9.0, False)
    assert global_counts(c) is c


@pytest.mark.parametrize(
    ("norm", "signal", "algo", "expected"),
    [
        (1.0, True, {}, "step"),
        (float("nan"), True, {}, "skip_nonfinite"),
        (float("inf"), False, {}, "skip_nonfinite"),
        (0.0, False, {}, "no_signal"),
        (0.0, False, {"kl_coef": 0.1}, "step"),  # the KL term pulls towards the reference
        (0.0, False, {"entropy_coef": 0.01}, "step"),
    ],
)
def test_should_step(norm: float, signal: bool, algo: dict, expected: str) -> None:
    assert should_step(norm, signal, AlgoConfig(**algo)) == expected


def test_metrics_sum_loss_parts_and_weight_the_rest_by_tokens() -> None:
    sums = MetricSums()
    sums.add({"loss": 0.25, "pg_loss": 0.2, "pg_clipfrac": 0.5, "response_tokens": 2.0}, 2.0)
    sums.add({"loss": 0.5, "pg_loss": 0.4, "pg_clipfrac": 0.0, "ppo_kl": 0.3}, 6.0)
    sums.add({"loss": 0.0, "train_rollout_logprob_pearson": float("nan")}, 1.0)
    out = step_metrics(
        sums, StepCounts(5.0, 9.0, True), 1.5, ["step", "no_signal", "skip_nonfinite"], 1e-3
    )
    assert out["loss"] == pytest.approx(0.75)  # parts of one normalised loss: they add up
    assert out["pg_loss"] == pytest.approx(0.6)
    assert out["pg_clipfrac"] == pytest.approx((0.5 * 2 + 0.0 * 6) / 8)  # per token
    assert out["ppo_kl"] == pytest.approx(0.3)  # only the micro-batch that reported it
    assert "train_rollout_logprob_pearson" not in out  # non-finite means are left out
    assert out["response_tokens"] == 9.0 and out["micro_batches"] == 3.0
    assert (out["skipped_step"], out["no_signal_step"]) == (1.0, 1.0)
    assert out["grad_norm"] == 1.5 and out["lr"] == 1e-3


def test_deferred_metrics_read_once_sum_as_metric_sums() -> None:
    """``DeferredMetrics`` holds the device tensors and sums their floats as ``MetricSums``
    would have, micro-batch by micro-batch (the same float arithmetic, the same order)."""
    import torch
    from omni_grpo.algo.step import DeferredMetrics

    parts = [
        ({"loss": 0.25, "pg_clipfrac": 0.5, "train_rollout_logprob_pearson": 0.9}, 2.0),
        ({"loss": 0.5, "pg_clipfrac": 0.1, "train_rollout_logprob_pearson": float("nan")}, 6.0),
        ({"loss": 0.0, "ppo_kl": 0.3}, 1.0),
    ]
    direct, deferred = MetricSums(), DeferredMetrics()
    for metrics, tokens in parts:
        as_read = {k: torch.tensor(v).item() for k, v in metrics.items()}  # float32, then float
        direct.add(as_read, tokens)
        deferred.add({k: torch.tensor(v) for k, v in metrics.items()}, tokens)
    resolved = deferred.resolve()
    assert deferred.pending == [] and resolved.micro_batches == 3
    assert dict(resolved.sums) == dict(direct.sums)
    assert dict(resolved.weights) == dict(direct.weights)
    assert DeferredMetrics().resolve().micro_batches == 0


def test_merge_equals_one_accumulator() -> None:
    parts = [({"loss": 0.1, "pg_clipfrac": 0.2}, 3.0), ({"loss": 0.3, "pg_clipfrac": 0.6}, 1.0)]
    one = MetricSums()
    for m, t in parts:
        one.add(m, t)
    a, b = MetricSums(), MetricSums()
    a.add(*parts[0])
    b.add(*parts[1])
    merged = a.merge([b, MetricSums()])  # the third: a rank with an empty shard
    assert merged.means() == pytest.approx(one.means())
    assert merged.micro_batches == 2


def test_lr_is_read_from_the_optimizer() -> None:
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=3e-4)
    opt.param_groups[0]["lr"] = 1e-5  # a scheduler or the warm-up changed it
    assert math.isclose(current_lr(opt), 1e-5)

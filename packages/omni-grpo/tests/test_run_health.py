"""The collapse watch and the per-modality health metrics (issue 16)."""

from __future__ import annotations

import logging

import pytest
import torch
from omni_grpo.run.health import SignalWatch
from omni_grpo.trainer import rollout_metrics
from omni_grpo.types import Completion, PromptInputs, Sample


def _group(modality: str, rewards: list[float], logp: float) -> list[Completion]:
    prompt = PromptInputs(
        sample=Sample(uid=modality, prompt="", label="A", modality=modality), input_ids=[1]
    )
    return [Completion(prompt, [5, 6], [logp, 0.0], "stop", reward=r) for r in rewards]


def test_rollout_metrics_per_modality_entropy_and_zero_variance() -> None:
    groups = [
        _group("image", [1, 0, 1, 0], -0.7),
        _group("image", [1, 1, 1, 1], -0.1),
        _group("video", [0, 0, 0, 0], -0.01),
    ]
    rewards = torch.tensor([[float(c.reward) for c in g] for g in groups])
    m = rollout_metrics(groups, rewards)
    assert m["signal/image"] == 0.5 and m["zero_variance_frac/image"] == 0.5
    assert m["signal/video"] == 0.0 and m["zero_variance_frac/video"] == 1.0
    assert m["zero_variance_frac"] == pytest.approx(2 / 3)
    # -mean logprob over every sampled token of the modality's completions
    assert m["entropy/image"] == pytest.approx((0.7 + 0.1) / 4)
    assert m["entropy/video"] == pytest.approx(0.005)


def test_rollout_metrics_completion_length_percentiles() -> None:
    """Long-tailed lengths: the mean alone hides the tail the step waits for."""
    prompt = PromptInputs(sample=Sample(uid="p", prompt="", label="A"), input_ids=[1])
    lengths = [1] * 90 + [10] * 9 + [1000]
    group = [Completion(prompt, [7] * n, [0.0] * n, "stop") for n in lengths]
    m = rollout_metrics([group], torch.zeros(1, len(group)))
    assert m["completion_len_p50"] == 1.0 and m["completion_len_max"] == 1000.0
    assert m["completion_len_p90"] == pytest.approx(1.9)  # numpy's linear interpolation
    assert 10.0 < m["completion_len_p99"] < 1000.0
    assert m["completion_len_mean"] == pytest.approx((90 + 90 + 1000) / 100)


def _step(signal: float, reward: float, modality: str = "video") -> dict[str, float]:
    return {f"signal/{modality}": signal, f"reward/{modality}": reward}


def test_watch_warns_once_after_k_unsolved_steps_without_signal(
    caplog: pytest.LogCaptureFixture,
) -> None:
    watch = SignalWatch(3)
    with caplog.at_level(logging.WARNING, logger="omni_grpo.run.health"):
        counts = [watch.update(s, _step(0.0, 0.5))["no_signal_steps/video"] for s in range(1, 6)]
    assert counts == [1, 2, 3, 4, 5]
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "step 3: modality 'video'" in warnings[0]
    assert "for 3 steps" in warnings[0] and "reward 0.50" in warnings[0]
    # signal comes back: the count resets, and a new collapse warns again
    assert watch.update(6, _step(0.25, 0.5))["no_signal_steps/video"] == 0
    with caplog.at_level(logging.WARNING, logger="omni_grpo.run.health"):
        for s in range(7, 10):
            watch.update(s, _step(0.0, 0.0))
    assert len(caplog.records) == 2


def test_a_solved_modality_is_not_a_collapse(caplog: pytest.LogCaptureFixture) -> None:
    watch = SignalWatch(2)
    with caplog.at_level(logging.WARNING, logger="omni_grpo.run.health"):
        for s in range(1, 10):
            out = watch.update(s, {**_step(0.0, 1.0), **_step(0.5, 0.6, "audio")})
    assert out == {"no_signal_steps/audio": 0.0, "no_signal_steps/video": 0.0}
    assert not caplog.records


def test_replay_rebuilds_the_count_without_warning_again(caplog: pytest.LogCaptureFixture) -> None:
    history = [_step(0.0, 0.5) for _ in range(4)]
    straight = SignalWatch(3)
    for s, record in enumerate(history, start=1):
        straight.update(s, record)
    caplog.clear()  # the straight run warned at step 3
    resumed = SignalWatch(3)
    with caplog.at_level(logging.WARNING, logger="omni_grpo.run.health"):
        resumed.replay(history)
        assert resumed.update(5, _step(0.0, 0.5)) == straight.update(5, _step(0.0, 0.5))
    assert not caplog.records


def test_zero_disables_the_warning(caplog: pytest.LogCaptureFixture) -> None:
    watch = SignalWatch(0)
    with caplog.at_level(logging.WARNING, logger="omni_grpo.run.health"):
        for s in range(1, 50):
            watch.update(s, _step(0.0, 0.5))
    assert not caplog.records

"""Optional extras: a missing one is one line naming the extra; the run's side outputs degrade."""

from __future__ import annotations

import logging
import sys

import pytest
from omni_grpo.extras import OPTIONAL_FEATURES, MissingExtraError, optional, require
from omni_grpo.run.metrics import MetricsLogger, read_metrics
from omni_grpo.run.plots import plot_run


@pytest.fixture
def without(monkeypatch: pytest.MonkeyPatch):
    """Make ``import name`` fail as if the distribution were not installed."""

    def block(*names: str) -> None:
        for name in names:
            monkeypatch.setitem(sys.modules, name, None)

    return block


@pytest.mark.parametrize("feature", sorted(OPTIONAL_FEATURES))
def test_require_names_the_extra_in_one_line(feature: str, without) -> None:
    need = OPTIONAL_FEATURES[feature]
    without(need.module)
    with pytest.raises(MissingExtraError) as err:
        require(feature)
    msg = str(err.value)
    assert "\n" not in msg
    assert f"pip install 'omni-grpo[{need.extra}]'" in msg and need.package in msg
    assert isinstance(err.value, ImportError)


def test_optional_warns_once_and_returns_none(without, caplog: pytest.LogCaptureFixture) -> None:
    without("matplotlib")
    with caplog.at_level(logging.WARNING, logger="omni_grpo.extras"):
        assert optional("run.plots") is None
    assert [r.getMessage().count("omni-grpo[viz]") for r in caplog.records] == [1]


def test_installed_extra_is_returned() -> None:
    assert require("run.plots").__name__ == "matplotlib"


def test_metrics_without_tensorboard_still_writes_jsonl(
    tmp_path, without, caplog: pytest.LogCaptureFixture
) -> None:
    without("torch.utils.tensorboard")
    with caplog.at_level(logging.WARNING, logger="omni_grpo.extras"):
        logger = MetricsLogger(tmp_path, tensorboard=True)
        logger.log(1, {"reward_mean": 0.25})
        logger.close()
    assert read_metrics(tmp_path) == [{"step": 1, "reward_mean": 0.25}]
    assert not (tmp_path / "tensorboard").exists()
    assert len(caplog.records) == 1 and "run.tensorboard" in caplog.records[0].getMessage()


def test_plots_without_matplotlib_write_nothing(tmp_path, without) -> None:
    logger = MetricsLogger(tmp_path, tensorboard=False)
    logger.log(1, {"reward_mean": 0.5})
    logger.close()
    without("matplotlib", "matplotlib.pyplot")
    assert plot_run(tmp_path) == []
    assert not (tmp_path / "plots").exists()

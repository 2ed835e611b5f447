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
    assert f"uv sync --all-packages --extra {need.extra}" in msg  # a clone's command
    assert isinstance(err.value, ImportError)


@pytest.mark.parametrize(
    ("module", "extra"),
    [("ray", "ray"), ("ray._private", "ray"), ("megatron.core", "megatron"),
     ("sglang_omni", "server"), ("wandb", "wandb"), ("matplotlib.pyplot", "viz")],
)  # fmt: skip
def test_cli_names_the_extra_of_a_missing_module(module: str, extra: str) -> None:
    """A bare ``import ray`` deep in the code still reaches the user as the extra's one line."""
    from omni_grpo.cli import error_message

    msg = error_message(ModuleNotFoundError(f"No module named {module!r}", name=module))
    assert "internal error" not in msg and "\n" not in msg
    assert f"omni-grpo[{extra}]" in msg and f"--extra {extra}" in msg


def test_a_missing_unknown_module_is_still_a_bug() -> None:
    """Only the optional dependencies are "not installed"; anything else stays an internal error."""
    from omni_grpo.cli import error_message

    msg = error_message(ModuleNotFoundError("No module named 'nothere'", name="nothere"))
    assert msg.startswith("internal error (ModuleNotFoundError")


def test_train_without_ray_refuses_before_preparing(tmp_path, without) -> None:
    """A Ray run without ray installed: one line naming the extra, and nothing prepared."""
    from click.testing import CliRunner
    from omni_grpo.cli import main

    without("ray")
    run_dir = tmp_path / "run"
    res = CliRunner().invoke(
        main,
        ["train", "--set", f"run.dir={run_dir}", "--set", "trainer.world_size=2",
         "--set", "rollout.embedded.actors=1", "--set", "model.make_tiny={}"],
    )  # fmt: skip
    assert res.exit_code == 1, res.output
    assert res.output.count("\n") == 1, res.output
    assert "the scale path (Ray actors) needs ray" in res.output
    assert "uv sync --all-packages --extra ray" in res.output
    assert not run_dir.exists()


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

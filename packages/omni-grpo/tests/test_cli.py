"""The entry-point driven CLI: lists every registered command, survives broken plugins."""

from __future__ import annotations

from importlib.metadata import EntryPoint
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from omni_grpo import cli, plugins


@click.command("hello")
@cli.config_options
@click.option("--name", default="x")
def _hello(cfg, name: str) -> None:
    click.echo(f"{name} n={cfg.rollout.n_samples} dir={cfg.run.dir}")


class _LoadedEP:
    """Stands in for an entry point whose target is an object defined in this test module."""

    def __init__(self, obj: object) -> None:
        self.obj, self.value = obj, "test:obj"

    def load(self) -> object:
        return self.obj


def _fake_eps(monkeypatch: pytest.MonkeyPatch, extra: dict[str, object]) -> None:
    fake: dict[str, object] = dict(plugins.registered(cli.COMMANDS_GROUP))
    for name, value in extra.items():
        is_str = isinstance(value, str)
        fake[name] = (
            EntryPoint(name=name, value=value, group=cli.COMMANDS_GROUP)
            if is_str
            else _LoadedEP(value)
        )
    real = plugins.registered
    monkeypatch.setattr(
        cli, "registered", lambda group: fake if group == cli.COMMANDS_GROUP else real(group)
    )


def test_help_lists_entry_point_commands() -> None:
    res = CliRunner().invoke(cli.main, ["--help"])
    assert res.exit_code == 0, res.output
    for name in plugins.registered(cli.COMMANDS_GROUP):
        assert name in res.output
    assert "show-config" in res.output and "prepare-data" in res.output


def test_broken_plugin_does_not_break_help(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_eps(monkeypatch, {"broken": "no_such_module_xyz:cmd", "notcmd": "os.path:join"})
    runner = CliRunner()
    res = runner.invoke(cli.main, ["--help"])
    assert res.exit_code == 0, res.output
    assert "broken" in res.output
    res = runner.invoke(cli.main, ["broken", "--anything"])
    assert res.exit_code != 0
    assert "no_such_module_xyz" in res.output and "failed to load" in res.output
    res = runner.invoke(cli.main, ["notcmd"])
    assert "not a click command" in res.output


def test_config_options_helper(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_eps(monkeypatch, {"hello": _hello})
    (tmp_path / "c.yaml").write_text("run:\n  dir: out\n")
    res = CliRunner().invoke(
        cli.main,
        [
            "hello",
            "--config",
            str(tmp_path / "c.yaml"),
            "--set",
            "rollout.n_samples=5",
            "--name",
            "y",
        ],
    )
    assert res.exit_code == 0, res.output
    assert f"y n=5 dir={tmp_path / 'out'}" in res.output


def test_config_error_is_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    res = CliRunner().invoke(cli.main, ["show-config", "--set", "rollout.n_samples=1"])
    assert res.exit_code == 2
    assert "rollout.n_samples: Input should be greater than 1" in res.output
    res = CliRunner().invoke(cli.main, ["show-config", "--set", "rollout.typo=1"])
    assert res.exit_code == 2 and "rollout.typo" in res.output


def test_show_config_prints_resolved_yaml() -> None:
    res = CliRunner().invoke(cli.main, ["show-config", "--set", "algo.kl_coef=0.5"])
    assert res.exit_code == 0, res.output
    assert "kl_coef: 0.5" in res.output

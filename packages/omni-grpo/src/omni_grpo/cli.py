"""The ``omni-grpo`` command: a click group whose subcommands all come from entry points.

Every subcommand — ours (``train``, ``prepare-data``, ``eval``) and the leaf packages'
(``extract``, ``make-tiny``, ...) — is registered in the entry-point group
``omni_grpo.commands``, so a third-party package adds a command by declaring one. Commands are
loaded lazily: ``omni-grpo --help`` lists names without importing torch-heavy modules, and a
plugin that fails to import is shown as broken (with its error) instead of crashing the CLI.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points
from typing import Any

import click

COMMANDS_GROUP = "omni_grpo.commands"


def _command_entry_points() -> dict[str, EntryPoint]:
    eps: dict[str, EntryPoint] = {}
    for ep in entry_points(group=COMMANDS_GROUP):
        eps.setdefault(ep.name, ep)  # first wins; duplicates across packages are ignored
    return eps


def _broken_command(name: str, ep: EntryPoint, err: BaseException) -> click.Command:
    msg = f"command '{name}' ({ep.value}) failed to load: {type(err).__name__}: {err}"

    @click.command(
        name=name, help=f"[broken plugin] {msg}", context_settings={"ignore_unknown_options": True}
    )
    @click.argument("args", nargs=-1, type=click.UNPROCESSED)
    def broken(args: tuple[str, ...]) -> None:
        raise click.ClickException(msg)

    return broken


class EntryPointGroup(click.Group):
    """A click group that resolves subcommands from ``omni_grpo.commands`` on demand."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(_command_entry_points()))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        builtin = super().get_command(ctx, cmd_name)
        if builtin is not None:
            return builtin
        ep = _command_entry_points().get(cmd_name)
        if ep is None:
            return None
        try:
            obj = ep.load()
        except Exception as err:  # a broken plugin must not take the whole CLI down
            return _broken_command(cmd_name, ep, err)
        if not isinstance(obj, click.Command):
            return _broken_command(
                cmd_name, ep, TypeError(f"{ep.value} is {type(obj).__name__}, not a click command")
            )
        if obj.name != cmd_name:
            obj = _renamed(obj, cmd_name)
        return obj


def _renamed(cmd: click.Command, name: str) -> click.Command:
    import copy

    new = copy.copy(cmd)
    new.name = name
    return new


@click.group(cls=EntryPointGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="omni-grpo")
def main() -> None:
    """GRPO for the Qwen3-Omni thinker on audio, image and video prompts."""


# ------------------------------------------------------------------- shared --config/--set options
def config_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator for commands that take ``--config PATH`` and repeated ``--set KEY=VALUE``.

    The wrapped function receives ``cfg`` (a validated ``OmniGRPOConfig``) instead of the raw
    options; config errors become a clean ``click.UsageError`` naming the bad field.
    """

    @click.option(
        "--config",
        "config_path",
        type=click.Path(dir_okay=False, path_type=str),
        default=None,
        help="YAML config file (relative paths inside resolve against its directory).",
    )
    @click.option(
        "--set",
        "overrides",
        multiple=True,
        metavar="KEY=VALUE",
        help="Dotted override with a YAML value, e.g. --set rollout.n_samples=8 (repeatable).",
    )
    @functools.wraps(func)
    def wrapper(
        *args: Any, config_path: str | None, overrides: tuple[str, ...], **kwargs: Any
    ) -> Any:
        from omni_grpo.config import ConfigError, load_config

        try:
            cfg = load_config(config_path, overrides)
        except ConfigError as err:
            raise click.UsageError(str(err)) from None
        return func(*args, cfg=cfg, **kwargs)

    return wrapper


@click.command("show-config")
@config_options
@click.option(
    "--plan", "plan", is_flag=True, help="Also print the placement plan (see train --plan)."
)
@click.option("--gpus", type=int, default=None, help="With --plan: the GPUs available.")
def show_config_command(cfg: Any, plan: bool, gpus: int | None) -> None:
    """Print the fully resolved config (defaults, file, overrides) as YAML."""
    from omni_grpo.config import dump_config

    click.echo(dump_config(cfg), nl=False)
    if plan:
        from omni_grpo.cli_train import plan_text

        click.echo(plan_text(cfg, gpus))


if __name__ == "__main__":  # pragma: no cover
    main()

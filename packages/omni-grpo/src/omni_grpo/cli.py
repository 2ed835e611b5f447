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
from typing import Any

import click

from omni_grpo.plugins import PluginLoadError, load_entry_point, registered

COMMANDS_GROUP = "omni_grpo.commands"


def _broken_command(name: str, err: BaseException) -> click.Command:
    msg = str(err)

    @click.command(
        name=name, help=f"[broken plugin] {msg}", context_settings={"ignore_unknown_options": True}
    )
    @click.argument("args", nargs=-1, type=click.UNPROCESSED)
    def broken(args: tuple[str, ...]) -> None:
        raise click.ClickException(msg)

    return broken


class EntryPointGroup(click.Group):
    """A click group whose subcommands are also resolved, on demand, from an entry-point group.

    ``entry_point_group`` names the group (``omni_grpo.commands`` for ``omni-grpo`` itself,
    ``omni_grpo.preparers`` for ``prepare-data``) and ``kind`` the noun in error messages. A plugin
    that fails to load, or is not a click command, shows up as a broken command with its error.
    """

    entry_point_group = COMMANDS_GROUP
    kind = "command"

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(registered(self.entry_point_group)))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        builtin = super().get_command(ctx, cmd_name)
        if builtin is not None:
            return builtin
        ep = registered(self.entry_point_group).get(cmd_name)
        if ep is None:
            return None
        try:
            obj = load_entry_point(ep, kind=self.kind)
        except PluginLoadError as err:  # a broken plugin must not take the whole CLI down
            return _broken_command(cmd_name, err)
        if not isinstance(obj, click.Command):
            return _broken_command(
                cmd_name,
                TypeError(
                    f"{self.kind} {cmd_name!r} ({ep.value}) is {type(obj).__name__}, "
                    "not a click command"
                ),
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

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


DEBUG_KEY = "omni_grpo.debug"


def one_line(text: str) -> str:
    """Messages are printed on one line: multi-line reasons are joined with ``; ``."""
    return "; ".join(line.strip() for line in str(text).splitlines() if line.strip())


# Packages whose exceptions are raised on purpose, with a message that names the thing.
OWN_PACKAGES = frozenset(
    {"omni_grpo", "omni_extract", "omni_rope", "omni_audio_inject", "omni_rollout_client"}
)


def error_message(exc: BaseException) -> str:
    """What the CLI prints for an error a command raised.

    Expected: our own exception classes, ``ValueError`` (config, data, checkpoint contents),
    ``OSError`` (missing file, permission, disk full) and plain ``RuntimeError`` (what torch and
    safetensors raise for unreadable files): their message is printed. Anything else is a bug,
    said so in one line with the hint to rerun with ``--debug``. A missing optional dependency
    (``ModuleNotFoundError`` for ray, megatron-core, sglang-omni, ...) is not a bug: its line names
    the extra and the command that installs it (``omni_grpo.extras``).
    """
    from omni_grpo.extras import missing_extra_message

    missing = missing_extra_message(exc)
    if missing is not None:
        return missing
    msg = one_line(str(exc)) or type(exc).__name__
    if type(exc).__module__.split(".")[0] in OWN_PACKAGES or isinstance(exc, ValueError):
        return msg
    if isinstance(exc, OSError):
        if exc.filename is not None and str(exc.filename) not in msg:
            msg = f"{msg}: {exc.filename}"
        return f"{type(exc).__name__}: {msg}"
    if isinstance(exc, RuntimeError):
        return msg
    return f"internal error ({type(exc).__name__}: {msg}); rerun with --debug for the traceback"


class EntryPointGroup(click.Group):
    """A click group whose subcommands are also resolved, on demand, from an entry-point group.

    ``entry_point_group`` names the group (``omni_grpo.commands`` for ``omni-grpo`` itself,
    ``omni_grpo.preparers`` for ``prepare-data``) and ``kind`` the noun in error messages. A plugin
    that fails to load, or is not a click command, shows up as a broken command with its error.

    It is also the CLI's ONE error-handling layer: whatever a subcommand raises becomes a
    one-line ``Error: ...`` with exit status 1 (``error_message``), unless ``--debug`` asks for
    the traceback. Commands raise plain exceptions; none of them catches to print.
    """

    entry_point_group = COMMANDS_GROUP
    kind = "command"

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.exceptions.ClickException as exc:  # a plugin's own: one line too
            from omni_grpo.config import redact

            exc.message = redact(one_line(exc.message))
            raise
        except (click.exceptions.Exit, click.exceptions.Abort):
            raise
        except Exception as exc:
            if ctx.meta.get(DEBUG_KEY):
                raise
            from omni_grpo.config import redact

            raise click.ClickException(redact(error_message(exc))) from None

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
@click.option(
    "--debug",
    is_flag=True,
    envvar="OMNI_GRPO_DEBUG",
    help="Show the full traceback of an error instead of its one-line message.",
)
@click.pass_context
def main(ctx: click.Context, debug: bool) -> None:
    """GRPO for the Qwen3-Omni thinker on audio, image and video prompts."""
    ctx.meta[DEBUG_KEY] = debug
    if not debug:  # --debug keeps every third-party line: one of them may be the clue
        from omni_grpo.quiet import quiet_third_party

        quiet_third_party()


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
            raise click.UsageError(one_line(str(err))) from None
        return func(*args, cfg=cfg, **kwargs)

    return wrapper


if __name__ == "__main__":  # pragma: no cover
    main()

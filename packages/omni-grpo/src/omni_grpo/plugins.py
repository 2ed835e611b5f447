"""The one entry-point scanner: every pluggable seam of omni-grpo is an entry-point group.

CLI commands (``omni_grpo.commands``), ``prepare-data`` preparers (``omni_grpo.preparers``),
rewards (``omni_grpo.rewards``), trainer backends (``omni_grpo.backends``) and rollout engines
(``omni_grpo.rollout_engines``) are all found here, with one rule for duplicates (the first
registration wins) and one shape of error: a wrong name fails with the config field, the group and
the names that do exist, so the user can fix the YAML; a plugin that fails to import fails with its
name and target, so the user knows which package is broken.
"""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points
from typing import Any


class UnknownPluginError(ValueError, KeyError):
    """No plugin of that name in the group (a ``ValueError`` for config checks, a ``KeyError``
    for registry lookups)."""

    __str__ = Exception.__str__  # KeyError's would quote the message


class PluginLoadError(RuntimeError):
    """The plugin is registered but its target failed to import."""


def registered(group: str) -> dict[str, EntryPoint]:
    """The entry points of ``group`` by name; the first registration of a name wins."""
    eps: dict[str, EntryPoint] = {}
    for ep in entry_points(group=group):
        eps.setdefault(ep.name, ep)
    return eps


def plugin_names(group: str) -> list[str]:
    """Names registered in entry-point ``group``, sorted."""
    return sorted(registered(group))


def load_entry_point(ep: EntryPoint, *, kind: str) -> Any:
    """``ep.load()``, with an import failure reported as one line naming the plugin."""
    try:
        return ep.load()
    except Exception as err:
        raise PluginLoadError(
            f"{kind} {ep.name!r} ({ep.value}) failed to load: {type(err).__name__}: {err}"
        ) from err


def load_plugin(group: str, name: str, *, what: str, kind: str) -> Any:
    """Load the object registered under ``name`` in ``group``.

    ``what`` is the config field that chose ``name`` (e.g. ``"trainer.backend"``) and ``kind``
    the noun for one plugin (e.g. ``"backend"``); both only shape the error message.
    """
    ep = registered(group).get(name)
    if ep is None:
        raise UnknownPluginError(
            f"{what}: no {kind} named {name!r} in entry-point group {group!r} "
            f"(available: {plugin_names(group)})"
        )
    return load_entry_point(ep, kind=kind)


__all__ = [
    "PluginLoadError",
    "UnknownPluginError",
    "load_entry_point",
    "load_plugin",
    "plugin_names",
    "registered",
]

"""Entry-point lookup shared by the pluggable seams (trainer backends, rollout engines).

Each seam is an entry-point group; a config field names one entry in it. A wrong name must fail
with the config field, the group and the names that do exist, so the user can fix the YAML.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Any


def plugin_names(group: str) -> list[str]:
    """Names registered in entry-point ``group``, sorted."""
    return sorted(ep.name for ep in entry_points(group=group))


def load_plugin(group: str, name: str, *, what: str, kind: str) -> Any:
    """Load the object registered under ``name`` in ``group``.

    ``what`` is the config field that chose ``name`` (e.g. ``"trainer.backend"``) and ``kind``
    the noun for one plugin (e.g. ``"backend"``); both only shape the error message.
    """
    matches = [ep for ep in entry_points(group=group) if ep.name == name]
    if not matches:
        raise ValueError(
            f"{what}: no {kind} named {name!r} in entry-point group {group!r} "
            f"(available: {plugin_names(group)})"
        )
    return matches[0].load()


__all__ = ["load_plugin", "plugin_names"]

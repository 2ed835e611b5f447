"""What every section of the tree is built from: the strict model, path fields, plugin names.

Every model forbids unknown keys so that a typo (``rollout.n_sample``) fails loudly with the dotted
path of the bad field instead of being silently ignored, and refuses non-finite numbers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict


class StrictModel(BaseModel):
    """The base of every section: unknown keys and non-finite numbers are refused, and an
    assignment is validated like a loaded value."""

    # ``.inf`` / ``.nan`` pass a ``gt=0`` bound (an infinite learning rate was accepted): no
    # setting of this tree means anything non-finite, so they are refused everywhere.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


def _non_empty_path(value: Any) -> Any:
    """``""`` would become ``Path(".")``: a run writing into the current directory, a dataset
    that is "the cwd". Refuse it instead of guessing."""
    if isinstance(value, str) and not value.strip():
        raise ValueError("empty path (give a directory or file, or leave the key out)")
    return value


def _non_empty_spec(value: Any) -> Any:
    if isinstance(value, list | tuple):
        for item in value:
            _non_empty_path(item)
        return value
    return _non_empty_path(value)


PathField = Annotated[Path, BeforeValidator(_non_empty_path)]
# A dataset: one path (file, glob, ``save_to_disk`` dir) or a list of them.
DatasetSpec = Annotated[Path | list[Path], BeforeValidator(_non_empty_spec)]


def registered_name(group: str, name: str, kind: str) -> str:
    """``name`` if an entry point of ``group`` carries it: engines and backends are plugins, so a
    third-party package can add one, and a typo fails at config time with the names that exist."""
    from omni_grpo.plugins import plugin_names

    names = plugin_names(group)
    if name not in names:
        raise ValueError(
            f"no {kind} named {name!r} in entry-point group {group!r} (available: {names})"
        )
    return name

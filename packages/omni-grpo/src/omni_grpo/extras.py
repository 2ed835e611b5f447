"""Optional dependencies behind pip extras, imported in one place with one message.

``pip install omni-grpo`` stays lean: the plotting and TensorBoard stacks (``viz``), W&B
(``wandb``), Ray (``ray``), megatron-core (``megatron``) and sglang-omni (``server``) are extras. A
feature that needs one asks for it here by name; when it is missing, :func:`require` raises
:class:`MissingExtraError` (an ``ImportError``) whose one line names the extra and the command that
installs it, and :func:`optional` logs that line once as a warning and returns ``None`` — used for
the run's side outputs (plots, TensorBoard, W&B), which must never stop a training run: its record
is ``metrics.jsonl``, which needs nothing extra.

A missing optional module that code imports directly (``import ray`` deep in the driver) reaches
the CLI as a plain ``ModuleNotFoundError``; :func:`missing_extra_message` turns it into the same
one line, so a user never reads "internal error" for a package they simply did not install.
"""

from __future__ import annotations

import importlib
import logging
from types import ModuleType
from typing import NamedTuple

log = logging.getLogger(__name__)


class Needs(NamedTuple):
    module: str  # what the feature imports
    package: str  # what pip installs
    extra: str  # the omni-grpo extra that brings it


# feature (as the config or the docs name it) -> what it needs
OPTIONAL_FEATURES: dict[str, Needs] = {
    "run.plots": Needs("matplotlib", "matplotlib", "viz"),
    "run.tensorboard": Needs("torch.utils.tensorboard", "tensorboard", "viz"),
    "run.wandb": Needs("wandb", "wandb", "wandb"),
    "the scale path (Ray actors)": Needs("ray", "ray", "ray"),
    "trainer.backend 'megatron'": Needs("megatron.core", "megatron-core", "megatron"),
    "an sglang-omni rollout server": Needs("sglang_omni", "sglang-omni", "server"),
}

# top-level module of an optional dependency -> the feature that needs it
_FEATURE_OF_MODULE: dict[str, str] = {
    "matplotlib": "run.plots",
    "tensorboard": "run.tensorboard",
    "wandb": "run.wandb",
    "ray": "the scale path (Ray actors)",
    "megatron": "trainer.backend 'megatron'",
    "sglang_omni": "an sglang-omni rollout server",
}


def install_hint(extra: str) -> str:
    """How to get ``extra``: pip for an installed package, uv for a clone of the repository.

    In a clone, ``uv run`` re-syncs the environment to the lock on every call, so a ``pip
    install`` into ``.venv`` would be undone by the next ``uv run``: the clone's command is
    ``uv sync`` with the extra (the default ``dev`` group already has ``viz``, ``test``, ``ray``).
    """
    return (
        f"pip install 'omni-grpo[{extra}]' (in a clone of the repository: "
        f"uv sync --all-packages --extra {extra})"
    )


def missing_message(feature: str) -> str:
    """The one line for ``feature`` missing its extra."""
    need = OPTIONAL_FEATURES[feature]
    return (
        f"{feature} needs {need.package}, which is in the {need.extra!r} extra: "
        f"{install_hint(need.extra)}"
    )


def missing_extra_message(exc: BaseException) -> str | None:
    """The one line for a ``ModuleNotFoundError`` of an optional dependency, else ``None``.

    Only a module that is itself missing counts (``exc.name`` is its top-level package or one of
    its submodules): a broken install that fails inside ray's own imports is not "not installed".
    """
    if not isinstance(exc, ModuleNotFoundError) or not exc.name:
        return None
    feature = _FEATURE_OF_MODULE.get(exc.name.split(".")[0])
    return None if feature is None else missing_message(feature)


class MissingExtraError(ImportError):
    """An optional feature was used without the extra that installs its dependency."""


def require(feature: str) -> ModuleType:
    """Import what ``feature`` needs, or raise :class:`MissingExtraError` naming the extra."""
    need = OPTIONAL_FEATURES[feature]
    try:
        return importlib.import_module(need.module)
    except ImportError:
        raise MissingExtraError(missing_message(feature)) from None


def optional(feature: str) -> ModuleType | None:
    """Like :func:`require`, but a missing extra is one warning line and ``None``."""
    try:
        return require(feature)
    except MissingExtraError as exc:
        log.warning("%s; skipping it", exc)
        return None

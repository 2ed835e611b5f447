"""Optional dependencies behind pip extras, imported in one place with one message.

``pip install omni-grpo`` stays lean: the plotting and TensorBoard stacks (``viz``) and W&B
(``wandb``) are extras. A feature that needs one asks for it here by name; when it is missing,
:func:`require` raises :class:`MissingExtraError` (an ``ImportError``) whose one line names the
extra to install, and :func:`optional` logs that line once as a warning and returns ``None`` — used
for the run's side outputs (plots, TensorBoard, W&B), which must never stop a training run: its
record is ``metrics.jsonl``, which needs nothing extra.
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


# feature (as the config names it) -> what it needs
OPTIONAL_FEATURES: dict[str, Needs] = {
    "run.plots": Needs("matplotlib", "matplotlib", "viz"),
    "run.tensorboard": Needs("torch.utils.tensorboard", "tensorboard", "viz"),
    "run.wandb": Needs("wandb", "wandb", "wandb"),
}


class MissingExtraError(ImportError):
    """An optional feature was used without the extra that installs its dependency."""


def require(feature: str) -> ModuleType:
    """Import what ``feature`` needs, or raise :class:`MissingExtraError` naming the extra."""
    need = OPTIONAL_FEATURES[feature]
    try:
        return importlib.import_module(need.module)
    except ImportError:
        raise MissingExtraError(
            f"{feature} needs {need.package}, which is in the {need.extra!r} extra: "
            f"pip install 'omni-grpo[{need.extra}]'"
        ) from None


def optional(feature: str) -> ModuleType | None:
    """Like :func:`require`, but a missing extra is one warning line and ``None``."""
    try:
        return require(feature)
    except MissingExtraError as exc:
        log.warning("%s; skipping it", exc)
        return None

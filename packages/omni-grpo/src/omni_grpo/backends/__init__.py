"""Trainer backends, discovered through the ``omni_grpo.backends`` entry-point group.

An entry point names a factory ``factory(model_cfg, trainer_cfg, algo_cfg, *, pad_token_id)``
returning an ``omni_grpo.types.TrainerBackend`` — the whole contract with the loop (the step, the
supervised warm-up step, weights for sync with their layout, checkpoint state, ``policy``,
``device``, ``is_driver``, ``close``, and what each means over several ranks). ``torch`` ships
here; ``megatron`` and third-party backends register the same way in their own ``pyproject.toml``.
"""

from __future__ import annotations

from typing import Any

from omni_grpo.plugins import load_plugin, plugin_names
from omni_grpo.types import TrainerBackend

BACKENDS_GROUP = "omni_grpo.backends"


def available_backends() -> list[str]:
    return plugin_names(BACKENDS_GROUP)


def backend_factory(name: str) -> Any:
    """The factory registered under ``name``; a clear error lists the known names."""
    return load_plugin(BACKENDS_GROUP, name, what="trainer.backend", kind="backend")


def create_backend(
    name: str, model_cfg: Any, trainer_cfg: Any, algo_cfg: Any, *, pad_token_id: int
) -> TrainerBackend:
    return backend_factory(name)(model_cfg, trainer_cfg, algo_cfg, pad_token_id=pad_token_id)


__all__ = ["BACKENDS_GROUP", "available_backends", "backend_factory", "create_backend"]

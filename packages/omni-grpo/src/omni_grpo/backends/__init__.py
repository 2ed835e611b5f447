"""Trainer backends, discovered through the ``omni_grpo.backends`` entry-point group.

An entry point names a factory ``factory(model_cfg, trainer_cfg, algo_cfg, *, pad_token_id)``
returning a ``TrainerBackend`` (``step(batch) -> metrics``, ``state_dict_for_sync()``, plus the
checkpoint hooks ``trainable_state`` / ``load_trainable_state`` / ``optimizer_state`` /
``load_optimizer_state``). ``torch`` ships here; ``megatron`` and third-party backends register the
same way in their own ``pyproject.toml``.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Any

BACKENDS_GROUP = "omni_grpo.backends"


def available_backends() -> list[str]:
    return sorted(ep.name for ep in entry_points(group=BACKENDS_GROUP))


def backend_factory(name: str) -> Any:
    """The factory registered under ``name``; a clear error lists the known names."""
    matches = [ep for ep in entry_points(group=BACKENDS_GROUP) if ep.name == name]
    if not matches:
        raise ValueError(
            f"trainer.backend: no backend named {name!r} in entry-point group {BACKENDS_GROUP!r} "
            f"(available: {available_backends()})"
        )
    return matches[0].load()


def create_backend(
    name: str, model_cfg: Any, trainer_cfg: Any, algo_cfg: Any, *, pad_token_id: int
) -> Any:
    return backend_factory(name)(model_cfg, trainer_cfg, algo_cfg, pad_token_id=pad_token_id)


__all__ = ["BACKENDS_GROUP", "available_backends", "backend_factory", "create_backend"]

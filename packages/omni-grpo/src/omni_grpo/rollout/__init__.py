"""Rollout engines, discovered through the ``omni_grpo.rollout_engines`` entry-point group.

An entry point names an engine class (or factory). If it has a ``from_rollout_config(cfg,
**context)`` classmethod, that builds it from the ``RolloutConfig`` and the trainer's context
(``policy`` module, ``eos_token_ids``, ``banned_token_ids``, ``decode_fn``, ``device``,
``vocab_size``); otherwise it is called as ``cls(cfg.sglang, vocab_size=...)`` — the signature of
remote engines, which take their server settings only.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Any

ENGINES_GROUP = "omni_grpo.rollout_engines"

#: Engines that generate with the trainer's own in-process module (no weight sync needed).
IN_PROCESS = frozenset({"embedded"})


def available_engines() -> list[str]:
    return sorted(ep.name for ep in entry_points(group=ENGINES_GROUP))


def engine_class(name: str) -> Any:
    matches = [ep for ep in entry_points(group=ENGINES_GROUP) if ep.name == name]
    if not matches:
        raise ValueError(
            f"rollout.engine: no engine named {name!r} in entry-point group {ENGINES_GROUP!r} "
            f"(available: {available_engines()})"
        )
    return matches[0].load()


def create_engine(cfg: Any, **context: Any) -> Any:
    """Build the engine ``cfg.engine`` (``cfg`` is the ``RolloutConfig``)."""
    cls = engine_class(cfg.engine)
    build = getattr(cls, "from_rollout_config", None)
    if build is not None:
        return build(cfg, **context)
    return cls(cfg.sglang, vocab_size=context.get("vocab_size"))


__all__ = ["ENGINES_GROUP", "IN_PROCESS", "available_engines", "create_engine", "engine_class"]

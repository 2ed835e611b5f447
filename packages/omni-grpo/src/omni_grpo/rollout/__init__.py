"""Rollout engines, discovered through the ``omni_grpo.rollout_engines`` entry-point group.

An entry point names an engine class (or factory). If it has a ``from_rollout_config(cfg,
**context)`` classmethod, that builds it from the ``RolloutConfig`` and the trainer's context
(``policy`` module, ``eos_token_ids``, ``banned_token_ids``, ``decode_fn``, ``device``,
``vocab_size``, ``media_ids``: the checkpoint's placeholder ids; take ``**context`` so new keys pass); otherwise it is called as ``cls(cfg.sglang, vocab_size=...)`` — the signature of
remote engines, which take their server settings only.
"""

from __future__ import annotations

from typing import Any

from omni_grpo.plugins import load_plugin, plugin_names
from omni_grpo.types import RolloutEngine

ENGINES_GROUP = "omni_grpo.rollout_engines"

#: Engines that generate with the trainer's own in-process module (no weight sync needed).
IN_PROCESS = frozenset({"embedded"})


def available_engines() -> list[str]:
    return plugin_names(ENGINES_GROUP)


def engine_class(name: str) -> Any:
    return load_plugin(ENGINES_GROUP, name, what="rollout.engine", kind="engine")


def create_engine(cfg: Any, **context: Any) -> RolloutEngine:
    """Build the engine ``cfg.engine`` (``cfg`` is the ``RolloutConfig``)."""
    cls = engine_class(cfg.engine)
    build = getattr(cls, "from_rollout_config", None)
    if build is not None:
        return build(cfg, **context)
    return cls(cfg.sglang, vocab_size=context.get("vocab_size"))


__all__ = ["ENGINES_GROUP", "IN_PROCESS", "available_engines", "create_engine", "engine_class"]

"""Rewards, discovered by name through the ``omni_grpo.rewards`` entry-point group.

A third-party package adds a reward by declaring, in its pyproject::

    [project.entry-points."omni_grpo.rewards"]
    my_reward = "my_pkg.rewards:MyReward"

The target may be a class with ``name`` and ``score(sample, completion_text) -> float`` (it is
instantiated with no arguments), an instance of one, or a plain function ``(sample, text) -> float``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import TYPE_CHECKING, Any

from omni_grpo.plugins import load_plugin, plugin_names
from omni_grpo.types import Reward, Sample

if TYPE_CHECKING:
    from omni_grpo.config import RewardsConfig

REWARDS_GROUP = "omni_grpo.rewards"


class _FunctionReward:
    def __init__(self, name: str, fn: Callable[[Sample, str], float]) -> None:
        self.name, self._fn = name, fn

    def score(self, sample: Sample, completion_text: str) -> float:
        return float(self._fn(sample, completion_text))


def available_rewards() -> list[str]:
    return plugin_names(REWARDS_GROUP)


def _as_reward(name: str, obj: Any) -> Reward:
    if isinstance(obj, type):
        obj = obj()
    if isinstance(obj, Reward):
        return obj
    if callable(obj):
        return _FunctionReward(name, obj)
    raise TypeError(
        f"reward entry point {name!r} is {type(obj).__name__}: not a Reward, class or function"
    )


@cache
def get_reward(name: str) -> Reward:
    """The reward registered under ``name`` (one shared instance per name).

    An unknown name raises ``UnknownPluginError`` (a ``KeyError``), a broken plugin
    ``PluginLoadError`` (a ``RuntimeError``); both name the reward.
    """
    return _as_reward(name, load_plugin(REWARDS_GROUP, name, what="reward", kind="reward"))


def reward_name(sample: Sample, cfg: RewardsConfig | None = None) -> str:
    """The row's own ``reward`` wins; else ``rewards.by_modality[modality]``, else ``rewards.default``."""
    if sample.reward:
        return sample.reward
    if cfg is None:
        return "mcq"
    return cfg.by_modality.get(sample.modality, cfg.default)


def score_sample(sample: Sample, completion_text: str, cfg: RewardsConfig | None = None) -> float:
    """Score one completion with the reward chosen by ``reward_name``."""
    return get_reward(reward_name(sample, cfg)).score(sample, completion_text)


__all__ = ["REWARDS_GROUP", "available_rewards", "get_reward", "reward_name", "score_sample"]

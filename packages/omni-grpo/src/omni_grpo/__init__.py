"""omni-grpo: GRPO for the Qwen3-Omni thinker on audio, image and video prompts.

The public face, for scripts and for authors of third-party backends, engines and rewards::

    import omni_grpo

    cfg = omni_grpo.load_config("run.yaml", ["rollout.n_samples=8"])
    result = omni_grpo.train(cfg)          # -> TrainResult(run_dir, steps, final_eval, ...)

* config: :func:`load_config`, :class:`OmniGRPOConfig`, :class:`ConfigError`;
* the loop: :func:`train`, :class:`TrainResult`;
* the protocol types every component speaks (``omni_grpo.types``): :class:`Sample`,
  :class:`PromptInputs`, :class:`Completion`, :class:`GRPOBatch`, and the seams a plugin
  implements, :class:`TrainerBackend`, :class:`RolloutEngine`, :class:`Reward`, plus
  :class:`WeightSync`.

Names are imported on first use, so ``import omni_grpo`` (and ``omni-grpo --help``) loads neither
torch nor transformers. Everything else is reached through its own module; modules and names with
a leading underscore are private.
"""

from __future__ import annotations

import importlib
from typing import Any

# public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    "ConfigError": "omni_grpo.config.errors",
    "OmniGRPOConfig": "omni_grpo.config.root",
    "load_config": "omni_grpo.config.load",
    "TrainResult": "omni_grpo.trainer",
    "train": "omni_grpo.trainer",
    "Completion": "omni_grpo.types",
    "GRPOBatch": "omni_grpo.types",
    "PromptInputs": "omni_grpo.types",
    "Reward": "omni_grpo.types",
    "RolloutEngine": "omni_grpo.types",
    "Sample": "omni_grpo.types",
    "TrainerBackend": "omni_grpo.types",
    "WeightSync": "omni_grpo.types",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # later lookups skip this hook
        return value
    raise AttributeError(f"module 'omni_grpo' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})

"""The composed Qwen3-Omni thinker used by the torch backend and the embedded rollout engine.

* :func:`load_thinker` — HF Qwen3-VL-MoE from omni-extract's ``vl`` output + Omni TM-RoPE
  (omni-rope) + the frozen audio tower (omni-audio-inject).
* :class:`OmniThinker` — its forward takes the Omni thinker's inputs and returns ``.logits``;
  helpers for the trainer: ``trainable_parameter_names()``, ``sync_state_dict()``,
  ``gradient_checkpointing_enable()``; KV-cached decoding via ``forward(..., cache=...)``
  (positions continue from the prefill's rope deltas).
* :func:`omni_grpo.models.generation.generate` (token ids + per-token logprobs) and
  :func:`omni_grpo.models.saving.save_thinker` (a reloadable ``vl`` checkpoint) take the thinker
  as their first argument: they build on it, so it does not import them back.
* :mod:`omni_grpo.testing.models` — hand-built Omni batches (placeholders expanded like the
  processor) for tests and benchmarks.
"""

from __future__ import annotations

import importlib
from typing import Any

# Lazy, so that reading a checkpoint's sideband (``models.sideband``, used by ``data``) does not
# import transformers and the HF model classes.
_EXPORTS = {"OmniThinker": "omni_grpo.models.thinker", "load_thinker": "omni_grpo.models.loader"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'omni_grpo.models' has no attribute {name!r}")

"""The composed Qwen3-Omni thinker used by the torch backend and the embedded rollout engine.

* :func:`load_thinker` — HF Qwen3-VL-MoE from omni-extract's ``vl`` output + Omni TM-RoPE
  (omni-rope) + the frozen audio tower (omni-audio-inject).
* :class:`OmniThinker` — its forward takes the Omni thinker's inputs and returns ``.logits``;
  helpers for the trainer: ``trainable_parameter_names()``, ``sync_state_dict()``,
  ``save_pretrained()``; KV-cached decoding via ``forward(..., cache=...)`` and
  :func:`generate`.
"""

from omni_grpo.models.loader import load_thinker
from omni_grpo.models.thinker import OmniThinker

__all__ = ["OmniThinker", "load_thinker"]

"""omni-extract: stream the Qwen3-Omni thinker into text, pseudo-Qwen3-VL-MoE and audio checkpoints.

Public API (imported lazily, so ``import omni_extract`` does not pull in torch):

* ``extract(src, dst, variant="vl"|"text"|"audio", shard_size=..., dtype=..., overwrite=...)``
* ``to_server_tensors(named_tensors, layout="hf_memory"|"vl_hub", towers="error"|"skip")``,
  ``to_server_name(name)``, ``is_server_syncable(name)``: names for the sglang-omni thinker stage.
* ``export_trained(base, dst, trained, fmt="omni"|"vl", ...)``: trained pseudo-VL tensors (an
  ``omni_extract.trained.TrainedWeights`` reader) written back over a hub checkpoint — the inverse
  of extraction; ``omni-grpo export`` drives it.
* ``omni_extract.names.NAME_TABLE``: the one name table behind both directions.
* ``omni_extract.audio.load_audio_tower(dir)``: the extracted audio tower as a transformers module.
* ``omni_extract.errors``: the exceptions (all subclasses of ``ExtractError``).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ExtractError": "omni_extract.errors",
    "ExtractResult": "omni_extract.convert",
    "extract": "omni_extract.convert",
    "export_trained": "omni_extract.export",
    "is_server_syncable": "omni_extract.names",
    "to_server_name": "omni_extract.names",
    "to_server_tensors": "omni_extract.names",
    "load_audio_tower": "omni_extract.audio",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'omni_extract' has no attribute {name!r}")

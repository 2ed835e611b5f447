"""omni-extract: stream the Qwen3-Omni thinker into text, pseudo-Qwen3-VL-MoE and audio checkpoints.

Public API:

* ``extract(src, dst, variant="vl"|"text"|"audio", shard_size=..., dtype=..., overwrite=...)``
* ``to_server_tensors(named_tensors, layout="hf_memory"|"vl_hub", towers="error"|"skip")`` and
  ``to_server_name(name)`` / ``is_server_syncable(name)``: names for the sglang-omni thinker stage.
* ``omni_extract.names.NAME_TABLE``: the one name table behind both directions.
* ``omni_extract.errors``: the exceptions (all subclasses of ``ExtractError``).
"""

from omni_extract.errors import ExtractError
from omni_extract.extract import ExtractResult, extract
from omni_extract.names import is_server_syncable, to_server_name, to_server_tensors

__all__ = [
    "ExtractError",
    "ExtractResult",
    "extract",
    "is_server_syncable",
    "to_server_name",
    "to_server_tensors",
]

"""``omni-grpo export``: a run's trained thinker as a full Qwen3-Omni checkpoint (or pseudo-VL).

* :func:`export_run` — pick the checkpoint (``--step``, default the newest complete one), the base
  (the run's ``model.omni_checkpoint``) and the reader for the backend that wrote it, then stream
  with :func:`omni_extract.export.export_trained` (the leaf does the name mapping and the bytes).
* :mod:`.megatron` — Megatron ``GPTModel`` names read as pseudo-VL tensors.
* :mod:`.cli` — the click command, registered in ``omni_grpo.commands``.

Test rigs: :mod:`omni_grpo.testing.export`.
"""

from omni_grpo.export.api import export_run
from omni_grpo.export.run import ExportError

__all__ = ["ExportError", "export_run"]

"""``omni-grpo eval --exported DIR``: evaluate what ``export`` wrote, so users measure what they ship.

An ``omni``-format export is a full Qwen3-Omni checkpoint: it is extracted again (``vl`` + ``audio``,
into a temporary directory removed when the command ends) exactly as a run prepares its model,
so the evaluation goes through the same code path as training. A ``vl``-format export is the
trainer's own layout and is used directly, with the run's audio tower.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omni_extract.export import MARKER_FILE

from omni_grpo.export.run import ExportError


def exported_format(directory: Path) -> str:
    """``omni`` or ``vl``, from the directory's ``config.json``."""
    config = directory / "config.json"
    if not config.is_file():
        raise ExportError(f"{directory} has no config.json (not an exported checkpoint)")
    model_type = json.loads(config.read_text()).get("model_type")
    if model_type == "qwen3_omni_moe":
        return "omni"
    if model_type == "qwen3_vl_moe":
        return "vl"
    raise ExportError(
        f"{config}: model_type {model_type!r} is neither qwen3_omni_moe nor qwen3_vl_moe"
    )


def exported_model_config(
    cfg: Any, directory: Path, on_close: Callable[[Callable[[], Any]], Any]
) -> Any:
    """``cfg`` with its model pointed at the exported ``directory`` (see the module docstring).

    ``on_close`` registers the temporary directory's cleanup (click's ``ctx.call_on_close``).
    """
    directory = Path(directory)
    if not (directory / MARKER_FILE).is_file():
        raise ExportError(f"{directory} was not written by omni-grpo export (no {MARKER_FILE})")
    if exported_format(directory) == "vl":
        update = {"extracted_dir": directory}
    else:
        tmp = tempfile.TemporaryDirectory(prefix="omni-grpo-eval-")
        on_close(tmp.cleanup)
        update = {
            "omni_checkpoint": directory,
            "make_tiny": None,
            "extracted_dir": Path(tmp.name) / "vl",
            "audio_dir": Path(tmp.name) / "audio",
        }
    model = cfg.model.model_copy(update=update)
    return cfg.model_copy(update={"model": model})

"""Saving the thinker as a ``vl``-layout checkpoint that ``load_thinker`` reads back.

Written into a temporary sibling and renamed at the end, so an interrupted save never leaves a
half-written checkpoint. Processor and tokenizer files of the source directory are copied along so
the saved directory is self-contained; the audio tower is not (it is frozen), only its location.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omni_grpo.atomic_dir import staged_dir

if TYPE_CHECKING:
    from omni_grpo.models.thinker import OmniThinker

AUDIO_POINTER = "omni_audio_dir.json"
# Files of the source directory that are not weights or the model config: tokenizer, processor,
# chat template, generation config.
ASSET_SUFFIXES: tuple[str, ...] = (".json", ".jinja", ".txt", ".model", ".tiktoken")
NOT_ASSETS: frozenset[str] = frozenset(
    {"config.json", "model.safetensors.index.json", AUDIO_POINTER}
)


def save_thinker(thinker: OmniThinker, dst: Path, **kwargs: Any) -> Path:
    dst = Path(dst)
    if dst.exists() and any(dst.iterdir()):
        raise FileExistsError(f"{dst} exists and is not empty")
    with staged_dir(dst) as tmp:
        for item in sorted(thinker.source_dir.iterdir()):
            if item.is_file() and item.suffix in ASSET_SUFFIXES and item.name not in NOT_ASSETS:
                shutil.copy2(item, tmp / item.name)
        thinker.vl.save_pretrained(tmp, **kwargs)
        cfg_path = tmp / "config.json"
        cfg = json.loads(cfg_path.read_text())
        if cfg.get("omni_sideband") != thinker.sideband.raw:
            cfg["omni_sideband"] = thinker.sideband.raw
            cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        if thinker.audio_dir is not None:
            pointer = {"audio_dir": str(thinker.audio_dir.resolve())}
            (tmp / AUDIO_POINTER).write_text(json.dumps(pointer, indent=2) + "\n")
    return dst


def recorded_audio_dir(extracted_dir: Path) -> Path | None:
    """The audio directory a saved thinker points to, if it recorded one."""
    pointer = extracted_dir / AUDIO_POINTER
    if not pointer.is_file():
        return None
    return Path(json.loads(pointer.read_text())["audio_dir"])

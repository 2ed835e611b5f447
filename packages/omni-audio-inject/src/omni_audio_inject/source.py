"""Find the audio tower inside a directory: its config and exactly which tensors to read.

Two layouts are accepted:

* omni-extract's ``audio`` output (a directory with the audio-encoder config and the tower's
  tensors), and
* a Qwen3-Omni checkpoint (hub layout ``thinker.audio_tower.*``, or a thinker saved alone,
  ``audio_tower.*``), of which only the audio-tower tensors are read, shard by shard through
  ``safe_open``: the rest of a 66 GB checkpoint is never loaded.

Which config block and which key prefix apply are data tables below, not branches.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import safe_open

from omni_audio_inject.errors import MissingAudioTowerError

# Where the audio-encoder config lives inside a config.json, tried in order.
CONFIG_PATHS: tuple[tuple[str, ...], ...] = (
    ("thinker_config", "audio_config"),  # full Qwen3-Omni checkpoint
    ("audio_config",),  # a thinker saved alone, or an extract wrapper
    (),  # the audio-encoder config itself
)
AUDIO_ENCODER_MODEL_TYPE = "qwen3_omni_moe_audio_encoder"
# Key prefixes of the tower's tensors, tried in order; "" = bare names (an extracted tower).
KEY_PREFIXES: tuple[str, ...] = ("thinker.audio_tower.", "audio_tower.", "model.audio_tower.", "")
CONFIG_FILES: tuple[str, ...] = ("config.json", "audio_config.json")


@dataclass(frozen=True)
class TowerSource:
    """Where one audio tower's weights are: config dict and ``{tower_key: (file, stored_key)}``."""

    root: Path
    config: dict[str, Any]
    tensors: dict[str, tuple[Path, str]]


def audio_config_of(root: Path) -> dict[str, Any]:
    """The audio-encoder config dict found in ``root`` (see ``CONFIG_PATHS``)."""
    tried = []
    for name in CONFIG_FILES:
        path = root / name
        if not path.is_file():
            continue
        cfg = json.loads(path.read_text())
        for keys in CONFIG_PATHS:
            node: Any = cfg
            for k in keys:
                node = node.get(k) if isinstance(node, dict) else None
            if isinstance(node, dict) and (
                node.get("model_type") == AUDIO_ENCODER_MODEL_TYPE
                or {"d_model", "encoder_layers", "num_mel_bins"} <= node.keys()
            ):
                return node
        tried.append(str(path))
    raise MissingAudioTowerError(
        f"no audio-encoder config in {root}: looked for {', '.join(CONFIG_FILES)} "
        f"(found {tried or 'none'}) with one of the blocks "
        f"{['.'.join(p) or '<top level>' for p in CONFIG_PATHS]}"
    )


def _stored_keys(root: Path) -> dict[str, Path]:
    """Every tensor name in the directory's safetensors files -> the file holding it."""
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {k: root / f for k, f in weight_map.items()}
    keys: dict[str, Path] = {}
    for file in sorted(root.glob("*.safetensors")):
        with safe_open(file, "pt") as f:  # reads the header only
            keys.update(dict.fromkeys(f.keys(), file))
    return keys


def locate_tower(root: str | Path, expected_keys: set[str]) -> TowerSource:
    """Resolve the config and the tensor locations of the tower in ``root``.

    ``expected_keys`` are the tower module's ``state_dict`` names; the first prefix under which all
    of them exist wins. Raises :class:`MissingAudioTowerError` naming the directory and what was
    missing, never returns a partial tower.
    """
    root = Path(root)
    if not root.is_dir():
        raise MissingAudioTowerError(f"audio tower directory {root} does not exist")
    config = audio_config_of(root)
    stored = _stored_keys(root)
    if not stored:
        raise MissingAudioTowerError(f"no safetensors weights in {root} (audio tower missing)")
    best: tuple[int, str] = (-1, "")
    for prefix in KEY_PREFIXES:
        found = {k for k in expected_keys if prefix + k in stored}
        if found == expected_keys:
            tensors = {k: (stored[prefix + k], prefix + k) for k in expected_keys}
            return TowerSource(root=root, config=config, tensors=tensors)
        best = max(best, (len(found), prefix))
    count, prefix = best
    missing = sorted(k for k in expected_keys if prefix + k not in stored)
    raise MissingAudioTowerError(
        f"audio tower weights missing in {root}: best key prefix {prefix!r} matches {count}/"
        f"{len(expected_keys)} tensors; missing e.g. {[prefix + k for k in missing[:5]]}"
    )


def read_tensors(source: TowerSource) -> dict[str, Any]:
    """Read only the tower's tensors, opening each shard once."""
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for key, (file, stored) in source.tensors.items():
        by_file.setdefault(file, []).append((key, stored))
    out: dict[str, Any] = {}
    for file, pairs in by_file.items():
        with safe_open(file, "pt") as f:
            for key, stored in pairs:
                out[key] = f.get_tensor(stored)
    return out

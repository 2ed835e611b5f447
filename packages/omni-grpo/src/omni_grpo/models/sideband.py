"""The Omni facts a pseudo-Qwen3-VL checkpoint carries in ``config.json['omni_sideband']``.

Qwen3-VL's config has no field for the audio ids, the audio tower's window or Omni's time scaling;
omni-extract writes them to the sideband and this module is the one place in omni-grpo that reads
them back (the thinker, the prompt builder's token ids, the Megatron config translation and the
verification rig all go through :func:`parse_sideband`), naming the file and field when one is
missing. omni-rope reads the same block on its own side of the leaf boundary.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omni_extract.tokens import MEDIA_TOKEN_ID_FIELDS

# Token ids the thinker needs, each a required sideband field.
REQUIRED_IDS: tuple[str, ...] = MEDIA_TOKEN_ID_FIELDS
# Ids a completion must never contain, for every engine and for ``generate``: a sampled media
# marker (``<|audio_pad|>``, ``<|vision_start|>``, ``<|vision_end|>``, ...) would make the
# teacher-forced recompute look for media features or a media segment that do not exist. All
# seven markers, not only the pads and start markers: an end marker has no place in text either.
BANNED_ID_FIELDS: tuple[str, ...] = MEDIA_TOKEN_ID_FIELDS


@dataclass(frozen=True)
class OmniSideband:
    """Parsed ``omni_sideband`` block (plus the whole dict, for omni-rope and saving)."""

    raw: dict[str, Any]
    position_id_per_seconds: float
    audio_n_window: int  # audio_config.n_window: mel frames per half chunk of the audio tower

    def id(self, name: str) -> int:
        return int(self.raw[name])

    @property
    def audio_token_id(self) -> int:
        return self.id("audio_token_id")

    @property
    def banned_ids(self) -> list[int]:
        return sorted({self.id(f) for f in BANNED_ID_FIELDS})


def parse_sideband(config: dict[str, Any], where: str | Path = "config.json") -> OmniSideband:
    """The validated sideband of a loaded VL ``config.json`` dict (``where`` names it in errors)."""
    side = config.get("omni_sideband")
    if not isinstance(side, dict):
        raise ValueError(
            f"{where}: no 'omni_sideband' block; this is not an omni-extract 'vl' output "
            f"(model_type {config.get('model_type')!r})"
        )
    missing = [k for k in (*REQUIRED_IDS, "position_id_per_seconds") if side.get(k) is None]
    n_window = (side.get("audio_config") or {}).get("n_window")
    if n_window is None:
        missing.append("audio_config.n_window")
    if missing:
        raise ValueError(f"{where}: omni_sideband lacks {missing}")
    return OmniSideband(
        raw=side,
        position_id_per_seconds=float(side["position_id_per_seconds"]),
        audio_n_window=int(n_window),
    )


def read_sideband(extracted_dir: str | Path) -> OmniSideband:
    """Read and validate the sideband of an extracted ``vl`` directory."""
    path = Path(extracted_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: expected omni-extract's 'vl' output directory")
    return parse_sideband(json.loads(path.read_text()), path)


def media_token_ids(model: Any) -> list[int]:
    """The ids a completion must never contain (``BANNED_ID_FIELDS``) for ``model``'s sideband;
    ``[]`` for a model without one (e.g. a Megatron policy the loop does not hold)."""
    sideband = getattr(model, "sideband", None)
    return [] if sideband is None else sideband.banned_ids

"""The Omni facts a pseudo-Qwen3-VL checkpoint carries in ``config.json['omni_sideband']``.

Qwen3-VL's config has no field for the audio ids or Omni's time scaling; omni-extract writes them
to the sideband and this module reads them back, naming the file and field when one is missing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omni_extract.tokens import MEDIA_TOKEN_ID_FIELDS

# Token ids the thinker needs, each a required sideband field.
REQUIRED_IDS: tuple[str, ...] = MEDIA_TOKEN_ID_FIELDS
# Ids that must never be sampled into a completion: a teacher-forced forward over the completion
# would look for media features (or a media segment after a start marker) that do not exist.
PLACEHOLDER_ID_FIELDS: tuple[str, ...] = (
    "audio_token_id",
    "image_token_id",
    "video_token_id",
    "vision_start_token_id",
    "audio_start_token_id",
)


@dataclass(frozen=True)
class OmniSideband:
    """Parsed ``omni_sideband`` block (plus the whole dict, for omni-rope)."""

    raw: dict[str, Any]
    position_id_per_seconds: float

    def id(self, name: str) -> int:
        return int(self.raw[name])

    @property
    def audio_token_id(self) -> int:
        return self.id("audio_token_id")

    @property
    def placeholder_ids(self) -> list[int]:
        return sorted({self.id(f) for f in PLACEHOLDER_ID_FIELDS})


def read_sideband(extracted_dir: str | Path) -> OmniSideband:
    """Read and validate the sideband of an extracted ``vl`` directory."""
    path = Path(extracted_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: expected omni-extract's 'vl' output directory")
    cfg = json.loads(path.read_text())
    side = cfg.get("omni_sideband")
    if not isinstance(side, dict):
        raise ValueError(
            f"{path}: no 'omni_sideband' block; this is not an omni-extract 'vl' output "
            f"(model_type {cfg.get('model_type')!r})"
        )
    missing = [k for k in (*REQUIRED_IDS, "position_id_per_seconds") if side.get(k) is None]
    if missing:
        raise ValueError(f"{path}: omni_sideband lacks {missing}")
    return OmniSideband(raw=side, position_id_per_seconds=float(side["position_id_per_seconds"]))

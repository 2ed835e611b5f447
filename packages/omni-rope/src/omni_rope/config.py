"""``OmniRopeConfig``: the handful of values TM-RoPE needs, read strictly from real configs.

transformers' ``Qwen3OmniMoeThinkerConfig()`` defaults are wrong for Qwen3-Omni (25 positions per
second instead of 13, Qwen2.5-Omni audio ids, no ``vision_start_token_id``). A wrong value here does not
fail anything downstream - it silently shifts every video and audio position - so every field must
come from a config that states it; nothing falls back to a default.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omni_rope.audio import audio_output_length
from omni_rope.errors import OmniRopeError

# Thinker-level fields (same key in an Omni ``thinker_config`` and in the VL ``omni_sideband``).
THINKER_KEYS: tuple[str, ...] = (
    "position_id_per_seconds",
    "image_token_id",
    "video_token_id",
    "audio_token_id",
    "vision_start_token_id",
    "vision_end_token_id",
    "audio_start_token_id",
    "audio_end_token_id",
)
# Fields whose transformers class default is a Qwen2.5-Omni value or missing: when the source is a
# config *object* (where an unset field is indistinguishable from a set one) such a field equal to the
# class default is treated as "not set" and refused.
HF_WRONG_DEFAULT_KEYS: tuple[str, ...] = (
    "position_id_per_seconds",
    "audio_token_id",
    "audio_start_token_id",
)


@dataclass(frozen=True)
class OmniRopeConfig:
    """Values Qwen3-Omni TM-RoPE positions depend on (ids, time scale, merge size, audio window).

    ``seconds_per_chunk`` is carried for the data code (it is not used by positions).
    """

    position_id_per_seconds: float
    spatial_merge_size: int
    image_token_id: int
    video_token_id: int
    audio_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    audio_start_token_id: int
    audio_end_token_id: int
    audio_n_window: int
    seconds_per_chunk: float | None = None

    def __post_init__(self) -> None:
        ids = {k: getattr(self, k) for k in THINKER_KEYS if k.endswith("_token_id")}
        for key, value in ids.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise OmniRopeError(
                    f"OmniRopeConfig.{key}: expected a non-negative int, got {value!r}"
                )
        dupes = {v for v in ids.values() if list(ids.values()).count(v) > 1}
        if dupes:
            clash = sorted(k for k, v in ids.items() if v in dupes)
            raise OmniRopeError(
                f"OmniRopeConfig: token ids must be distinct, but {clash} share ids"
            )
        pps = self.position_id_per_seconds
        if isinstance(pps, bool) or not isinstance(pps, int | float) or not pps > 0:
            raise OmniRopeError(
                f"OmniRopeConfig.position_id_per_seconds: expected a positive number, got {pps!r}"
            )
        for key in ("spatial_merge_size", "audio_n_window"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise OmniRopeError(f"OmniRopeConfig.{key}: expected a positive int, got {v!r}")

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_omni_config(cls, config: Any) -> OmniRopeConfig:
        """From a Qwen3-Omni config: full model or thinker, as HF config object or ``config.json`` dict."""
        from_object = not isinstance(config, Mapping)
        raw = _as_dict(config)
        where = "config"
        if "thinker_config" in raw:
            raw, where = _as_dict(raw["thinker_config"]), "thinker_config"
            thinker_obj = getattr(config, "thinker_config", None) if from_object else None
        else:
            thinker_obj = config if from_object else None
        values = {k: _require(raw, k, where) for k in THINKER_KEYS}
        if thinker_obj is not None:
            _refuse_class_defaults(thinker_obj, values, where)
        vision = _require_section(raw, "vision_config", where)
        audio = _require_section(raw, "audio_config", where)
        return cls(
            **values,
            spatial_merge_size=_require(vision, "spatial_merge_size", f"{where}.vision_config"),
            audio_n_window=_require(audio, "n_window", f"{where}.audio_config"),
            seconds_per_chunk=raw.get("seconds_per_chunk"),
        )

    @classmethod
    def from_vl_config(cls, config: Any) -> OmniRopeConfig:
        """From omni-extract's pseudo Qwen3-VL-MoE config (object or dict) and its ``omni_sideband``."""
        raw = _as_dict(config)
        side = raw.get("omni_sideband")
        if side is None:
            raise OmniRopeError(
                "VL config: no 'omni_sideband' block - this is not a checkpoint written by "
                "omni_extract (variant 'vl'), so the Omni time scale and audio ids are unknown"
            )
        side = _as_dict(side)
        values = {k: _require(side, k, "omni_sideband") for k in THINKER_KEYS}
        # The vision ids also live at the VL top level; they must agree with the sideband.
        for key in (
            "image_token_id",
            "video_token_id",
            "vision_start_token_id",
            "vision_end_token_id",
        ):
            top = raw.get(key)
            if top is not None and top != values[key]:
                raise OmniRopeError(
                    f"VL config: {key} is {top} at the top level but {values[key]} in omni_sideband"
                )
        vision = _require_section(raw, "vision_config", "VL config")
        audio = _require_section(side, "audio_config", "omni_sideband")
        return cls(
            **values,
            spatial_merge_size=_require(vision, "spatial_merge_size", "vision_config"),
            audio_n_window=_require(audio, "n_window", "omni_sideband.audio_config"),
            seconds_per_chunk=side.get("seconds_per_chunk"),
        )

    @classmethod
    def from_pretrained_dir(cls, path: Any) -> OmniRopeConfig:
        """From a checkpoint directory: an Omni checkpoint or an omni-extract ``vl`` checkpoint."""
        import json
        from pathlib import Path

        file = Path(path) / "config.json"
        try:
            raw = json.loads(file.read_text())
        except FileNotFoundError as exc:
            raise OmniRopeError(f"{file}: not found") from exc
        except json.JSONDecodeError as exc:
            raise OmniRopeError(f"{file}: not valid JSON ({exc})") from exc
        try:
            return cls.from_vl_config(raw) if "omni_sideband" in raw else cls.from_omni_config(raw)
        except OmniRopeError as exc:
            raise OmniRopeError(f"{file}: {exc}") from exc

    # ------------------------------------------------------------------ helpers

    def audio_output_length(self, n_mel_frames: Any) -> Any:
        """Audio tokens for ``n_mel_frames`` with this config's audio window."""
        return audio_output_length(n_mel_frames, n_window=self.audio_n_window)


def _as_dict(obj: Any) -> dict[str, Any]:
    if isinstance(obj, Mapping):
        return dict(obj)
    to_dict = getattr(obj, "to_dict", None)
    if callable(to_dict):
        return to_dict()
    raise OmniRopeError(f"expected a config dict or a transformers config object, got {type(obj)}")


def _require(d: Mapping[str, Any], key: str, where: str) -> Any:
    if d.get(key) is None:
        raise OmniRopeError(f"{where}.{key} is missing (no default is assumed)")
    return d[key]


def _require_section(d: Mapping[str, Any], key: str, where: str) -> dict[str, Any]:
    return _as_dict(_require(d, key, where))


def _refuse_class_defaults(obj: Any, values: dict[str, Any], where: str) -> None:
    """Reject fields of a config object that still hold transformers' (wrong) class default."""
    try:
        defaults = type(obj)()
    except Exception:  # a config class that cannot be built bare gives us nothing to compare with
        return
    for key in HF_WRONG_DEFAULT_KEYS:
        if getattr(defaults, key, None) == values[key]:
            raise OmniRopeError(
                f"{where}.{key} = {values[key]!r} is transformers' {type(obj).__name__} default, not a "
                "Qwen3-Omni value (e.g. position_id_per_seconds is 13 for the released thinker); set it "
                "explicitly or build OmniRopeConfig from the checkpoint's config.json"
            )

"""``model:``: the Omni checkpoint, where its extracted parts go, and the tiny one made for tests."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from omni_grpo.config.base import PathField, StrictModel


class TinyModelConfig(StrictModel):
    """Create a tiny random Omni checkpoint at ``model.omni_checkpoint`` when it does not exist."""

    vocab: Literal["small", "real"] = "small"
    seed: int | None = Field(None, description="default run.seed")
    sizes: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="overrides per tower: {'text': {...}, 'vision': {...}, 'audio': {...}}",
    )

    @field_validator("sizes")
    @classmethod
    def _known_towers(cls, v: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        # The factory merges these into transformers configs, which keep any key silently.
        from omni_extract.tiny import check_size_overrides

        check_size_overrides(v)
        return v


class ModelConfig(StrictModel):
    omni_checkpoint: PathField | None = None
    make_tiny: TinyModelConfig | None = None
    extracted_dir: PathField | None = Field(None, description="default <run.dir>/model/vl")
    audio_dir: PathField | None = Field(None, description="default <run.dir>/model/audio")
    dtype: Literal["float32", "bfloat16", "auto"] = "auto"
    freeze_visual: bool = True
    freeze_lm_head: bool = False

    def extracted(self) -> bool:
        """Both parts the trainer loads are already extracted (``omni-grpo extract``): the
        Omni checkpoint itself is then not needed to train (``export`` still names a base)."""
        return all(
            d is not None and (d / "config.json").is_file()
            for d in (self.extracted_dir, self.audio_dir)
        )

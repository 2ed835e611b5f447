"""The data that flows through one GRPO step (see ``shared/design.md``).

These are the seams between components: data -> rollout engine -> rewards -> algo -> backend ->
weight sync. Each component takes its own config sub-model and these types, never the whole config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

# Processed multimodal tensor names, exactly as transformers' Omni thinker forward and sglang-omni's
# ``multimodal_train_inputs`` spell them.
MM_TENSOR_KEYS: tuple[str, ...] = (
    "pixel_values",
    "image_grid_thw",
    "pixel_values_videos",
    "video_grid_thw",
    "video_second_per_grid",
    "input_features",
    "feature_attention_mask",
)


@dataclass
class Sample:
    """One dataset row after validation (media still referenced by path, not decoded)."""

    uid: str
    prompt: str
    label: str
    media: list[dict[str, Any]] = field(default_factory=list)  # [{"type": "image"|"video"|"audio", "path": ...}]
    choices: list[str] | None = None
    reward: str = "mcq"
    modality: str = "text"  # image | video | audio | text | mixed (for per-modality eval metrics)
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class PromptInputs:
    """A prompt ready for the model: placeholder-expanded ids plus processed media tensors."""

    sample: Sample
    input_ids: list[int]
    mm: dict[str, torch.Tensor] = field(default_factory=dict)  # keys from MM_TENSOR_KEYS
    use_audio_in_video: bool = False


@dataclass
class Completion:
    """One sampled response, as an engine returns it."""

    prompt: PromptInputs
    token_ids: list[int]
    logprobs: list[float]  # rollout-side logprobs, one per token in token_ids
    finish_reason: str  # stop | length | abort
    weight_version: str = "default"
    text: str = ""
    reward: float = 0.0


@dataclass
class SamplingConfig:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 64
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None


@runtime_checkable
class RolloutEngine(Protocol):
    """Generates ``n`` completions per prompt (embedded in-process, or an sglang-omni server)."""

    def generate(
        self, prompts: list[PromptInputs], n: int, sampling: SamplingConfig
    ) -> list[list[Completion]]: ...


@runtime_checkable
class Reward(Protocol):
    """Scores one completion of one sample; pluggable through the ``omni_grpo.rewards`` entry points."""

    name: str

    def score(self, sample: Sample, completion_text: str) -> float: ...


@runtime_checkable
class TrainerBackend(Protocol):
    """Owns the policy (and reference) weights and applies one GRPO update per step."""

    def step(self, batch: Any) -> dict[str, float]: ...

    def state_dict_for_sync(self) -> dict[str, torch.Tensor]: ...

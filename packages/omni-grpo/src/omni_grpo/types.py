"""The data that flows through one GRPO step (see ``shared/design.md``).

These are the seams between components: data -> rollout engine -> rewards -> algo -> backend ->
weight sync. Each component takes its own config sub-model and these types, never the whole config.
``TrainerBackend`` below is the whole contract between the loop (``omni_grpo.trainer``, or a
driver that runs it over several trainer processes) and a backend: the loop uses nothing else.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn


@dataclass
class Sample:
    """One dataset row after validation (media still referenced by path, not decoded)."""

    uid: str
    prompt: str
    label: str
    media: list[dict[str, Any]] = field(
        default_factory=list
    )  # [{"type": "image"|"video"|"audio", "path": ...}]
    choices: list[str] | None = None
    reward: str | None = None  # None: the config's rewards.by_modality / rewards.default choose
    modality: str = "text"  # image | video | audio | text | mixed (for per-modality eval metrics)
    metadata: dict[str, Any] = field(default_factory=dict)
    # Every video of the prompt carries its own sound track, interleaved with its frames (the
    # Omni processor's ``use_audio_in_video``); None: ``data.use_audio_in_video`` decides.
    use_audio_in_video: bool | None = None


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
    # leading tokens drawn by an earlier policy (partial rollouts continued across steps)
    stale_tokens: int = 0


class SamplingParams(BaseModel):
    """How completions are sampled: the one sampling type, from the YAML to the engines.

    Lives with the seam types because every engine takes it (``RolloutEngine.generate``); the
    config tree holds it as ``rollout.sampling`` / ``rollout.eval_sampling``. Validated once and
    handed to the rollout engines as it is (the embedded sampler, the
    sglang-omni request body, the Ray rollout actors); frozen, so no engine can change the run's
    sampling for the next call.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    max_new_tokens: int = Field(64, ge=1)
    stop_token_ids: list[int] = Field(default_factory=list)
    seed: int | None = None


@runtime_checkable
class RolloutEngine(Protocol):
    """Generates ``n`` completions per prompt (embedded in-process, or an sglang-omni server)."""

    def generate(
        self, prompts: list[PromptInputs], n: int, sampling: SamplingParams
    ) -> list[list[Completion]]: ...

    def close(self) -> None:
        """Release what the engine holds (HTTP pools, event-loop threads); idempotent."""
        ...


@runtime_checkable
class Reward(Protocol):
    """Scores one completion of one sample; pluggable through the ``omni_grpo.rewards`` entry points."""

    name: str

    def score(self, sample: Sample, completion_text: str) -> float: ...


# How a source holds fused MoE experts, which shapes cannot tell (the square-shape trap); the
# layouts ``omni_extract.names.to_server_tensors`` takes:
# * "hf_memory": a transformers module (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``);
# * "vl_hub":    the Qwen3-VL hub layout (``[E, H, 2I]`` / ``[E, I, H]``), e.g. the Megatron export.
SourceLayout = Literal["hf_memory", "vl_hub"]
# Weights as ``(name, tensor)`` pairs: a Mapping (a state dict: every name is checked before the
# first byte is sent) or any iterable (a generator that gathers tensor by tensor, streamed).
NamedTensors = Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]


@dataclass
class GRPOBatch:
    """What one optimizer step consumes: groups of completions and their advantages.

    The ONE batch type of every backend: a backend turns it into its own tensors (micro-batches,
    positions) inside ``step``. ``advantages[g, i]`` belongs to ``groups[g][i]`` and is computed by
    the loop over the whole group before any sharding, so a shard of groups keeps its rows' values.
    Empty completions (zero tokens) stay in their group: they count as samples in the loss
    normaliser (``omni_grpo.algo.step.local_counts``) but carry no token to train on.
    """

    groups: list[list[Completion]]  # one list per prompt, n completions each
    advantages: torch.Tensor  # [num_groups, n]
    temperature: float = 1.0  # the rollout sampling temperature (logprobs are recomputed under it)
    lr: float | None = None  # this update's learning rate (the loop's schedule); None: trainer.lr


@runtime_checkable
class TrainerBackend(Protocol):
    """Owns the policy (and reference) weights and applies one GRPO update per ``step``.

    Registered through the ``omni_grpo.backends`` entry points (``omni_grpo.backends``); the loop
    calls exactly these members, nothing through ``getattr``.

    **Ranks.** A backend runs in one process (``torch.distributed`` not initialised, or a world of
    1) or in every process of a data-parallel world (``torch.distributed`` initialised from the
    usual ``MASTER_ADDR`` / ``MASTER_PORT`` / ``RANK`` / ``WORLD_SIZE`` env before the backend is
    built; gloo on CPU, NCCL on GPU). Then:

    * one process drives (data, rollouts, rewards, advantages, logging, eval, ``sync.push``); it
      splits the global batch with ``omni_grpo.algo.shard.shard_batch(batch, world_size)`` and
      hands shard ``r`` to rank ``r``;
    * EVERY rank calls ``step(shard)`` for every step, also with an empty shard (zero groups:
      ``GRPOBatch([], torch.zeros(0, n))``) — ``step`` is collective;
    * ``step`` all-reduces the loss normalisers (samples, response tokens) and the "any signal"
      flag over the data-parallel world (``omni_grpo.algo.step.global_counts``), sums gradients,
      and reduces its metrics, so the update and the returned metrics are those of the
      single-process step on the unsharded batch, identical on every rank (fp32, tested on the
      torch backend: loss, metrics and grad norm within 1e-5; weights within 1e-5 at lr 1e-3 —
      AdamW's first update ``lr * g / (|g| + eps)`` scales summation-order noise on a gradient
      element near 0 by ``lr``);
    * ``supervised_step`` is collective the same way (each rank its share of the prompts, the
      token normaliser all-reduced);
    * weights and optimizer state stay identical across data-parallel ranks, so a checkpoint
      (``trainable_state`` / ``optimizer_state``) is written by rank 0 only and loaded
      (``load_*``) on every rank.

    Set-up order on a rank: ``torch.cuda.set_device(local_rank)`` (GPU), then
    ``torch.distributed.init_process_group()`` from the env, then build the backend (the factory
    of ``omni_grpo.backends``): the torch backend broadcasts rank 0's initial weights when it is
    built and uses the default world as its data-parallel group. Its step's cost in one process
    is unchanged (every collective is skipped for a world of 1).

    Model-parallel backends (Megatron TP/EP): the ranks of one model-parallel replica all get the
    shard of their data-parallel index (the same shard), the reductions run over megatron's
    data-parallel group, and the export is collective: every rank must drain
    ``weights_for_sync()``'s iterator, and only the driver pushes.
    """

    name: str
    policy: nn.Module | None
    """The in-process module an embedded rollout engine may sample from (shared, not copied), or
    None when the weights live in a form no HF-style engine can run (Megatron)."""
    device: torch.device
    """Where the policy computes; an embedded engine runs on the same device."""
    is_driver: bool
    """True in the process that runs data, rollouts, rewards, logging and ``sync.push`` and
    writes checkpoints: the only process without ``torch.distributed``, else rank 0."""

    def step(self, batch: GRPOBatch) -> dict[str, float]:
        """One optimizer step (``trainer.ppo_epochs`` updates) over ``batch``; returns the metrics
        of ``omni_grpo.algo.step.step_metrics`` (token-weighted means, ``grad_norm``,
        ``skipped_step``, ``no_signal_step``, ``response_tokens``, ``lr``, ``micro_batches``)."""
        ...

    def supervised_step(
        self, prompts: list[PromptInputs], targets: list[list[int]], lr: float
    ) -> float:
        """One cross-entropy step on ``targets`` at learning rate ``lr`` (the format warm-up);
        returns the mean token NLL. Backends that cannot do it raise ``NotImplementedError``."""
        ...

    def weights_for_sync(self) -> tuple[NamedTensors, SourceLayout]:
        """The weights a remote rollout engine needs after a step, and how they are laid out.

        Passed as is to ``WeightSync.push(weights, version, layout=layout)``: no copy into a
        dict, no transpose to another layout — an iterator is streamed bucket by bucket.
        """
        ...

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """Trainable weights on the CPU for a checkpoint (frozen parts reload from the model dir)."""
        ...

    def load_trainable_state(self, state: dict[str, torch.Tensor]) -> None:
        """Restore ``trainable_state()``; raises naming the first mismatched weights."""
        ...

    def optimizer_state(self) -> dict[str, Any]:
        """Optimizer state (picklable) for a checkpoint."""
        ...

    def load_optimizer_state(self, state: dict[str, Any]) -> None: ...

    def close(self) -> None:
        """Release what the backend holds; idempotent. Leaves ``torch.distributed`` to its owner."""
        ...


class WeightSyncError(RuntimeError):
    """A weight sync failed. The server's generation has been resumed; its weights may be stale."""


@dataclass
class SyncReport:
    """What one ``push`` did, for metrics.jsonl (``weight_sync/*``)."""

    version: str
    mode: str
    tensors: int = 0
    bytes: int = 0
    skipped_tower_tensors: int = 0
    buckets: int = 0
    seconds: float = 0.0
    servers: list[str] = field(default_factory=list)

    def metrics(self) -> dict[str, float]:
        return {
            "weight_sync/tensors": float(self.tensors),
            "weight_sync/bytes": float(self.bytes),
            "weight_sync/buckets": float(self.buckets),
            "weight_sync/seconds": self.seconds,
            "weight_sync/gbps": (self.bytes / 1e9 / self.seconds) if self.seconds > 0 else 0.0,
        }


@runtime_checkable
class WeightSync(Protocol):
    """Pushes the trainer's thinker weights to the rollout servers after an optimizer step."""

    mode: str

    def push(
        self, named_tensors: NamedTensors, version: str, *, layout: SourceLayout = "hf_memory"
    ) -> SyncReport:
        """Send every text/lm_head tensor under ``version``; return only once servers serve it."""
        ...

    def close(self) -> None:
        """Release connections and process groups (idempotent)."""
        ...


def __getattr__(name: str) -> Any:
    # ``MM_TENSOR_KEYS``: the processed multimodal tensor names, exactly as transformers' Omni
    # thinker forward and sglang-omni's ``multimodal_train_inputs`` spell them. One list, owned by
    # omni-rollout-client (the wire contract); re-exported lazily so importing the types does not
    # import the HTTP client.
    if name == "MM_TENSOR_KEYS":
        from omni_rollout_client.payload import MM_TENSOR_NAMES

        return MM_TENSOR_NAMES
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

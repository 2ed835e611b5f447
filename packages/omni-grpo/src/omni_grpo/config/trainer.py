"""``trainer:``: the backend that takes the optimizer steps, and how (schedule, LoRA, Megatron)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from omni_grpo.config.base import StrictModel, registered_name


class WarmupConfig(StrictModel):
    """Optional supervised format warm-up before GRPO (teaches the answer format)."""

    steps: int = Field(0, ge=0)
    lr: float = Field(1e-4, gt=0)


class LrScheduleConfig(StrictModel):
    """The learning rate of GRPO step k (``omni_grpo.algo.schedule.lr_at``): a linear ramp over
    ``warmup_steps``, then ``constant`` at ``trainer.lr`` or a ``cosine`` / ``linear`` decay to
    ``min_lr_ratio * trainer.lr`` at ``run.steps``. A function of the step only, so a resumed run
    continues on the same curve. The supervised format warm-up keeps its own ``warmup.lr``."""

    kind: Literal["constant", "cosine", "linear"] = "constant"
    warmup_steps: int = Field(0, ge=0, description="GRPO steps of linear ramp from lr/warmup_steps")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="the decay's floor, times trainer.lr")


class MegatronConfig(StrictModel):
    tp: int = Field(1, ge=1)
    ep: int = Field(1, ge=1)
    pp: int = Field(1, ge=1, le=1, description="pipeline parallelism is not supported")
    sp: bool = False
    max_tokens_per_gpu: int = Field(8192, ge=1)
    recompute: Literal["none", "selective", "full"] = "none"
    precision: Literal["bf16", "fp32"] = "bf16"

    @model_validator(mode="after")
    def _sp_with_tp_moe(self) -> MegatronConfig:
        if self.tp > 1 and not self.sp:
            raise ValueError(
                "tp > 1 with MoE requires sp: true (megatron-core refuses MoE+TP without SP)"
            )
        return self


class LoraConfig(StrictModel):
    """LoRA adapters (peft) instead of full fine-tuning, for the torch backend.

    ``targets`` are groups of ``omni_grpo.models.lora.LORA_TARGETS``: ``attention`` (the text
    layers' q/k/v/o projections), ``experts`` (the fused MoE experts, through peft's
    ``target_parameters``), ``visual`` (the vision tower's linear layers), ``lm_head``. Everything
    else (embeddings, norms, router) stays frozen; the audio tower is never a parameter at all.
    """

    rank: int = Field(16, ge=1)
    alpha: float = Field(32.0, gt=0, description="scale = alpha / rank")
    dropout: float = Field(0.0, ge=0, lt=1)
    targets: list[Literal["attention", "experts", "visual", "lm_head"]] = Field(
        default_factory=lambda: ["attention", "experts"], min_length=1
    )
    expert_path: Literal["grouped", "peft"] = Field(
        "grouped",
        description="experts LoRA compute: 'grouped' low-rank GEMMs over the routed tokens "
        "(omni_grpo.models.grouped_experts), or peft's parametrisation, which rebuilds "
        "W + scale*B*A of every expert at each forward (kept for comparison)",
    )

    @field_validator("targets")
    @classmethod
    def _no_repeats(cls, targets: list[str]) -> list[str]:
        if len(set(targets)) != len(targets):
            raise ValueError(f"trainer.lora.targets repeats a group: {targets}")
        return targets


class TrainerConfig(StrictModel):
    backend: str = Field(
        "torch",
        description="a name in the omni_grpo.backends entry-point group (built in: torch, megatron)",
    )

    @field_validator("backend")
    @classmethod
    def _registered_backend(cls, name: str) -> str:
        return registered_name("omni_grpo.backends", name, "trainer backend")

    device: Literal["auto", "cpu", "cuda"] = "auto"
    lr: float = Field(1e-6, gt=0)
    lr_schedule: LrScheduleConfig = Field(default_factory=LrScheduleConfig)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    max_grad_norm: float = Field(1.0, gt=0)
    micro_batch_size: int = Field(1, ge=1)
    micro_batch_tokens: int | None = Field(
        None,
        ge=1,
        description="torch backend: pack rows of several prompts into a micro-batch of at most "
        "micro_batch_size rows and this many padded tokens (rows x (widest prompt + longest "
        "completion)); unset: each micro-batch holds one prompt's rows",
    )
    ppo_epochs: int = Field(1, ge=1)
    warmup: WarmupConfig | None = None
    megatron: MegatronConfig = Field(default_factory=MegatronConfig)
    world_size: int = Field(
        1,
        ge=1,
        description="trainer ranks; > 1 makes `omni-grpo train` the driver of one Ray actor per "
        "rank (megatron: tp x ep x dp, a multiple of lcm(tp, ep))",
    )
    lora: LoraConfig | None = Field(
        None, description="LoRA adapters (torch backend); None = full fine-tuning"
    )
    gradient_checkpointing: bool = Field(
        False,
        description="torch backend: recompute each decoder layer in the backward instead of "
        "keeping its activations (the 30B thinker on one GPU needs it)",
    )
    checkpoint_policy: Literal["layer", "selective"] = Field(
        "layer",
        description="with gradient_checkpointing: 'layer' recomputes each decoder layer's whole "
        "forward in the backward; 'selective' keeps the text layers' attention products "
        "(projections, LoRA factors, attention core: ~22 KiB per token and layer at the released "
        "widths) and recomputes the MoE block and elementwise ops "
        "(omni_grpo.models.selective_checkpoint)",
    )
    compile: bool = Field(
        False,
        description="torch backend: torch.compile the text decoder layers' attention, MoE block "
        "and norms (dynamic shapes) for the trainer's forwards and backward; generation keeps "
        "its own CUDA-graph decode. The first step pays the compilation",
    )

    @model_validator(mode="after")
    def _lora_backend(self) -> TrainerConfig:
        if self.lora is not None and self.backend == "megatron":
            raise ValueError(
                "trainer.lora needs trainer.backend: torch (the megatron backend trains all weights)"
            )
        if self.gradient_checkpointing and self.backend == "megatron":
            raise ValueError(
                "trainer.gradient_checkpointing is the torch backend's; megatron recomputes with "
                "trainer.megatron.recompute"
            )
        if self.checkpoint_policy != "layer" and not self.gradient_checkpointing:
            raise ValueError(
                f"trainer.checkpoint_policy {self.checkpoint_policy!r} needs "
                "trainer.gradient_checkpointing: true"
            )
        if self.compile and self.backend == "megatron":
            raise ValueError(
                "trainer.compile is the torch backend's (megatron-core runs its own fused kernels)"
            )
        return self

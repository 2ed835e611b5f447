"""The whole tree (``OmniGRPOConfig``) and the rules that span its sections.

A section checks only itself; a setting that contradicts another section's, or one that a chosen
backend or ``rollout.exact_logprobs`` cannot honour, is refused here, one sentence per problem
naming both fields, before anything runs.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from omni_grpo.config.algo import AlgoConfig
from omni_grpo.config.base import StrictModel
from omni_grpo.config.data import DataConfig
from omni_grpo.config.evaluation import EvalConfig
from omni_grpo.config.model import ModelConfig
from omni_grpo.config.ray import RayConfig
from omni_grpo.config.rewards import RewardsConfig
from omni_grpo.config.rollout import RolloutConfig
from omni_grpo.config.run import RunConfig
from omni_grpo.config.trainer import TrainerConfig


class OmniGRPOConfig(StrictModel):
    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    rewards: RewardsConfig = Field(default_factory=RewardsConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    ray: RayConfig = Field(default_factory=RayConfig)

    @model_validator(mode="after")
    def _backend_supports(self) -> OmniGRPOConfig:
        if self.trainer.backend == "megatron":
            refusals = megatron_refusals(self)
            if refusals:
                raise ValueError("; ".join(refusals))
        return self

    @model_validator(mode="after")
    def _consistent(self) -> OmniGRPOConfig:
        problems = contradictions(self)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @model_validator(mode="after")
    def _exact_supported(self) -> OmniGRPOConfig:
        refusals = exact_logprobs_refusals(self)
        if refusals:
            raise ValueError("; ".join(refusals))
        return self

    @model_validator(mode="after")
    def _derived_paths(self) -> OmniGRPOConfig:
        # Defaults that depend on run.dir / run.seed; assigned without re-validation loops.
        if self.model.make_tiny is not None and self.model.make_tiny.seed is None:
            object.__setattr__(self.model.make_tiny, "seed", self.run.seed)
        if self.data.synthetic is not None and self.data.synthetic.seed is None:
            object.__setattr__(self.data.synthetic, "seed", self.run.seed)
        if self.model.extracted_dir is None:
            object.__setattr__(self.model, "extracted_dir", self.run.dir / "model" / "vl")
        if self.model.audio_dir is None:
            object.__setattr__(self.model, "audio_dir", self.run.dir / "model" / "audio")
        if self.data.root is None and self.data.train is not None:
            object.__setattr__(self.data, "root", self.data.default_root())
        return self


def contradictions(cfg: OmniGRPOConfig) -> list[str]:
    """Settings one of which makes another meaningless, one sentence each naming both fields.

    Each was accepted before and did nothing, or not what it says: a warm-up longer than the run
    never reaches ``trainer.lr`` (and a decay never starts), a logging interval longer than the
    run logs no step, a cluster address with a local core count ignores the count, servers to
    launch for another engine are never launched.
    """
    out = []
    sched, steps = cfg.trainer.lr_schedule, cfg.run.steps
    if sched.warmup_steps and sched.warmup_steps > steps:
        out.append(
            f"trainer.lr_schedule.warmup_steps ({sched.warmup_steps}) is longer than run.steps "
            f"({steps}): the warm-up would never reach trainer.lr; shorten it or raise run.steps"
        )
    elif sched.warmup_steps and sched.kind != "constant" and sched.warmup_steps >= steps - 1:
        out.append(
            f"trainer.lr_schedule.warmup_steps ({sched.warmup_steps}) leaves no step of run.steps "
            f"({steps}) for the {sched.kind} decay; shorten it, raise run.steps or use kind: "
            "constant"
        )
    if steps and cfg.run.log_every > steps:
        out.append(
            f"run.log_every ({cfg.run.log_every}) is longer than run.steps ({steps}): no step's "
            "metrics would be logged; lower it"
        )
    if cfg.ray.address and cfg.ray.num_cpus is not None:
        out.append(
            "ray.num_cpus sizes a local Ray only and is ignored with ray.address "
            f"({cfg.ray.address}); remove one of them"
        )
    extra = cfg.rollout.embedded.extra_groups
    in_process = not cfg.rollout.embedded.actors and cfg.trainer.world_size == 1
    if extra and (cfg.rollout.engine != "embedded" or not in_process):
        out.append(
            f"rollout.embedded.extra_groups ({extra}) keeps groups in flight in the in-process "
            "embedded engine (rollout.engine embedded, rollout.embedded.actors 0, "
            "trainer.world_size 1); set it to 0"
        )
    if extra and cfg.rollout.embedded.batching == "static":
        out.append(
            f"rollout.embedded.extra_groups ({extra}) needs rollout.embedded.batching continuous "
            "or auto (the static decoder cannot stop at the groups a step needs)"
        )
    if extra and cfg.rollout.max_staleness:
        out.append(
            f"rollout.embedded.extra_groups ({extra}) and rollout.max_staleness 1 both train on "
            "samples of earlier policies, in two ways that do not compose; choose one"
        )
    if cfg.rollout.sglang.launch is not None and cfg.rollout.engine != "sglang-omni":
        out.append(
            f"rollout.sglang.launch starts servers for rollout.engine sglang-omni, but the engine "
            f"is {cfg.rollout.engine!r}: they would never be used; remove it or change the engine"
        )
    return out


def exact_logprobs_refusals(cfg: OmniGRPOConfig) -> list[str]:
    """Where an explicit ``rollout.exact_logprobs: true`` cannot hold, one sentence each (empty
    when it is off or ``auto``: ``auto`` turns it off there instead, see ``exact_obstacles``)."""
    if cfg.rollout.exact_logprobs is not True:
        return []
    return exact_obstacles(cfg)


def exact_obstacles(cfg: OmniGRPOConfig) -> list[str]:
    """Why ``rollout.exact_logprobs`` cannot hold for ``cfg``, one sentence each (the settings
    alone; the device, dtype and Triton are checked when the model is switched).

    The bitwise equality needs the rollout and the trainer to run the same module with the same
    kernels and the same bits: the embedded engine, in the trainer's process (sharing its
    module) or as Ray rollout actors (each holding a copy that the sync keeps bitwise equal to
    the trainer's: full weights, or with LoRA the unmerged adapters, never ``W + scale B A``,
    whose products round differently). The device and dtype are checked again when the model
    is switched (``omni_grpo.exact.check_supported``, in every actor), where ``auto`` has been
    resolved.
    """
    out = []
    where = "rollout.exact_logprobs"
    if cfg.rollout.engine != "embedded":
        out.append(f"{where} needs rollout.engine embedded (got {cfg.rollout.engine!r})")
    if cfg.trainer.backend != "torch":
        out.append(f"{where} needs trainer.backend torch (got {cfg.trainer.backend!r})")
    if cfg.trainer.device == "cpu":
        out.append(f"{where} needs a CUDA device (trainer.device is cpu)")
    if cfg.model.dtype == "float32":
        out.append(f"{where} needs model.dtype bfloat16 (got float32)")
    if getattr(cfg.trainer, "compile", False) and not cfg.trainer.gradient_checkpointing:
        out.append(
            f"{where} with trainer.compile needs trainer.gradient_checkpointing: the policy's "
            "forward keeps the rollout's exact kernels and only the recompute is compiled"
        )
    if cfg.trainer.checkpoint_policy != "layer":
        out.append(
            f"{where} needs trainer.checkpoint_policy layer (got "
            f"{cfg.trainer.checkpoint_policy!r}): the selective policy replays the first "
            "forward's saved products in the recompute, which exact mode runs with other kernels"
        )
    if cfg.trainer.lora is not None and cfg.trainer.lora.dropout > 0:
        out.append(
            f"{where} needs trainer.lora.dropout 0 (got {cfg.trainer.lora.dropout}): dropout in "
            "the trainer's forward is absent from the rollout's"
        )
    return out


# Megatron precision names and the model.dtype each one equals.
MEGATRON_DTYPES: dict[str, str] = {"bf16": "bfloat16", "fp32": "float32"}


def megatron_refusals(cfg: OmniGRPOConfig) -> list[str]:
    """What the Megatron backend would silently ignore in ``cfg``, one sentence each.

    Its visual tower always runs under ``no_grad``, its precision is
    ``trainer.megatron.precision`` and it packs micro-batches by ``max_tokens_per_gpu``; accepting
    a setting it does not honour would make a run differ from its config without a word.
    """
    out = []
    if not cfg.model.freeze_visual:
        out.append(
            "model.freeze_visual: false is not supported by the megatron backend (its visual "
            "tower is frozen); use trainer.backend: torch to train the vision tower"
        )
    want = MEGATRON_DTYPES[cfg.trainer.megatron.precision]
    if cfg.model.dtype not in ("auto", want):
        out.append(
            f"model.dtype {cfg.model.dtype} disagrees with trainer.megatron.precision "
            f"{cfg.trainer.megatron.precision} (the megatron backend's precision); set model.dtype "
            f"to auto or {want}"
        )
    if cfg.trainer.micro_batch_size != 1:
        out.append(
            f"trainer.micro_batch_size {cfg.trainer.micro_batch_size} is not used by the megatron "
            "backend (it packs micro-batches by trainer.megatron.max_tokens_per_gpu); leave it at 1"
        )
    if cfg.trainer.micro_batch_tokens is not None:
        out.append(
            "trainer.micro_batch_tokens is not used by the megatron backend (it packs "
            "micro-batches by trainer.megatron.max_tokens_per_gpu); leave it unset"
        )
    if cfg.trainer.warmup is not None and cfg.trainer.warmup.steps > 0:
        out.append(
            "trainer.warmup (the supervised format warm-up) is not implemented for the megatron backend"
        )
    if cfg.algo.kl_type == "full" and cfg.algo.kl_coef != 0:
        out.append(
            "algo.kl_type full is not implemented for the megatron backend (it needs a "
            "vocab-parallel KL over both models' logits); use k3 or low_var_kl"
        )
    return out

"""The one configuration tree of omni-grpo: pydantic v2 models loaded from YAML.

Every model forbids unknown keys so that a typo (``rollout.n_sample``) fails loudly with the dotted
path of the bad field instead of being silently ignored. Each component receives only ITS
sub-model (``cfg.algo``, ``cfg.data``, ...), never the whole tree.

Relative paths in a YAML file are resolved against the directory of that file (not the current
working directory), so a config can be run from anywhere; ``load_config`` does this.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from omni_grpo.types import SamplingParams


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the file and the dotted field path."""


class _Strict(BaseModel):
    # ``.inf`` / ``.nan`` pass a ``gt=0`` bound (an infinite learning rate was accepted): no
    # setting of this tree means anything non-finite, so they are refused everywhere.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


def _non_empty_path(value: Any) -> Any:
    """``""`` would become ``Path(".")``: a run writing into the current directory, a dataset
    that is "the cwd". Refuse it instead of guessing."""
    if isinstance(value, str) and not value.strip():
        raise ValueError("empty path (give a directory or file, or leave the key out)")
    return value


def _non_empty_spec(value: Any) -> Any:
    if isinstance(value, list | tuple):
        for item in value:
            _non_empty_path(item)
        return value
    return _non_empty_path(value)


PathField = Annotated[Path, BeforeValidator(_non_empty_path)]
# A dataset: one path (file, glob, ``save_to_disk`` dir) or a list of them.
DatasetSpec = Annotated[Path | list[Path], BeforeValidator(_non_empty_spec)]

# A config key whose value must never be printed: the last segment of its dotted path matches.
SECRET_KEY = re.compile(
    r"(?i)(?:^|_)(?:api_?key|key|secret|secrets|password|passwd|pwd|token|auth|credentials?|bearer)$"
)
# The password of a URL's userinfo (``http://user:PASSWORD@host``): masked wherever a URL is shown.
URL_PASSWORD = re.compile(r"(?<=://)([^/@\s:'\"]+):([^/@\s'\"]+)@")


def is_secret_key(name: object) -> bool:
    """``SECRET_KEY`` on the name as snake case: ``apiKey``, ``hf-token`` and ``HF_TOKEN`` count
    as well as ``admin_api_key``."""
    text = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", str(name)).replace("-", "_")
    return bool(SECRET_KEY.search(text))


def mask_url_passwords(text: str) -> str:
    return URL_PASSWORD.sub(r"\1:<redacted>@", text)


def _registered(group: str, name: str, kind: str) -> str:
    """``name`` if an entry point of ``group`` carries it: engines and backends are plugins, so a
    third-party package can add one, and a typo fails at config time with the names that exist."""
    from omni_grpo.plugins import plugin_names

    names = plugin_names(group)
    if name not in names:
        raise ValueError(
            f"no {kind} named {name!r} in entry-point group {group!r} (available: {names})"
        )
    return name


# --------------------------------------------------------------------------------------------- run
class RunConfig(_Strict):
    dir: PathField = Path("runs/default")
    seed: int = 0
    steps: int = Field(100, ge=0)
    save_every: int = Field(50, ge=0, description="0 saves only at the end")
    log_every: int = Field(1, ge=1)
    tensorboard: bool = True
    wandb: bool = False
    plots: bool = True
    collapse_warn_steps: int = Field(
        20,
        ge=0,
        description="warn when a modality has had no group with reward variance (no GRPO signal) "
        "while unsolved for this many consecutive steps; 0 disables",
    )


# ------------------------------------------------------------------------------------------- model
class TinyModelConfig(_Strict):
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


class ModelConfig(_Strict):
    omni_checkpoint: PathField | None = None
    make_tiny: TinyModelConfig | None = None
    extracted_dir: PathField | None = Field(None, description="default <run.dir>/model/vl")
    audio_dir: PathField | None = Field(None, description="default <run.dir>/model/audio")
    dtype: Literal["float32", "bfloat16", "auto"] = "auto"
    freeze_visual: bool = True
    freeze_lm_head: bool = False


# -------------------------------------------------------------------------------------------- data
class SyntheticDataConfig(_Strict):
    tasks: list[Literal["image", "audio", "video"]] = Field(
        default_factory=lambda: ["image", "audio", "video"]
    )
    n_train: int = Field(256, ge=1)
    n_eval: int = Field(64, ge=1)
    seed: int | None = Field(None, description="default run.seed")


def default_media_root(spec: Any) -> Path:
    """The media root of a dataset spec when none is configured: the (first) file's directory
    (a glob's too), or the directory itself for a ``datasets.save_to_disk`` dir."""
    first = Path(os.fspath(spec[0] if isinstance(spec, list | tuple) and spec else spec))
    return first if first.is_dir() else first.parent


class DataConfig(_Strict):
    """Where the rows are and the explicit limits every media item is decoded under.

    ``train`` / ``eval``: a ``.jsonl`` file, a ``.parquet`` file, a glob or a list of them, or a
    ``datasets.save_to_disk`` directory (see ``omni_grpo.data.sources``). A bad row is skipped
    and counted (``data/skipped_rows``); only a split with no usable row is an error.
    """

    train: DatasetSpec | None = None
    eval: DatasetSpec | None = None
    root: PathField | None = Field(
        None,
        description="media root; media paths are confined to it (default: the train file's dir, "
        "or the dataset dir itself)",
    )
    columns: dict[str, str] = Field(
        default_factory=dict,
        description="our row field -> the source's column name, e.g. {label: answer, prompt: problem}",
    )
    video_fps: float = Field(2.0, gt=0)
    max_frames: int = Field(32, ge=2)
    image_min_pixels: int = Field(32 * 32, ge=32 * 32)
    image_max_pixels: int = Field(256 * 32 * 32, ge=32 * 32)
    video_max_pixels: int = Field(128 * 32 * 32, ge=32 * 32, description="per frame")
    max_source_pixels: int = Field(
        64_000_000,
        ge=32 * 32,
        le=2 * 89_478_485,
        description="largest image / video frame accepted, checked from the header before "
        "decoding (larger: skipped as too_large); replaces Pillow's decompression-bomb default "
        "and may not exceed Pillow's hard limit",
    )
    audio_max_seconds: float = Field(30.0, gt=0, description="longer audio is truncated")
    video_max_seconds: float = Field(
        600.0, gt=0, description="frames are sampled from the first this-many seconds"
    )
    shuffle: bool = True
    synthetic: SyntheticDataConfig | None = None

    @model_validator(mode="after")
    def _synthetic_or_files(self) -> DataConfig:
        """``data.synthetic`` writes the train/eval files itself: a ``train``/``eval`` given as
        well would be ignored without a word, so say which one wins instead."""
        given = [k for k in ("train", "eval") if getattr(self, k) is not None]
        if self.synthetic is not None and given:
            raise ValueError(
                f"data.synthetic generates the dataset, so data.{'/'.join(given)} would be "
                "ignored; set one or the other (data.synthetic: null to train on your files)"
            )
        return self

    @model_validator(mode="after")
    def _pixels_ordered(self) -> DataConfig:
        if self.image_min_pixels > self.image_max_pixels:
            raise ValueError(
                f"image_min_pixels ({self.image_min_pixels}) must be <= image_max_pixels ({self.image_max_pixels})"
            )
        return self

    def default_root(self) -> Path | None:
        """The media root when ``root`` is unset (see ``default_media_root``)."""
        return default_media_root(self.train) if self.train is not None else None

    @field_validator("columns")
    @classmethod
    def _known_fields(cls, v: dict[str, str]) -> dict[str, str]:
        if not v:
            return v
        from omni_grpo.data.schema import ROW_FIELDS

        unknown = sorted(set(v) - set(ROW_FIELDS))
        if unknown:
            raise ValueError(f"unknown row field(s) {unknown}; the fields are {list(ROW_FIELDS)}")
        return v


# ----------------------------------------------------------------------------------------- rollout
class SglangLaunchConfig(_Strict):
    """Servers the driver starts itself, each as a Ray actor running ``omni-grpo serve``.

    ``kind: fake`` starts the project's contract-faithful fake server (omni_rollout_client's
    testing fake) through the very same launcher code path; it exists for CPU tests only.
    """

    servers: int = Field(1, ge=1)
    gpus_per_server: int = Field(1, ge=0, description="0 only for kind: fake (CPU)")
    kind: Literal["sglang-omni", "fake"] = "sglang-omni"
    model_path: Path | None = Field(None, description="default: model.omni_checkpoint")
    extra_args: list[str] = Field(default_factory=list, description="appended to the server argv")
    ready_timeout_s: float = Field(900.0, gt=0, description="health wait deadline per server")
    cpus_per_server: float = Field(1.0, gt=0)

    @model_validator(mode="after")
    def _gpus_for_real_servers(self) -> SglangLaunchConfig:
        if self.kind == "sglang-omni" and self.gpus_per_server < 1:
            raise ValueError("gpus_per_server must be >= 1 for kind 'sglang-omni' (GPU only)")
        return self


class SglangOmniConfig(_Strict):
    urls: list[str] = Field(default_factory=list)
    router_url: str | None = None
    admin_api_key: SecretStr | None = None
    timeout_s: float = Field(300.0, gt=0)
    max_concurrency: int = Field(64, ge=1)
    bf16_payload: bool = True
    sync_mode: Literal["skip", "distributed", "disk"] = "disk"
    sync_dir: PathField | None = None
    bucket_mb: int = Field(512, ge=1)
    launch: SglangLaunchConfig | None = Field(
        None, description="start servers as Ray actors (their URLs join `urls`)"
    )


class EmbeddedRolloutConfig(_Strict):
    """The embedded engine as ``actors`` Ray rollout actors, each holding a policy copy that the
    driver refreshes after every step over a real process group (0 = in the trainer process)."""

    actors: int = Field(0, ge=0)
    cpus_per_actor: float = Field(0.5, gt=0)
    sync_backend: Literal["auto", "gloo", "nccl"] = "auto"


class RolloutConfig(_Strict):
    engine: str = Field(
        "embedded",
        description="a name in the omni_grpo.rollout_engines entry-point group "
        "(built in: embedded, sglang-omni)",
    )
    n_samples: int = Field(
        8, gt=1, description="group size; GRPO needs at least 2 samples per prompt"
    )
    prompts_per_step: int = Field(8, ge=1)
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    eval_sampling: SamplingParams = Field(default_factory=lambda: SamplingParams(temperature=0.0))
    sglang: SglangOmniConfig = Field(default_factory=SglangOmniConfig)
    embedded: EmbeddedRolloutConfig = Field(default_factory=EmbeddedRolloutConfig)
    max_staleness: Literal[0, 1] = Field(
        0,
        description="0: on-policy (rollout, then train, then sync); 1: the next step's rollouts "
        "are generated while this step trains, so a sample is at most one policy version old "
        "(omni_grpo.rollout.overlap; corrected by algo.tis)",
    )
    exact_logprobs: bool = Field(
        False,
        description="embedded engine, torch backend, CUDA, bf16: the rollout's and the trainer's "
        "logprob of every sampled token are bitwise equal (row-invariant kernels in both "
        "forwards, omni_grpo.exact; docs/exact-logprobs.md)",
    )

    @field_validator("engine")
    @classmethod
    def _registered_engine(cls, name: str) -> str:
        return _registered("omni_grpo.rollout_engines", name, "rollout engine")

    @model_validator(mode="after")
    def _sglang_needs_urls(self) -> RolloutConfig:
        if self.engine == "sglang-omni" and not (
            self.sglang.urls or self.sglang.router_url or self.sglang.launch
        ):
            raise ValueError(
                "engine 'sglang-omni' needs sglang.urls, sglang.router_url or sglang.launch"
            )
        return self


# -------------------------------------------------------------------------------------------- algo
class AdvantageConfig(_Strict):
    std_normalize: bool = Field(True, description="False = Dr.GRPO (mean-centred only)")
    eps: float = Field(1e-6, gt=0)


class TISConfig(_Strict):
    """Truncated importance sampling of the trainer's old logprobs against the rollout engine's."""

    enabled: bool = False
    clip_low: float = Field(0.0, ge=0)
    clip_high: float = Field(2.0, gt=0)
    mode: Literal["truncate", "icepop"] = "truncate"

    @model_validator(mode="after")
    def _ordered(self) -> TISConfig:
        if self.clip_low >= self.clip_high:
            raise ValueError(f"clip_low ({self.clip_low}) must be < clip_high ({self.clip_high})")
        return self


class AlgoConfig(_Strict):
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    clip_eps_low: float = Field(0.2, ge=0, lt=1)
    clip_eps_high: float = Field(0.28, ge=0)
    dual_clip_c: float | None = Field(
        None, gt=1, description="dual-clip constant c > 1; None disables"
    )
    kl_coef: float = Field(0.0, ge=0)
    kl_type: Literal["k1", "k2", "k3", "low_var_kl", "full"] = Field(
        "k1",
        description="k1/k2/k3/low_var_kl: estimators on the sampled tokens; full: the exact "
        "KL(ref || pi) over the vocabulary at each response position (the expectation of k3's "
        "gradient without its sampling variance; torch backend)",
    )
    kl_unbiased: bool = Field(
        False, description="multiply the KL term by the importance ratio exp(logp-old)"
    )
    entropy_coef: float = Field(0.0, ge=0)
    tis: TISConfig = Field(default_factory=TISConfig)
    loss_agg: Literal["token", "sequence"] = Field(
        "sequence",
        description="sequence: per-sample token mean, averaged over samples; token: global token mean",
    )
    use_rollout_logprobs: bool = Field(
        False, description="use rollout logprobs as old_logp (no trainer recompute)"
    )

    @model_validator(mode="after")
    def _exclusive(self) -> AlgoConfig:
        if self.use_rollout_logprobs and self.tis.enabled:
            raise ValueError(
                "use_rollout_logprobs and tis.enabled are mutually exclusive (TIS would be identically 1)"
            )
        if self.kl_unbiased and self.kl_type == "full":
            raise ValueError(
                "algo.kl_unbiased does not apply to kl_type full (an exact KL, not a sample estimate)"
            )
        return self


# ----------------------------------------------------------------------------------------- trainer
class WarmupConfig(_Strict):
    """Optional supervised format warm-up before GRPO (teaches the answer format)."""

    steps: int = Field(0, ge=0)
    lr: float = Field(1e-4, gt=0)


class LrScheduleConfig(_Strict):
    """The learning rate of GRPO step k (``omni_grpo.algo.schedule.lr_at``): a linear ramp over
    ``warmup_steps``, then ``constant`` at ``trainer.lr`` or a ``cosine`` / ``linear`` decay to
    ``min_lr_ratio * trainer.lr`` at ``run.steps``. A function of the step only, so a resumed run
    continues on the same curve. The supervised format warm-up keeps its own ``warmup.lr``."""

    kind: Literal["constant", "cosine", "linear"] = "constant"
    warmup_steps: int = Field(0, ge=0, description="GRPO steps of linear ramp from lr/warmup_steps")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="the decay's floor, times trainer.lr")


class MegatronConfig(_Strict):
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


class LoraConfig(_Strict):
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


class TrainerConfig(_Strict):
    backend: str = Field(
        "torch",
        description="a name in the omni_grpo.backends entry-point group (built in: torch, megatron)",
    )

    @field_validator("backend")
    @classmethod
    def _registered_backend(cls, name: str) -> str:
        return _registered("omni_grpo.backends", name, "trainer backend")

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


# --------------------------------------------------------------------------------------------- ray
class RayConfig(_Strict):
    """How the driver joins Ray when the run spans several processes (``omni_grpo.ray``)."""

    address: str | None = Field(
        None, description="cluster address; None = $RAY_ADDRESS, else a local Ray on this machine"
    )
    # A whole number: Ray hands it to the raylet as an int32 flag, and a float (YAML's `8` read
    # as 8.0 by a float field) made the raylet exit at once, 30 s before ray.init said only
    # "node timed out during startup" (seen on the H200 box). Actors take fractions below.
    num_cpus: int | None = Field(None, gt=0, description="local Ray only; None = all cores")
    cpus_per_trainer: float = Field(
        1.0, gt=0, description="fractions let several actors share a small machine"
    )
    gpus_per_node: int = Field(8, ge=1, description="for planning: where TP groups may go")
    start_timeout_s: float = Field(300.0, gt=0, description="placement and actor start-up")


# ----------------------------------------------------------------------------------- rewards, eval
class RewardsConfig(_Strict):
    """Which reward (entry-point name in ``omni_grpo.rewards``) scores rows that do not name one."""

    default: str = "mcq"
    by_modality: dict[str, str] = Field(
        default_factory=dict, description="e.g. {'video': 'answer_tag'}"
    )


AblationName = Literal["audio", "image", "video", "all"]


class EvalConfig(_Strict):
    """Held-out greedy evaluation, always reported per modality and overall."""

    every: int = Field(10, ge=0, description="0 disables periodic evaluation (the final one stays)")
    max_samples: int | None = Field(None, ge=1)
    ablations: list[AblationName] = Field(
        default_factory=list,
        description="also evaluate with this modality's media replaced by a neutral input of the "
        "same shape (silence, mid-grey frames): eval/ablated/<modality>/accuracy/*",
    )


# -------------------------------------------------------------------------------------------- root
class OmniGRPOConfig(_Strict):
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
    if cfg.rollout.sglang.launch is not None and cfg.rollout.engine != "sglang-omni":
        out.append(
            f"rollout.sglang.launch starts servers for rollout.engine sglang-omni, but the engine "
            f"is {cfg.rollout.engine!r}: they would never be used; remove it or change the engine"
        )
    return out


def exact_logprobs_refusals(cfg: OmniGRPOConfig) -> list[str]:
    """Where ``rollout.exact_logprobs`` cannot hold, one sentence each (empty when it is off).

    The bitwise equality needs the rollout and the trainer to run the same module with the same
    kernels: one process (the embedded engine sharing the torch backend's module). Ray rollout
    actors receive weights by sync, and with LoRA those are the merged ``W + scale B A``, whose
    products round differently from the trainer's unmerged path; trainer ranks on other
    processes hold their own copies. The device and dtype are checked again when the model is
    switched (``omni_grpo.exact.check_supported``), where ``auto`` has been resolved.
    """
    if not cfg.rollout.exact_logprobs:
        return []
    out = []
    where = "rollout.exact_logprobs"
    if cfg.rollout.engine != "embedded":
        out.append(f"{where} needs rollout.engine embedded (got {cfg.rollout.engine!r})")
    if cfg.trainer.backend != "torch":
        out.append(f"{where} needs trainer.backend torch (got {cfg.trainer.backend!r})")
    if cfg.rollout.embedded.actors:
        out.append(
            f"{where} needs the in-process embedded engine (rollout.embedded.actors 0, got "
            f"{cfg.rollout.embedded.actors}): rollout actors receive synced weights (merged "
            "W + BA with LoRA), which do not round like the trainer's forward"
        )
    if cfg.trainer.world_size > 1:
        out.append(f"{where} needs trainer.world_size 1 (got {cfg.trainer.world_size})")
    if cfg.trainer.device == "cpu":
        out.append(f"{where} needs a CUDA device (trainer.device is cpu)")
    if cfg.model.dtype == "float32":
        out.append(f"{where} needs model.dtype bfloat16 (got float32)")
    if getattr(cfg.trainer, "compile", False):
        out.append(
            f"{where} needs trainer.compile off: a compiled training forward fuses (and rounds) "
            "differently from the eager decode step"
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


# Fields that existed once and were removed: a config that still sets one gets this sentence
# instead of the generic "extra fields not permitted", so the user learns where the setting went.
REMOVED_FIELDS: dict[tuple[str, ...], str] = {
    ("run", "eval_every"): "run.eval_every was removed: eval.every is the one evaluation interval",
    ("trainer", "grad_accum"): "trainer.grad_accum was removed: a step always accumulates all of "
    "its micro-batches (trainer.micro_batch_size rows each) into one optimizer step",
    ("eval", "per_modality"): "eval.per_modality was removed: held-out accuracy is always "
    "reported per modality and overall (eval/accuracy/<modality>, eval/accuracy/all)",
}


def _refuse_removed(cfg_dict: dict[str, Any], source: str | None) -> None:
    for path, message in REMOVED_FIELDS.items():
        node: Any = cfg_dict
        for key in path[:-1]:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict) and path[-1] in node:
            raise ConfigError(f"{source}: {message}" if source else message)


# ------------------------------------------------------------------------------ loading, overrides
def _secret_values(raw: Any, secret: bool = False) -> Iterator[str]:
    """Every scalar stored under a secret-looking key anywhere in ``raw`` (also in lists), as
    text: what an error message must never contain, wherever the key was (mis)placed."""
    if isinstance(raw, dict):
        for key, value in raw.items():
            yield from _secret_values(value, secret or is_secret_key(key))
    elif isinstance(raw, list | tuple):
        for value in raw:
            yield from _secret_values(value, secret)
    elif secret and raw is not None and str(raw).strip():
        yield str(raw)


def redact(text: str, raw: Any = None) -> str:
    """``text`` with every secret value of ``raw`` (and of the admin-key environment) masked."""
    secrets = set(_secret_values(raw))
    env_key = os.environ.get("SGLANG_OMNI_ADMIN_KEY")
    if env_key:
        secrets.add(env_key)
    for value in sorted(secrets, key=len, reverse=True):
        text = text.replace(value, "<redacted>")
        text = text.replace(repr(value), "'<redacted>'")
    return mask_url_passwords(text)


def _looks_secret(loc: tuple[Any, ...], value: Any) -> bool:
    if any(is_secret_key(part) for part in loc):
        return True
    return any(True for _ in _secret_values(value, False)) or isinstance(value, dict | list)


def format_validation_error(
    err: ValidationError, source: str | None = None, raw: Any = None
) -> str:
    """One line: ``invalid config <source>: rollout.n_samples: Input should be greater than 1
    (got 1); ...``. The value is echoed only when it is a plain scalar of a non-secret key."""
    parts = []
    for e in err.errors():
        # union members add pydantic's own tags ("function-before[...]", "list[...]") to loc
        loc = [p for p in e["loc"] if not any(c in str(p) for c in "[(")]
        path = ".".join(str(p) for p in loc) or "<root>"
        got = e.get("input")
        hide = e["type"] == "missing" or _looks_secret(tuple(e["loc"]), got)
        got_s = "" if hide else f" (got {got!r})"
        parts.append(f"{path}: {e['msg']}{got_s}")
    head = f"invalid config {source}" if source else "invalid config"
    return redact(head + ": " + "; ".join(parts), raw)


def _parse_value(text: str) -> Any:
    """YAML-typed scalar/list/dict from an override (``8`` -> int, ``[1,2]`` -> list, ``null`` -> None)."""
    try:
        return yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        return text


def _model_for_path(path: list[str]) -> None:
    """Raise ConfigError unless the dotted path names a field of the tree (dict fields may go deeper)."""
    if tuple(path) in REMOVED_FIELDS:
        raise ConfigError(REMOVED_FIELDS[tuple(path)])
    model: Any = OmniGRPOConfig
    for i, key in enumerate(path):
        fields = getattr(model, "model_fields", None)
        if fields is None:
            return  # inside a free-form dict field: any key is allowed
        if key not in fields:
            known = ", ".join(sorted(fields))
            where = ".".join(path[: i + 1])
            raise ConfigError(f"unknown config key '{where}' (known at this level: {known})")
        model = _submodel(fields[key].annotation)


def _submodel(annotation: Any) -> Any:
    """The BaseModel class inside ``X | None`` style annotations, else None (leaf or dict)."""
    import typing

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


_SECRET_TEXT = re.compile(r"(?i)key|secret|passw|token|auth|credential|bearer")


def apply_overrides(
    cfg_dict: dict[str, Any], overrides: list[str] | tuple[str, ...]
) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides (YAML-typed values) to a raw config dict, returning a new dict.

    Unknown paths raise ConfigError naming the path, so a typo on the command line never silently
    does nothing. Validation of the values themselves happens when the tree is built.
    """
    import copy

    out = copy.deepcopy(cfg_dict)
    for item in overrides:
        if "=" not in item:
            shown = "<hidden: it may hold a secret>" if _SECRET_TEXT.search(item) else repr(item)
            raise ConfigError(f"override {shown} is not KEY=VALUE (e.g. rollout.n_samples=8)")
        key, raw = item.split("=", 1)
        path = [p for p in key.strip().split(".")]
        if not all(path):
            raise ConfigError(f"override {item!r} has an empty key segment")
        _model_for_path(path)
        node = out
        for p in path[:-1]:
            nxt = node.get(p)
            if not isinstance(nxt, dict):
                nxt = {}
                node[p] = nxt
            node = nxt
        node[path[-1]] = _parse_value(raw)
    return out


def _annotation_parts(annotation: Any) -> Iterator[Any]:
    """``annotation`` and everything nested in it (``Path | list[Path] | None`` -> Path, list, ...)."""
    yield annotation
    for arg in get_args(annotation):
        yield from _annotation_parts(arg)


def path_fields(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """Dotted paths of every field annotated with ``Path`` (alone, optional or in a list), found by
    walking the config models, so a new path field is resolved without being listed anywhere."""
    for name, info in model.model_fields.items():
        sub = _submodel(info.annotation)
        if sub is not None:
            yield from path_fields(sub, (*prefix, name))
        elif any(t is Path for t in _annotation_parts(info.annotation)):
            yield (*prefix, name)


# Fields holding paths, resolved relative to the config file's directory.
PATH_FIELDS: tuple[tuple[str, ...], ...] = tuple(path_fields(OmniGRPOConfig))


def _resolve_one(value: Any, base: Path) -> Any:
    if isinstance(value, list):
        return [_resolve_one(v, base) for v in value]
    if isinstance(value, str | os.PathLike) and str(value).strip() != "":
        p = Path(os.path.expanduser(str(value)))
        # normpath: `run.dir: ../runs/tiny` in examples/ is printed and stored as <repo>/runs/tiny,
        # not <repo>/examples/../runs/tiny (lexical, like the shell's `cd`; symlinks are kept)
        return os.path.normpath(p if p.is_absolute() else (base / p))
    return value


def _resolve_paths(cfg_dict: dict[str, Any], base: Path) -> None:
    """Resolve every path field (``PATH_FIELDS``) of a raw config dict against ``base``."""
    for path in PATH_FIELDS:
        node: Any = cfg_dict
        for p in path[:-1]:
            node = node.get(p) if isinstance(node, dict) else None
        if isinstance(node, dict) and path[-1] in node:
            node[path[-1]] = _resolve_one(node[path[-1]], base)


def build_config(cfg_dict: dict[str, Any], source: str | None = None) -> OmniGRPOConfig:
    """Validate a raw dict into the tree, converting pydantic errors into a readable ConfigError."""
    _refuse_removed(cfg_dict, source)
    try:
        return OmniGRPOConfig.model_validate(cfg_dict)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, source, cfg_dict)) from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """``SafeLoader`` that refuses a key given twice in one mapping: YAML keeps the last value
    silently, so the first one (e.g. an edited ``lr``) would be ignored without a word."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, str | int | float | bool) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _read_yaml(file: Path, chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The mapping in ``file`` with its relative paths resolved against its own directory.

    ``extends: other.yaml`` (relative to ``file``) starts from that file's tree and deep-merges
    this one over it, so a variant (``examples/tiny-ray.yaml``) says only what differs from its
    base and follows the base's recipe when that changes.
    """
    if not file.is_file():
        raise ConfigError(f"config file not found: {file}")
    try:
        loaded = yaml.load(file.read_text(), Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader
    except UnicodeDecodeError as err:
        raise ConfigError(f"{file}: not a UTF-8 text file (byte {err.start})") from None
    except yaml.YAMLError as err:
        # Only the problem and its position: YAML's own message quotes the offending line,
        # which may be the one holding the admin key.
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or type(err).__name__
        raise ConfigError(f"{file}: not valid YAML: {problem}{where}") from None
    if loaded is None:
        loaded = {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{file}: top level must be a mapping, got {type(loaded).__name__}")
    parent = loaded.pop("extends", None)
    _resolve_paths(loaded, file.resolve().parent)
    if parent is None:
        return loaded
    if not isinstance(parent, str):
        raise ConfigError(f"{file}: extends must be a file name, got {parent!r}")
    base_file = (file.resolve().parent / parent).resolve()
    if base_file in chain:
        raise ConfigError(f"{file}: extends {parent} makes a cycle")
    return _deep_merge(_read_yaml(base_file, (*chain, file.resolve())), loaded)


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(
    path: str | os.PathLike[str] | None, overrides: list[str] | tuple[str, ...] = ()
) -> OmniGRPOConfig:
    """Load a YAML config, apply dotted overrides, resolve relative paths against the file's dir.

    ``path=None`` starts from the defaults (overrides still apply; paths resolve against the cwd).
    A file may start from another with ``extends: base.yaml`` (see ``_read_yaml``).
    """
    raw: dict[str, Any] = {}
    base = Path.cwd()
    source = None
    if path is not None:
        file = Path(path)
        source = str(file)
        raw = _read_yaml(file)
        base = file.resolve().parent
    raw = apply_overrides(raw, overrides)
    _resolve_paths(raw, base)
    return build_config(raw, source)


def _missing_dataset(key: str, spec: Path | list[Path] | None) -> list[str]:
    """A dataset spec's entries that name nothing: a glob without a match, a missing path (a
    file is a jsonl/parquet file, a directory a ``save_to_disk`` dataset)."""
    import glob as globlib

    if spec is None:
        return []
    items = spec if isinstance(spec, list) else [spec]
    if not items:
        return [f"{key}: an empty list"]
    out = []
    for item in items:
        text = os.fspath(item)
        if globlib.has_magic(text):
            if not globlib.glob(text):
                out.append(f"{key}: no file matches {text}")
        elif not Path(text).exists():
            out.append(f"{key}: {text} does not exist")
    return out


def check_paths(cfg: OmniGRPOConfig) -> None:
    """Refuse, before anything runs, inputs that do not exist: ``data.train``/``eval``/``root``
    (unless ``data.synthetic`` makes them) and the Omni checkpoint (unless ``model.make_tiny``
    creates it). All problems in one ``ConfigError`` line, each naming its dotted key."""
    problems: list[str] = []
    data, model = cfg.data, cfg.model
    if data.synthetic is None:
        if data.train is None:
            problems.append("data.train is not set (and data.synthetic is not configured)")
        problems += _missing_dataset("data.train", data.train)
        problems += _missing_dataset("data.eval", data.eval)
        if data.columns and not problems:  # a renamed column a table lacks: before the model
            from omni_grpo.data.spec import check_columns

            found = [check_columns(s, data.columns) for s in (data.train, data.eval) if s]
            problems += list(dict.fromkeys(m for ms in found for m in ms))  # train = eval: once
        if data.root is not None and not data.root.is_dir():
            problems.append(f"data.root: {data.root} is not a directory")
    omni = model.omni_checkpoint or cfg.run.dir / "model" / "omni"
    if model.make_tiny is None and not (omni / "config.json").is_file():
        key = "model.omni_checkpoint" if model.omni_checkpoint else "model.omni_checkpoint (unset)"
        where = "does not exist" if not omni.exists() else "has no config.json"
        problems.append(
            f"{key}: {omni} {where} (point it at a Qwen3-Omni checkpoint, or set model.make_tiny)"
        )
    if cfg.run.dir.exists() and not cfg.run.dir.is_dir():
        problems.append(f"run.dir: {cfg.run.dir} is a file, not a directory")
    if problems:
        raise ConfigError("; ".join(problems))


def dump_config(cfg: OmniGRPOConfig) -> str:
    """YAML of the full resolved tree (secrets masked), for saving next to a run."""
    return mask_url_passwords(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))

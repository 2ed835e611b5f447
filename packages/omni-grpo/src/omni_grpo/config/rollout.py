"""``rollout:``: the engine that samples completions, its sampling and its servers or actors.

The sampling parameters are ``omni_grpo.types.SamplingParams``: the engines read the same type.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator

from omni_grpo.config.base import PathField, StrictModel, registered_name
from omni_grpo.types import SamplingParams


class SglangLaunchConfig(StrictModel):
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


class SglangOmniConfig(StrictModel):
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


class EmbeddedRolloutConfig(StrictModel):
    """The embedded engine as ``actors`` Ray rollout actors, each holding a policy copy that the
    driver refreshes after every step over a real process group (0 = in the trainer process)."""

    actors: int = Field(0, ge=0)
    cpus_per_actor: float = Field(0.5, gt=0)
    gpus_per_actor: float = Field(
        1.0,
        gt=0,
        le=1,
        description="GPU actors: a fraction lets the actors and the trainer ranks share one GPU "
        "(a one-GPU run of the scale path; the weight sync then takes gloo, as NCCL refuses two "
        "ranks of one group on one device)",
    )
    sync_backend: Literal["auto", "gloo", "nccl"] = "auto"
    extra_groups: int = Field(
        0,
        ge=0,
        description="partial rollouts (omni_grpo.rollout.partial): this many groups in flight "
        "beyond rollout.prompts_per_step; a step trains the first groups to end and the others "
        "continue next step (their earlier tokens are stale: rollout/stale_token_frac; use "
        "algo.tis). Needs the in-process engine with continuous batching",
    )
    batching: Literal["auto", "static", "continuous"] = Field(
        "auto",
        description="static: decode the step's batch until its last row ends; continuous: "
        "slots refilled as rows end and re-packed as they thin (models.continuous); auto: "
        "continuous on CUDA, static on the CPU",
    )
    memory_utilization: float = Field(
        0.85,
        gt=0,
        le=1,
        description="continuous batching: the share of the device's memory a rollout may fill, "
        "model and optimizer included (as vLLM's gpu_memory_utilization); the decode slots' KV "
        "takes what the rest leaves, and more rows than slots wait for a free one",
    )


class RolloutConfig(StrictModel):
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
    exact_logprobs: Literal["auto"] | bool = Field(
        "auto",
        description="embedded engine, torch backend, CUDA, bf16: the rollout's and the trainer's "
        "logprob of every sampled token are bitwise equal (row-invariant kernels in both "
        "forwards, omni_grpo.exact; docs/exact-logprobs.md). auto: on wherever it can hold "
        "(the run's first lines say whether it is on, and why not); true: refused where it "
        "cannot hold",
    )

    @field_validator("engine")
    @classmethod
    def _registered_engine(cls, name: str) -> str:
        return registered_name("omni_grpo.rollout_engines", name, "rollout engine")

    @model_validator(mode="after")
    def _sglang_needs_urls(self) -> RolloutConfig:
        if self.engine == "sglang-omni" and not (
            self.sglang.urls or self.sglang.router_url or self.sglang.launch
        ):
            raise ValueError(
                "engine 'sglang-omni' needs sglang.urls, sglang.router_url or sglang.launch"
            )
        return self

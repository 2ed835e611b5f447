"""The backend, the rollout engine and the weight sync of a run: built together, closed together.

In this process, or — when the plan spans several processes — Ray actors behind stand-ins with
the same interfaces (``omni_grpo.ray.driver``); the loop cannot tell the difference. This is the
one place where ``omni_grpo.backends``, ``omni_grpo.rollout`` and ``omni_grpo.sync`` meet.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from omni_grpo.backends import create_backend
from omni_grpo.models.sideband import media_token_ids
from omni_grpo.ray.placement import plan_run
from omni_grpo.rollout import IN_PROCESS, create_engine
from omni_grpo.rollout.overlap import PolicySnapshot
from omni_grpo.sglang import checkpoint_media_ids

if TYPE_CHECKING:
    from pathlib import Path

    from omni_grpo.config import OmniGRPOConfig
    from omni_grpo.ray.driver import RayRun
    from omni_grpo.types import RolloutEngine, TrainerBackend, WeightSync


@dataclass
class RunComponents:
    """What owns the weights and what samples from them.

    ``sync`` is None when the engine samples from the trainer's own module (the embedded engine
    in this process): nothing to push. ``ray_run`` is what a multi-process run has to tear down.
    """

    backend: TrainerBackend
    engine: RolloutEngine
    sync: WeightSync | None
    ray_run: RayRun | None = None
    # rollout.exact_logprobs as resolved for this run: on or off, and the sentence that says why
    exact: tuple[bool, str] = (False, "rollout.exact_logprobs: off")

    def push_weights(self, version: str) -> dict[str, float]:
        """New weights to an engine that holds its own copy (servers, rollout actors, the
        overlap's snapshot), named ``version``; returns the sync's metrics (none without one)."""
        if self.sync is None:
            return {}
        weights, layout = self.backend.weights_for_sync()
        return self.sync.push(weights, version=version, layout=layout).metrics()

    def close(self) -> None:
        """Sync, engine (remote engines hold HTTP connection pools), backend, then Ray."""
        if self.sync is not None:
            self.sync.close()
        self.engine.close()
        self.backend.close()
        if self.ray_run is not None:
            self.ray_run.close()


def resolve_exact(
    cfg: OmniGRPOConfig, policy: Any, *, distributed: bool = False
) -> tuple[bool, str]:
    """``rollout.exact_logprobs`` for this run: (on, the sentence the run's first lines say).

    ``true`` was checked against the settings when the config loaded; here the model's device,
    dtype and Triton are (a refusal raises), or, on the Ray scale path (``distributed``: no
    policy in this process), in every trainer rank and rollout actor as it starts. ``auto`` is
    on wherever nothing stands in the way and off, with every reason, elsewhere: overlapped
    rollouts (a sample one policy version old cannot equal the trainer's logprob), partial
    rollouts, and what ``config.exact_obstacles`` names (engine, backend, CPU, float32, ...).
    """
    from omni_grpo.config import exact_obstacles
    from omni_grpo.exact import ExactLogprobsUnsupported, check_supported

    setting = cfg.rollout.exact_logprobs
    if setting is False:
        return False, "rollout.exact_logprobs: off (false in the config)"
    reasons = [] if setting is True else exact_obstacles(cfg)
    if setting == "auto" and cfg.rollout.max_staleness:
        reasons.append("rollout.max_staleness 1 samples with weights one version old")
    elif setting == "auto" and cfg.rollout.embedded.extra_groups:
        reasons.append("rollout.embedded.extra_groups continues samples of earlier policies")
    if policy is None and not distributed and not reasons:  # no in-process policy
        reasons.append(f"trainer.backend {cfg.trainer.backend!r} has no in-process policy")
    if distributed and not reasons and plan_run(cfg).device != "GPU":  # trainer.device auto
        reasons.append("the trainer ranks would run on the CPU (no CUDA device here)")
    if not reasons and not distributed:
        try:
            check_supported(policy)
        except ExactLogprobsUnsupported as err:
            if setting is True:
                raise
            reasons.append(str(err).split(";")[0])
    if reasons and setting is True:
        raise ExactLogprobsUnsupported("rollout.exact_logprobs: true, but " + "; ".join(reasons))
    if reasons:
        return False, "rollout.exact_logprobs: off (auto): " + "; ".join(reasons)
    how = "auto" if setting == "auto" else "true"
    where = (
        " in every trainer rank and rollout actor (the sync keeps their weights bitwise equal)"
        if distributed
        else ""
    )
    return True, (
        f"rollout.exact_logprobs: on ({how}): every rollout logprob is computed by the "
        f"trainer's kernels, bit for bit{where}"
    )


def start_components(
    cfg: OmniGRPOConfig,
    run_dir: Path,
    vl_dir: Path,
    tokenizer: Any,
    eos_ids: list[int],
    pad_id: int,
) -> RunComponents:
    """Build the run's backend, engine and sync as ``cfg`` plans them (after seeding: model
    initialisation draws from the global RNGs)."""

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    # The checkpoint's own placeholder ids: a remote engine refuses audio-in-video prompts by them.
    media_ids = checkpoint_media_ids(vl_dir)
    if plan_run(cfg).distributed:
        from omni_grpo.ray.driver import start_ray_run

        # before any actor starts: an explicit true that cannot hold stops the run here; the
        # actors get the resolved switch (true or false) and check their device as they start
        exact = resolve_exact(cfg, None, distributed=True)
        rollout = cfg.rollout.model_copy(update={"exact_logprobs": exact[0]})
        ray_run = start_ray_run(
            cfg.model_copy(update={"rollout": rollout}),
            run_dir,
            pad_token_id=pad_id,
            eos_token_ids=eos_ids,
            decode_fn=decode,
            vocab_size=len(tokenizer),
            media_ids=media_ids,
        )
        return RunComponents(ray_run.backend, ray_run.engine, ray_run.sync, ray_run, exact)

    backend = create_backend(
        cfg.trainer.backend, cfg.model, cfg.trainer, cfg.algo, pad_token_id=pad_id
    )
    exact = resolve_exact(cfg, getattr(backend, "policy", None))
    if exact[0]:  # before any engine samples from the policy
        from omni_grpo.exact import enable_exact_logprobs

        enable_exact_logprobs(backend.policy)
        # samples (or their earlier tokens) one version old: inexact by construction
        if cfg.rollout.max_staleness or cfg.rollout.embedded.extra_groups:
            backend.exact_watch.enabled = False  # type: ignore[attr-defined]
    context: dict[str, Any] = dict(
        eos_token_ids=eos_ids,
        banned_token_ids=media_token_ids(backend.policy),
        decode_fn=decode,
        device=str(backend.device),
        vocab_size=len(tokenizer),
        media_ids=media_ids,
    )
    engine = create_engine(cfg.rollout, policy=backend.policy, **context)
    if cfg.rollout.engine not in IN_PROCESS:  # remote engines need new weights after each step
        from omni_grpo.sync import make_weight_sync

        sync = make_weight_sync(cfg.rollout.sglang, run_dir=run_dir)
        return RunComponents(backend, engine, sync, exact=exact)
    if cfg.rollout.max_staleness:
        # Sampling one step ahead needs weights the optimizer is not changing: a snapshot of the
        # policy, refreshed by the same push as any other engine (rollout/overlap.py).
        snapshot = PolicySnapshot(
            backend.policy,
            lambda module, version_fn: create_engine(
                cfg.rollout, policy=module, version_fn=version_fn, **context
            ),
        )
        return RunComponents(backend, snapshot, snapshot, exact=exact)
    return RunComponents(backend, engine, None, exact=exact)

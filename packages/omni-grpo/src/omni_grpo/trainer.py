"""The GRPO training loop. :func:`_train` is the step, one page; each phase is a method of
:class:`GRPORun` just below it:

    prepare (tiny checkpoint, extraction, synthetic data)  ->  backend + rollout engine
    [format warm-up]  ->  for each step:
        rollout -> score (rewards, advantages) -> update -> sync_weights -> metrics row
        -> maybe_eval -> log_step -> maybe_checkpoint
    -> final checkpoint, plots

Where the rest lives: the backend, engine and weight sync are built in
``omni_grpo.loop.components``; the step's rollouts, in the step or one step ahead
(``rollout.max_staleness: 1``), come from ``omni_grpo.loop.rollout_batches``; resuming, and the
metrics row of a step whose weight sync failed, are ``omni_grpo.run.resume``. The metrics row is
built in one place, :meth:`GRPORun.metrics_row`; the run's first log lines (what it does that the
config alone does not say) in one function, :func:`log_first_lines`.

Each component gets its own config sub-model. Everything random draws from python / numpy /
torch global RNGs seeded from ``run.seed`` and saved in every checkpoint, and the data order is a
pure function of (seed, epoch), so ``resume=True`` after a kill continues exactly as an
uninterrupted run would (identical ``metrics.jsonl`` lines, apart from ``time/*``).
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from omni_grpo.algo import group_advantages
from omni_grpo.algo.schedule import lr_at
from omni_grpo.loop.components import RunComponents, start_components
from omni_grpo.loop.data_order import EpochSampler, next_prompts
from omni_grpo.loop.rollout_batches import RolloutBatches

# re-exported: benchmarks, tests and omni_grpo.testing import it from here
from omni_grpo.models.sideband import media_token_ids as media_token_ids
from omni_grpo.ray.resources import check_local_resources
from omni_grpo.rewards import score_sample
from omni_grpo.rollout.overlap import staleness_metrics
from omni_grpo.run.checkpoint import TrainState, save_checkpoint
from omni_grpo.run.health import SignalWatch
from omni_grpo.run.lock import own_run_dir
from omni_grpo.run.metrics import MetricsLogger, read_metrics
from omni_grpo.run.plots import plot_run
from omni_grpo.run.process import configure_threads, seed_everything
from omni_grpo.run.progress import TrainProgress
from omni_grpo.run.resume import (
    ResumePoint,
    checkpoint_pending_row,
    complete_pending_row,
    resume_note,
    resume_point,
)
from omni_grpo.run.rundir import (
    check_resume,
    claim_run_dir,
    clean_stale_temps,
    config_fingerprint,
    run_temp_parents,
)
from omni_grpo.run.signals import find_interrupt, stop_on_signals
from omni_grpo.run.stored_config import store_run_config
from omni_grpo.types import Completion, GRPOBatch

if TYPE_CHECKING:
    from collections.abc import Callable

    from omni_grpo.config import DataConfig, ModelConfig, OmniGRPOConfig
    from omni_grpo.data.dataset import OmniDataset

log = logging.getLogger(__name__)
# TrainState.extra key: partial rollouts' groups in flight when the checkpoint was written
GROUPS_IN_FLIGHT = "partial_groups_in_flight"


# ---------------------------------------------------------------------------------------- train
@dataclass
class TrainResult:
    run_dir: Path
    steps: int
    final_eval: dict[str, float] = field(default_factory=dict)
    plots: list[Path] = field(default_factory=list)
    wall_s: float = 0.0


def train(
    cfg: OmniGRPOConfig,
    *,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    stop_after: int | None = None,
) -> TrainResult:
    """Run GRPO as configured. ``stop_after`` ends the run early after that step (as a kill would,
    but cleanly: used by the resume test); a later ``resume=True`` call continues to ``run.steps``.
    A ``run.dir`` holding another run needs ``resume`` or ``overwrite`` (``omni_grpo.run.rundir``).

    Before anything is made: the inputs exist, a multi-process layout fits the Ray it will start
    (``check_local_resources``), and this process owns ``run.dir`` (``omni_grpo.run.lock``: a
    second run into it is refused, naming this one's pid). SIGTERM / SIGINT raise
    :class:`~omni_grpo.run.signals.RunInterrupted` after everything is closed, saying where the
    run stopped and that ``--resume`` continues it."""
    t_start = time.perf_counter()
    from omni_grpo.config import check_paths

    check_paths(cfg)  # missing inputs fail here, in one line, before anything is made
    check_local_resources(cfg)
    run_dir = Path(cfg.run.dir)
    with stop_on_signals(), own_run_dir(run_dir):
        try:
            return _train(cfg, run_dir, t_start, resume, overwrite, progress, stop_after)
        except BaseException as exc:
            stop = find_interrupt(exc)  # also when it came back wrapped (a signal inside Ray)
            if stop is None:
                raise
            stop.where = resume_note(run_dir)
            raise stop from None


def _train(
    cfg: OmniGRPOConfig,
    run_dir: Path,
    t_start: float,
    resume: bool,
    overwrite: bool,
    progress: bool,
    stop_after: int | None,
) -> TrainResult:
    """The run itself, in a run directory this process owns (see :func:`train`)."""
    fingerprint = open_run_dir(cfg, run_dir, resume=resume, overwrite=overwrite)
    inputs = prepare_inputs(cfg, run_dir)  # model and data, made once per run directory
    # Seed only now: preparation may or may not run (it is skipped when its outputs exist) and
    # the checkpoint factory reseeds torch, so seeding earlier would make runs differ.
    seed_everything(cfg.run.seed)
    parts = start_components(
        cfg, run_dir, inputs.vl_dir, inputs.tokenizer, inputs.eos_ids, inputs.pad_id
    )
    log_first_lines(cfg, parts)
    point = resume_point(run_dir, parts.backend, parts.sync, resume=resume)
    point.state.extra["config"] = fingerprint  # stored in every checkpoint, checked on resume
    run = GRPORun.open(cfg, run_dir, inputs, parts, point)
    try:
        run.catch_up(point)  # a resumed run: the engine's weights, the reference, a pending row
        run.warm_up()  # once per run, before step 1
        end = cfg.run.steps if stop_after is None else min(cfg.run.steps, stop_after)
        with TrainProgress(cfg.run.steps, run.state.step, enabled=progress) as bar:
            for step in range(run.state.step + 1, end + 1):
                t0 = time.perf_counter()
                groups = run.rollout(more=step < end)
                t_rollout = time.perf_counter() - t0
                rewards, advantages = run.score(groups)
                t1 = time.perf_counter()
                update = run.update(step, groups, advantages)
                t_train = time.perf_counter() - t1
                row = run.metrics_row(step, groups, rewards, update, t_rollout, t_train)
                row.update(run.sync_weights(step, row, started=t0))
                evaluated = run.maybe_eval(step)
                row.update(evaluated)
                row["time/step_s"] = time.perf_counter() - t0
                run.state.step = step
                run.log_step(step, row, evaluated)
                bar.update(step, row)
                run.maybe_checkpoint(step, end)
    finally:
        run.close()
    done = run.state.step
    plots = plot_run(run_dir) if cfg.run.plots and done == cfg.run.steps else []
    return TrainResult(run_dir, done, run.last_eval, plots, time.perf_counter() - t_start)


@dataclass
class GRPORun:
    """The long-lived objects of one run, and the phases of its step as methods.

    ``parts`` owns the weights and the engine (``omni_grpo.loop.components``); ``batches`` draws
    the data and holds the overlap's batch in flight; ``state`` is what a checkpoint stores.
    """

    cfg: OmniGRPOConfig
    run_dir: Path
    inputs: RunInputs
    parts: RunComponents
    state: TrainState
    batches: RolloutBatches
    logger: MetricsLogger
    watch: SignalWatch
    last_eval: dict[str, float] = field(default_factory=dict)  # the newest evaluation
    dropped_groups: int = 0  # partial rollouts' groups a resume could not continue (logged once)

    @classmethod
    def open(
        cls,
        cfg: OmniGRPOConfig,
        run_dir: Path,
        inputs: RunInputs,
        parts: RunComponents,
        point: ResumePoint,
    ) -> GRPORun:
        """Data order from the resume point's cursor; the metrics file cut back to its step."""
        sampler = EpochSampler(
            len(inputs.train_set), cfg.run.seed, inputs.shuffle, point.state.cursor
        )
        logger = MetricsLogger(
            run_dir,
            tensorboard=cfg.run.tensorboard,
            wandb=cfg.run.wandb,
            wandb_config=cfg.model_dump(mode="json"),
            resume_step=point.state.step if point.checkpoint is not None else None,
        )
        watch = SignalWatch(cfg.run.collapse_warn_steps)
        if point.checkpoint is not None:
            watch.replay(read_metrics(run_dir))  # the logger kept exactly the checkpoint's steps
        batches = RolloutBatches(
            parts.engine,
            inputs.train_set,
            sampler,
            prompts_per_step=cfg.rollout.prompts_per_step,
            n_samples=cfg.rollout.n_samples,
            sampling=cfg.rollout.sampling,
            ahead=bool(cfg.rollout.max_staleness),
            extra_groups=cfg.rollout.embedded.extra_groups,
        )
        return cls(cfg, run_dir, inputs, parts, point.state, batches, logger, watch)

    # --- before step 1
    def catch_up(self, point: ResumePoint) -> None:
        """A resumed run: the engine gets the checkpoint's weights, the KL reference is the one
        saved after the warm-up, and a row left pending by a failed weight sync is written."""
        if point.checkpoint is None:
            return
        dropped = int(self.state.extra.pop(GROUPS_IN_FLIGHT, 0) or 0)
        if dropped:
            log.warning(
                "resume: %d groups of partial rollouts were in flight at the checkpoint and are "
                "not kept in it; their prompts are skipped (rollout/dropped_groups)",
                dropped,
            )
            self.dropped_groups = dropped
        pushed = self.parts.push_weights(f"step-{self.state.step}")
        if self.state.warmup_done:
            anchor_reference(self.parts.backend, self.run_dir, self.cfg.algo, save=False)
        self.last_eval = complete_pending_row(
            self.run_dir,
            point,
            pushed,
            maybe_eval=self.maybe_eval,
            log_step=self.log_step,
            watch=self.watch,
        )

    def warm_up(self) -> None:
        """``trainer.warmup``: the format warm-up and its step-0 row (held-out accuracy before
        and after); without one, a step-0 row with the untrained policy's accuracy."""
        warm, state = self.cfg.trainer.warmup, self.state
        if warm is not None and warm.steps > 0 and not state.warmup_done:
            pre = self.held_out_eval()
            losses = format_warmup(
                self.parts.backend,
                self.inputs.train_set,
                self.batches.sampler,
                self.inputs.tokenizer,
                self.inputs.eos_ids[0],
                warm.steps,
                warm.lr,
                self.cfg.rollout.prompts_per_step,
            )
            state.warmup_done = True
            anchor_reference(self.parts.backend, self.run_dir, self.cfg.algo, save=True)
            self.parts.push_weights("warmup")  # the engine samples (and evaluates) this policy
            row = {
                "warmup/nll_first": losses[0],
                "warmup/nll_last": losses[-1],
                **{f"pre_warmup/{k}": v for k, v in pre.items()},
                **self.held_out_eval(),
            }
            self.logger.log(0, row)
        elif state.step == 0 and not state.warmup_done:
            state.warmup_done = True
            if baseline := self.held_out_eval():  # no empty step-0 row when evaluation is off
                self.logger.log(0, baseline)

    # --- the step's phases, in order
    def rollout(self, *, more: bool) -> list[list[Completion]]:
        """data -> rollout: ``n_samples`` completions per prompt. ``more``: another step follows
        (with ``max_staleness: 1`` its batch is requested now, to generate during the update)."""
        return self.batches.take(more)

    def score(self, groups: list[list[Completion]]) -> tuple[torch.Tensor, torch.Tensor]:
        """rewards -> advantages, both ``[num_groups, n_samples]``."""
        rewards = score_groups(groups, self.cfg.rewards)
        advantages = group_advantages(
            rewards,
            self.cfg.rollout.n_samples,
            std_normalize=self.cfg.algo.advantage.std_normalize,
            eps=self.cfg.algo.advantage.eps,
        )
        return rewards, advantages

    def update(
        self, step: int, groups: list[list[Completion]], advantages: torch.Tensor
    ) -> dict[str, float]:
        """One GRPO update of the policy at the schedule's lr; returns the backend's metrics."""
        cfg = self.cfg
        lr = lr_at(step, cfg.run.steps, cfg.trainer.lr, cfg.trainer.lr_schedule)
        batch = GRPOBatch(groups, advantages, temperature=cfg.rollout.sampling.temperature, lr=lr)
        return self.parts.backend.step(batch)

    def metrics_row(
        self,
        step: int,
        groups: list[list[Completion]],
        rewards: torch.Tensor,
        update: dict[str, float],
        t_rollout: float,
        t_train: float,
    ) -> dict[str, Any]:
        """The step's metrics row: every field but those that need the new weights on the engine
        (the sync's numbers, the evaluation) and the step's total time, added after it.

        A new per-step metric goes here (or into :func:`rollout_metrics`, for one computed from
        the completions alone); the collapse watch sees everything added before it."""
        row: dict[str, Any] = dict(update)
        row.update(rollout_metrics(groups, rewards))
        if self.parts.sync is not None:  # engines with their own weights report their versions
            row.update(staleness_metrics(groups, step - 1, self.cfg.rollout.max_staleness))
        row.update(self.watch.update(step, row))
        row.update({"time/rollout_s": t_rollout, "time/train_s": t_train})
        if self.cfg.rollout.embedded.extra_groups:
            row["rollout/groups_in_flight"] = float(self.batches.groups_in_flight())
            row["rollout/dropped_groups"] = float(self.dropped_groups)
            self.dropped_groups = 0
        # generated tokens over the rollout phase's wall time, as this step waited for it
        tokens = sum(len(c.token_ids) for g in groups for c in g)
        row["time/generation_tokens_per_s"] = tokens / t_rollout if t_rollout > 0 else 0.0
        skipped = self.inputs.train_set.stats().items()
        row.update({f"data/{k}": float(v) for k, v in skipped if k.startswith("skipped")})
        return row

    def sync_weights(self, step: int, row: dict[str, Any], *, started: float) -> dict[str, float]:
        """The new weights to an engine with its own copy; returns the sync's metrics (none when
        the embedded engine shares the trainer's module).

        A failed sync (after its own retries) saves the step's checkpoint with ``row`` pending,
        then raises: the step is trained, and the resume pushes its weights and writes the row
        (``omni_grpo.run.resume``). A stop signal during the sync is not a failed sync."""
        try:
            return self.parts.push_weights(f"step-{step}")
        except Exception as err:
            if find_interrupt(err) is None:
                row["time/step_s"] = time.perf_counter() - started
                checkpoint_pending_row(self.state, step, row, self.checkpoint)
            raise

    def maybe_eval(self, step: int) -> dict[str, float]:
        """The held-out evaluation every ``eval.every`` steps and after the last one."""
        every = self.cfg.eval.every
        if not (every and step % every == 0 or step == self.cfg.run.steps):
            return {}
        self.last_eval = self.held_out_eval()
        return self.last_eval

    def log_step(self, step: int, row: dict[str, Any], evaluated: dict[str, float]) -> None:
        """Write the row every ``run.log_every`` steps, and whenever it holds an evaluation."""
        if step % self.cfg.run.log_every == 0 or evaluated:
            self.logger.log(step, row)

    def maybe_checkpoint(self, step: int, end: int) -> None:
        """A checkpoint every ``run.save_every`` steps and at the last step of this call."""
        every = self.cfg.run.save_every
        if every and step % every == 0 or step == end:
            self.checkpoint()

    # --- helpers of the phases
    def checkpoint(self) -> None:
        """Save ``state`` with the weights, the optimizer and (``trainer.lora``) the adapter."""
        # Not the sampler's cursor: a batch drawn ahead for the next step was not trained on yet.
        self.state.cursor = self.batches.trained_cursor
        self.state.extra[GROUPS_IN_FLIGHT] = self.batches.groups_in_flight()
        backend = self.parts.backend
        weights = backend.trainable_state()
        save_checkpoint(
            self.run_dir,
            self.state,
            weights,
            backend.optimizer_state(),
            extra=peft_files(self.cfg, weights),
        )

    def held_out_eval(self) -> dict[str, float]:
        """Greedy held-out accuracy, plain and per ablation (none without data or ``eval.every``)."""
        eval_set, cfg = self.inputs.eval_set, self.cfg
        if eval_set is None or cfg.eval.every == 0:
            return {}
        engine = self.parts.engine
        args = (cfg.rollout.eval_sampling, cfg.rewards, cfg.eval.max_samples)
        return {
            **evaluate(engine, eval_set, *args),
            **evaluate_ablated(engine, eval_set, cfg.eval.ablations, *args),
        }

    def close(self) -> None:
        """The overlap's thread, the metrics files, then the sync, engine, backend and Ray."""
        self.batches.close()
        self.logger.close()
        self.parts.close()


def peft_files(
    cfg: OmniGRPOConfig, weights: dict[str, torch.Tensor]
) -> Callable[[Path], None] | None:
    """``trainer.lora``: the adapter also in peft's own format, inside the same checkpoint."""
    lora = cfg.trainer.lora
    if lora is None:
        return None
    from omni_grpo.models.lora import save_peft_adapter

    base = str(cfg.model.extracted_dir)
    return lambda d: save_peft_adapter(d, weights, lora, base)


# ----------------------------------------------------------------------------------- preparation
def open_run_dir(
    cfg: OmniGRPOConfig, run_dir: Path, *, resume: bool, overwrite: bool
) -> dict[str, Any]:
    """Claim ``run_dir`` for this run (a resume only under the settings it was saved with), clear
    what killed writers left, store the config; returns the config's fingerprint."""
    fingerprint = config_fingerprint(cfg)
    claim_run_dir(run_dir, resume=resume, overwrite=overwrite)
    if resume:
        check_resume(run_dir, fingerprint)
    run_dir.mkdir(parents=True, exist_ok=True)
    clean_stale_temps(run_temp_parents(cfg, run_dir))
    store_run_config(cfg, run_dir)  # export and humans read the run's base and settings from it
    configure_threads(cfg.trainer.device)
    return fingerprint


@dataclass
class RunInputs:
    """The prepared model directory, its tokenizer and the datasets built from it."""

    vl_dir: Path
    tokenizer: Any
    train_set: OmniDataset
    eval_set: OmniDataset | None
    shuffle: bool  # data.shuffle
    eos_ids: list[int]  # the first one ends the warm-up's targets
    pad_id: int


def prepare_inputs(cfg: OmniGRPOConfig, run_dir: Path) -> RunInputs:
    """The model's ``vl`` directory and the datasets, made first when they do not exist yet."""
    vl_dir, _audio_dir = prepare_model(cfg.model, run_dir)
    data_cfg = prepare_data(cfg.data, run_dir)
    from omni_grpo.data.dataset import OmniDataset
    from omni_grpo.data.prompt import PromptBuilder

    builder = PromptBuilder(vl_dir, data_cfg)
    tokenizer = builder.tokenizer
    train_set = OmniDataset(data_cfg.train, data_cfg.root, builder)
    eval_set = OmniDataset(data_cfg.eval, data_cfg.root, builder) if data_cfg.eval else None
    eos_ids = end_of_turn_ids(vl_dir, tokenizer)
    pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0])
    return RunInputs(vl_dir, tokenizer, train_set, eval_set, data_cfg.shuffle, eos_ids, pad_id)


def log_first_lines(cfg: OmniGRPOConfig, parts: RunComponents) -> None:
    """The run's opening statements: what it does that the config alone does not make plain.
    A new one (a setting's consequence worth a line before step 1) goes here."""
    overlap = bool(cfg.rollout.max_staleness)
    log.info(parts.exact[1])
    if parts.exact[0] and overlap:
        log.info(
            "rollout.exact_logprobs with rollout.max_staleness 1: samples are one policy "
            "version old, so train_rollout_logprob_exact_fraction measures the staleness"
        )
    if cfg.rollout.embedded.extra_groups and not cfg.algo.tis.enabled:
        log.warning(
            "rollout.embedded.extra_groups without algo.tis: tokens drawn by earlier policies "
            "are trained with no importance correction (rollout/stale_token_frac says how many)"
        )
    if overlap and not (cfg.algo.tis.enabled or cfg.algo.use_rollout_logprobs):
        log.warning(
            "rollout.max_staleness 1 without algo.tis: samples one version old are trained "
            "with no importance correction (see the README's 'Overlapped rollouts')"
        )


def prepare_model(model: ModelConfig, run_dir: Path) -> tuple[Path, Path]:
    """Make the tiny Omni checkpoint if asked and extract its ``vl`` and ``audio`` parts once.

    Returns (vl dir, audio dir). Each output is produced atomically by its own tool, so a killed
    preparation is simply redone.
    """
    omni = Path(model.omni_checkpoint) if model.omni_checkpoint else run_dir / "model" / "omni"
    if model.extracted() and not (omni / "config.json").is_file():
        return Path(model.extracted_dir), Path(model.audio_dir)  # the parts are all it needs
    if not (omni / "config.json").is_file():
        if model.make_tiny is None:
            raise FileNotFoundError(
                f"model.omni_checkpoint {omni} has no config.json (set model.make_tiny to create a tiny one)"
            )
        from omni_extract.tiny import TinyOmniSpec, make_tiny_omni

        sizes = model.make_tiny.sizes
        spec = TinyOmniSpec(
            vocab=model.make_tiny.vocab,
            # None = "follow run.seed"; a ModelConfig used on its own has no run, so run.seed's default.
            seed=0 if model.make_tiny.seed is None else model.make_tiny.seed,
            text=dict(sizes.get("text", {})),
            vision=dict(sizes.get("vision", {})),
            audio=dict(sizes.get("audio", {})),
            with_talker=False,
        )
        make_tiny_omni(omni, spec)
    vl_dir = Path(model.extracted_dir)
    audio_dir = Path(model.audio_dir)
    from omni_extract.convert import extract

    for variant, dst in (("vl", vl_dir), ("audio", audio_dir)):
        if not (dst / "config.json").is_file():
            extract(omni, dst, variant=variant, overwrite=dst.exists())
    return vl_dir, audio_dir


def prepare_data(data: DataConfig, run_dir: Path) -> DataConfig:
    """Generate the synthetic dataset when configured; return the data config pointing at it."""
    if data.synthetic is None:
        if data.train is None:
            raise ValueError("data.train is not set and data.synthetic is not configured")
        return data
    from omni_grpo.data.synthetic import generate_synthetic

    syn = data.synthetic
    train, evaluation = generate_synthetic(
        run_dir / "data", syn.tasks, syn.n_train, syn.n_eval, 0 if syn.seed is None else syn.seed
    )
    return data.model_copy(update={"train": train, "eval": evaluation, "root": train.parent})


def end_of_turn_ids(model_dir: Path, tokenizer: Any) -> list[int]:
    """Ids that end a completion: ``eos_token_id`` of the model's generation config (the
    checkpoint's own choice, int or list), else the tokenizer's EOS. The first one is the
    end-of-turn token the format warm-up appends."""
    path = Path(model_dir) / "generation_config.json"
    eos: Any = None
    if path.is_file():
        eos = json.loads(path.read_text()).get("eos_token_id")
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError(f"{path}: no eos_token_id, and the tokenizer has no EOS token either")
    return [int(x) for x in (eos if isinstance(eos, list) else [eos])]


# ---------------------------------------------------------------------------------- rewards, eval
def score_groups(groups: list[list[Completion]], rewards_cfg: Any) -> torch.Tensor:
    """Reward of every completion, ``[num_groups, n]`` (also stored on each Completion)."""
    out = torch.zeros(len(groups), len(groups[0]) if groups else 0)
    for g, group in enumerate(groups):
        for i, c in enumerate(group):
            c.reward = float(score_sample(c.prompt.sample, c.text, rewards_cfg))
            out[g, i] = c.reward
    return out


EVAL_CHUNK = 32


def evaluate(
    engine: Any, dataset: OmniDataset, sampling: Any, rewards_cfg: Any, max_samples: int | None
) -> dict[str, float]:
    """Held-out accuracy (mean reward of one greedy completion) per modality and overall.

    Prompts go to the engine ``EVAL_CHUNK`` at a time: a remote engine or rollout actors work on
    them concurrently, and the in-process engine generates them one after another as before.
    """
    per: dict[str, list[float]] = defaultdict(list)
    n = len(dataset) if max_samples is None else min(max_samples, len(dataset))
    for start in range(0, n, EVAL_CHUNK):
        rows = (dataset.load(i) for i in range(start, min(n, start + EVAL_CHUNK)))
        prompts = [p for p in rows if p is not None]
        if not prompts:
            continue
        for prompt, (completion,) in zip(
            prompts, engine.generate(prompts, 1, sampling), strict=True
        ):
            reward = float(score_sample(prompt.sample, completion.text, rewards_cfg))
            per[prompt.sample.modality].append(reward)
    out = {f"eval/accuracy/{m}": float(np.mean(v)) for m, v in sorted(per.items())}
    if per:
        out["eval/accuracy/all"] = float(np.mean([x for v in per.values() for x in v]))
    return out


def evaluate_ablated(
    engine: Any,
    dataset: OmniDataset,
    ablations: list[str],
    sampling: Any,
    rewards_cfg: Any,
    max_samples: int | None,
) -> dict[str, float]:
    """The held-out evaluation again per ablation, with that modality's media replaced by a
    neutral input of the same shape (``omni_grpo.data.ablation``): ``eval/ablated/<name>/...``.

    A task that really uses its modality falls to chance when it is ablated and does not move
    when another one is; anything else is a shortcut through the text or another medium.
    """
    out: dict[str, float] = {}
    for name in ablations:
        result = evaluate(engine, dataset.ablated(name), sampling, rewards_cfg, max_samples)
        out.update({f"eval/ablated/{name}/{k[len('eval/') :]}": v for k, v in result.items()})
    return out


def rollout_metrics(groups: list[list[Completion]], rewards: torch.Tensor) -> dict[str, float]:
    """Reward statistics (overall and per modality), lengths, how many groups carry signal and
    the policy's entropy per modality.

    ``entropy/<modality>`` is the sampled-token estimate ``-mean(logprob)`` over the completions'
    tokens under the rollout sampling distribution (no extra forward, and it is what the engine
    actually sampled from); it falls towards 0 as a modality's policy turns deterministic, which
    is what precedes a zero-variance collapse. ``zero_variance_frac/<modality>`` is the share of
    its groups whose rewards are all equal (``1 - signal``): no advantage, no gradient.
    """
    lengths = [len(c.token_ids) for g in groups for c in g]
    has_groups = rewards.shape[1] > 1
    varied = rewards.std(dim=1) > 0 if has_groups else torch.zeros(len(groups), dtype=torch.bool)
    out: dict[str, float] = {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        "groups_with_signal": float(varied.float().mean()) if has_groups else 0.0,
        "zero_variance_frac": float(1.0 - varied.float().mean()) if has_groups else 1.0,
        "completion_len_mean": float(np.mean(lengths)),
        **{f"completion_len_p{q}": float(np.percentile(lengths, q)) for q in (50, 90, 99)},
        "completion_len_max": float(np.max(lengths)),
        "truncated_frac": float(np.mean([c.finish_reason == "length" for g in groups for c in g])),
        # partial rollouts: tokens drawn by an earlier policy, and the samples that hold some
        "rollout/stale_token_frac": sum(c.stale_tokens for g in groups for c in g)
        / max(1, sum(lengths)),
        "rollout/resumed_sample_frac": float(
            np.mean([c.stale_tokens > 0 for g in groups for c in g])
        ),
    }
    per: dict[str, list[float]] = defaultdict(list)
    signal: dict[str, list[float]] = defaultdict(list)
    logps: dict[str, list[float]] = defaultdict(list)
    for g, group in enumerate(groups):
        modality = group[0].prompt.sample.modality
        per[modality].extend(rewards[g].tolist())
        signal[modality].append(float(varied[g]))
        logps[modality].extend(lp for c in group for lp in c.logprobs)
    for modality, values in sorted(per.items()):
        out[f"reward/{modality}"] = float(np.mean(values))
        # groups whose rewards differ: the only ones GRPO learns from (0 = collapsed on this task)
        out[f"signal/{modality}"] = float(np.mean(signal[modality]))
        out[f"zero_variance_frac/{modality}"] = 1.0 - out[f"signal/{modality}"]
        if logps[modality]:
            out[f"entropy/{modality}"] = float(-np.mean(logps[modality]))
    return out


# ------------------------------------------------------------------------------------- warm-up
def format_warmup(
    backend: Any,
    dataset: OmniDataset,
    sampler: EpochSampler,
    tokenizer: Any,
    eos_id: int,
    steps: int,
    lr: float,
    prompts_per_step: int,
) -> list[float]:
    """Teach the answer FORMAT, not the task: supervised steps whose target is a uniformly random
    valid option letter (drawn from python's RNG, independent of the label) followed by EOS.

    Afterwards the policy answers with a parseable letter but, having seen random targets, is at
    chance on every task; only GRPO can make it better.
    """
    losses = []
    for _ in range(steps):
        prompts = next_prompts(dataset, sampler, prompts_per_step)
        targets = []
        for p in prompts:
            n_choices = len(p.sample.choices) if p.sample.choices else 4
            letter = "ABCDEFGHIJ"[random.randrange(n_choices)]
            targets.append(tokenizer.encode(letter, add_special_tokens=False) + [eos_id])
        losses.append(backend.supervised_step(prompts, targets, lr))
    return losses


REFERENCE_FILE = Path("reference") / "trainable.pt"


def anchor_reference(backend: Any, run_dir: Path, algo: Any, *, save: bool) -> None:
    """With a KL term, the reference is the policy right after the format warm-up (the SFT
    stage, as in RLHF), not the untrained model: KL to it keeps the answer format and, being a
    forward KL to a near-uniform choice of letters, pulls a policy that turns deterministic
    without signal back towards exploring (k3's gradient is that of KL(ref || policy)).

    ``save=True`` (just after the warm-up) stores its trainable weights in the run directory;
    a resumed run (``save=False``) reloads them, so it continues against the same reference.
    """
    set_reference = getattr(backend, "set_reference", None)
    if algo.kl_coef == 0 or set_reference is None:
        return
    path = run_dir / REFERENCE_FILE
    if save:
        weights = backend.trainable_state()
        if getattr(backend, "is_driver", True):  # one writer; every rank holds the same weights
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            torch.save(weights, tmp)
            os.replace(tmp, path)
        set_reference(weights)
        return
    if not path.is_file():
        log.warning("%s is missing: the KL reference stays the untrained model", path)
        return
    set_reference(torch.load(path, weights_only=True))

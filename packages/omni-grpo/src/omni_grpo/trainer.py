"""The GRPO training loop, top to bottom in one file.

    prepare (tiny checkpoint, extraction, synthetic data)  ->  backend + rollout engine
    [format warm-up]  ->  for each step:
        data -> rollout -> rewards -> advantages -> backend.step -> weight sync -> metrics/eval/checkpoint
    -> final checkpoint, plots

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
from omni_grpo.backends import create_backend
from omni_grpo.models.sideband import media_token_ids
from omni_grpo.ray.placement import plan_run
from omni_grpo.ray.resources import check_local_resources
from omni_grpo.rewards import score_sample
from omni_grpo.rollout import IN_PROCESS, create_engine
from omni_grpo.rollout.overlap import AheadEngine, PolicySnapshot, staleness_metrics
from omni_grpo.run.checkpoint import (
    DataCursor,
    TrainState,
    latest_checkpoint,
    load_checkpoint,
    restore_rng,
    save_checkpoint,
)
from omni_grpo.run.health import SignalWatch
from omni_grpo.run.lock import own_run_dir
from omni_grpo.run.metrics import MetricsLogger, read_metrics
from omni_grpo.run.plots import plot_run
from omni_grpo.run.process import configure_threads, seed_everything
from omni_grpo.run.progress import TrainProgress
from omni_grpo.run.rundir import (
    check_resume,
    claim_run_dir,
    clean_stale_temps,
    config_fingerprint,
    run_temp_parents,
)
from omni_grpo.run.signals import find_interrupt, stop_on_signals
from omni_grpo.run.stored_config import store_run_config
from omni_grpo.sglang import checkpoint_media_ids
from omni_grpo.types import Completion, GRPOBatch, PromptInputs, TrainerBackend

if TYPE_CHECKING:
    from collections.abc import Callable

    from omni_grpo.config import DataConfig, ModelConfig, OmniGRPOConfig
    from omni_grpo.data.dataset import OmniDataset

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------- preparation
def prepare_model(model: ModelConfig, run_dir: Path) -> tuple[Path, Path]:
    """Make the tiny Omni checkpoint if asked and extract its ``vl`` and ``audio`` parts once.

    Returns (vl dir, audio dir). Each output is produced atomically by its own tool, so a killed
    preparation is simply redone.
    """
    omni = Path(model.omni_checkpoint) if model.omni_checkpoint else run_dir / "model" / "omni"
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


# ------------------------------------------------------------------------------------ data order
class EpochSampler:
    """Indices in a fresh permutation per epoch; the permutation of epoch ``e`` depends only on
    (seed, e), so the cursor (epoch, position) is all a checkpoint needs to store."""

    def __init__(
        self, size: int, seed: int, shuffle: bool = True, cursor: DataCursor | None = None
    ) -> None:
        if size == 0:
            raise ValueError("the training dataset is empty")
        self.size = size
        self.seed = seed
        self.shuffle = shuffle
        self.cursor = cursor or DataCursor()

    def order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.size)
        return np.random.default_rng([self.seed, epoch]).permutation(self.size)

    def next(self) -> int:
        if self.cursor.position >= self.size:
            self.cursor = DataCursor(self.cursor.epoch + 1, 0)
        index = int(self.order(self.cursor.epoch)[self.cursor.position])
        self.cursor = DataCursor(self.cursor.epoch, self.cursor.position + 1)
        return index


def next_prompts(dataset: OmniDataset, sampler: EpochSampler, count: int) -> list[PromptInputs]:
    """``count`` loadable prompts; unreadable rows are skipped and counted by the dataset."""
    prompts: list[PromptInputs] = []
    tries = 0
    while len(prompts) < count:
        item = dataset.load(sampler.next())
        tries += 1
        if item is not None:
            prompts.append(item)
        elif tries > 10 * max(count, len(dataset)):
            raise RuntimeError(f"no loadable rows in the training set ({dataset.stats()})")
    return prompts


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


# ---------------------------------------------------------------------------------------- train
# state.extra key of a checkpoint saved because the step's weight sync failed: that step's
# metrics row, which the resume completes and writes (the step is not trained again).
PENDING_ROW = "pending_metrics_row"


def plain(metrics: dict[str, Any]) -> dict[str, Any]:
    """``metrics`` with JSON-native values (numpy and torch scalars become floats)."""
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        if isinstance(value, bool | int | float | str) or value is None:
            out[key] = value
        else:
            try:
                out[key] = float(value)
            except (TypeError, ValueError):
                out[key] = str(value)
    return out


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


def resume_note(run_dir: Path) -> str:
    """Where an interrupted run stands: the last step logged, what ``--resume`` continues from."""
    steps = [r["step"] for r in read_metrics(run_dir)]
    done = f" after step {steps[-1]}" if steps else ""
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        return f"{done}; {run_dir} holds no checkpoint yet: --resume starts it again from step 1"
    return f"{done}; rerun with --resume to continue {run_dir} from {ckpt.name}"


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
    fingerprint = config_fingerprint(cfg)
    claim_run_dir(run_dir, resume=resume, overwrite=overwrite)
    if resume:
        check_resume(run_dir, fingerprint)
    run_dir.mkdir(parents=True, exist_ok=True)
    clean_stale_temps(run_temp_parents(cfg, run_dir))
    store_run_config(cfg, run_dir)  # export and humans read the run's base and settings from it
    configure_threads()

    # --- model and data, made once per run directory
    vl_dir, _audio_dir = prepare_model(cfg.model, run_dir)
    data_cfg = prepare_data(cfg.data, run_dir)
    from omni_grpo.data.dataset import OmniDataset
    from omni_grpo.data.prompt import PromptBuilder

    builder = PromptBuilder(vl_dir, data_cfg)
    tokenizer = builder.tokenizer
    train_set = OmniDataset(data_cfg.train, data_cfg.root, builder)
    eval_set = OmniDataset(data_cfg.eval, data_cfg.root, builder) if data_cfg.eval else None
    eos_ids = end_of_turn_ids(vl_dir, tokenizer)
    eos_id = eos_ids[0]
    pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id)

    # Seed only now: preparation may or may not run (it is skipped when its outputs exist) and
    # the checkpoint factory reseeds torch, so seeding earlier would make runs differ.
    seed_everything(cfg.run.seed)

    # --- backend (owns the weights), rollout engine and weight sync: in this process, or, when
    # the plan spans several processes, Ray actors behind stand-ins with the same interfaces
    # (omni_grpo.ray.driver); nothing below this block can tell the difference.
    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    # The checkpoint's own placeholder ids: a remote engine refuses audio-in-video prompts by them.
    media_ids = checkpoint_media_ids(vl_dir)
    backend: TrainerBackend
    ray_run = None
    if plan_run(cfg).distributed:
        from omni_grpo.ray.driver import start_ray_run

        ray_run = start_ray_run(
            cfg,
            run_dir,
            pad_token_id=pad_id,
            eos_token_ids=eos_ids,
            decode_fn=decode,
            vocab_size=len(tokenizer),
            media_ids=media_ids,
        )
        backend, engine, sync = ray_run.backend, ray_run.engine, ray_run.sync
    else:
        backend = create_backend(
            cfg.trainer.backend, cfg.model, cfg.trainer, cfg.algo, pad_token_id=pad_id
        )
        if cfg.rollout.exact_logprobs:  # before any engine samples from the policy
            from omni_grpo.exact import enable_exact_logprobs

            enable_exact_logprobs(backend.policy)
            if cfg.rollout.max_staleness:
                backend.exact_watch.enabled = False  # type: ignore[attr-defined]
                log.info(
                    "rollout.exact_logprobs with rollout.max_staleness 1: samples are one policy "
                    "version old, so train_rollout_logprob_exact_fraction measures the staleness"
                )
        context: dict[str, Any] = dict(
            eos_token_ids=eos_ids,
            banned_token_ids=media_token_ids(backend.policy),
            decode_fn=decode,
            device=str(backend.device),
            vocab_size=len(tokenizer),
            media_ids=media_ids,
        )
        engine = create_engine(cfg.rollout, policy=backend.policy, **context)
        sync = None
        if cfg.rollout.engine not in IN_PROCESS:  # remote engines need new weights after each step
            from omni_grpo.sync import make_weight_sync

            sync = make_weight_sync(cfg.rollout.sglang, run_dir=run_dir)
        elif cfg.rollout.max_staleness:
            # Sampling one step ahead needs weights the optimizer is not changing: a snapshot of
            # the policy, refreshed by the same push as any other engine (rollout/overlap.py).
            engine = sync = PolicySnapshot(
                backend.policy,
                lambda module, version_fn: create_engine(
                    cfg.rollout, policy=module, version_fn=version_fn, **context
                ),
            )
    sampling, eval_sampling = cfg.rollout.sampling, cfg.rollout.eval_sampling
    # rollout.max_staleness 1: step k+1's rollouts are generated while step k trains.
    ahead = AheadEngine(engine) if cfg.rollout.max_staleness else None
    if ahead is not None and not (cfg.algo.tis.enabled or cfg.algo.use_rollout_logprobs):
        log.warning(
            "rollout.max_staleness 1 without algo.tis: samples one version old are trained "
            "with no importance correction (see the README's 'Overlapped rollouts')"
        )

    # --- resume
    state = TrainState()
    ckpt = latest_checkpoint(run_dir) if resume else None
    pending: dict[str, Any] | None = None  # the row of a step stopped by its weight sync
    if ckpt is not None:
        state, weights, optim_state, rng = load_checkpoint(ckpt)
        pending = state.extra.pop(PENDING_ROW, None)
        backend.load_trainable_state(weights)
        backend.load_optimizer_state(optim_state)
        restore_rng(rng)
        log.info("resumed from %s (step %d)", ckpt, state.step)
        if sync is not None and state.step > 0:
            # The servers may hold older weights (a run stopped by a failed sync saves first).
            weights, layout = backend.weights_for_sync()
            sync.push(weights, version=f"step-{state.step}", layout=layout)
    elif resume:
        log.warning(
            "resume requested but %s has no checkpoint; starting from scratch",
            run_dir / "checkpoints",
        )
    state.extra["config"] = fingerprint  # stored in every checkpoint, checked on resume
    sampler = EpochSampler(len(train_set), cfg.run.seed, data_cfg.shuffle, state.cursor)
    logger = MetricsLogger(
        run_dir,
        tensorboard=cfg.run.tensorboard,
        wandb=cfg.run.wandb,
        wandb_config=cfg.model_dump(mode="json"),
        resume_step=state.step if ckpt is not None else None,
    )

    def checkpoint() -> None:
        # Not sampler.cursor: a batch drawn ahead for the next step was not trained on yet.
        state.cursor = trained_cursor
        weights = backend.trainable_state()
        save_checkpoint(
            run_dir, state, weights, backend.optimizer_state(), extra=peft_files(weights)
        )

    def peft_files(weights: dict[str, torch.Tensor]) -> Callable[[Path], None] | None:
        """trainer.lora: the adapter also in peft's own format, inside the same checkpoint."""
        lora = cfg.trainer.lora
        if lora is None:
            return None
        from omni_grpo.models.lora import save_peft_adapter

        base = str(cfg.model.extracted_dir)
        return lambda d: save_peft_adapter(d, weights, lora, base)

    def push_weights(version: str) -> dict[str, float]:
        """New weights to an engine that holds its own copy (servers, rollout actors); the
        in-process embedded engine samples from the trainer's module and needs none."""
        if sync is None:
            return {}
        weights, layout = backend.weights_for_sync()
        return sync.push(weights, version=version, layout=layout).metrics()

    def run_eval() -> dict[str, float]:
        if eval_set is None or cfg.eval.every == 0:
            return {}
        args = (eval_sampling, cfg.rewards, cfg.eval.max_samples)
        return {
            **evaluate(engine, eval_set, *args),
            **evaluate_ablated(engine, eval_set, cfg.eval.ablations, *args),
        }

    eval_every = cfg.eval.every
    watch = SignalWatch(cfg.run.collapse_warn_steps)

    def complete_pending_row(
        step: int, row: dict[str, Any], pushed: dict[str, float]
    ) -> dict[str, float]:
        """The row of checkpointed step ``step`` whose weight sync failed, written now that the
        engine holds its weights: with the sync's numbers, and its evaluation if one is due.
        A resume that already wrote it (and was stopped later) finds it in the file: not again.
        Returns the step's evaluation."""
        eval_keys = ("eval/", "pre_warmup/")
        for old in read_metrics(run_dir):
            if old["step"] == step:
                return {k: v for k, v in old.items() if k.startswith(eval_keys)}
        row = {**row, **pushed}
        evaluated: dict[str, float] = {}
        if eval_every and step % eval_every == 0 or step == cfg.run.steps:
            evaluated = run_eval()
            row.update(evaluated)
        watch.replay([row])
        if step % cfg.run.log_every == 0 or evaluated:
            logger.log(step, row)
        return evaluated

    if ckpt is not None:
        watch.replay(read_metrics(run_dir))  # the logger kept exactly the checkpoint's steps
    last_eval: dict[str, float] = {}
    trained_cursor = sampler.cursor
    ahead_batch = None  # the next step's rollouts in flight (max_staleness 1)
    try:
        if ckpt is not None:  # an engine with its own weights starts from the checkpoint's
            pushed = push_weights(f"step-{state.step}")
            if state.warmup_done:
                anchor_reference(backend, run_dir, cfg.algo, save=False)
            if pending is not None and pending.get("step") == state.step:
                last_eval = complete_pending_row(state.step, pending["metrics"], pushed)
        # --- optional format warm-up (once per run, before step 1)
        warm = cfg.trainer.warmup
        if warm is not None and warm.steps > 0 and not state.warmup_done:
            pre = run_eval()
            losses = format_warmup(
                backend,
                train_set,
                sampler,
                tokenizer,
                eos_id,
                warm.steps,
                warm.lr,
                cfg.rollout.prompts_per_step,
            )
            state.warmup_done = True
            anchor_reference(backend, run_dir, cfg.algo, save=True)
            push_weights("warmup")  # the engine must sample (and evaluate) the warmed-up policy
            logger.log(
                0,
                {
                    "warmup/nll_first": losses[0],
                    "warmup/nll_last": losses[-1],
                    **{f"pre_warmup/{k}": v for k, v in pre.items()},
                    **run_eval(),
                },
            )
        elif state.step == 0 and not state.warmup_done:
            state.warmup_done = True
            if baseline := run_eval():  # no empty step-0 row when evaluation is off
                logger.log(0, baseline)

        end = cfg.run.steps if stop_after is None else min(cfg.run.steps, stop_after)
        with TrainProgress(cfg.run.steps, state.step, enabled=progress) as bar:
            for step in range(state.step + 1, end + 1):
                t0 = time.perf_counter()
                # data -> rollout (max_staleness 1: this step's batch was requested during the
                # last one; request the next before training, so generation overlaps the update)
                if ahead_batch is None:
                    prompts = next_prompts(train_set, sampler, cfg.rollout.prompts_per_step)
                    groups = engine.generate(prompts, cfg.rollout.n_samples, sampling)
                else:
                    groups = ahead_batch.result()
                trained_cursor = sampler.cursor
                ahead_batch = None
                if ahead is not None and step < end:
                    # The worker draws the prompts too: loading is rollout work, not the
                    # trainer's. The sampler is not touched here again until the batch is in.
                    ahead_batch = ahead.submit(
                        lambda: next_prompts(train_set, sampler, cfg.rollout.prompts_per_step),
                        cfg.rollout.n_samples,
                        sampling,
                    )
                t_rollout = time.perf_counter() - t0
                # rewards -> advantages
                rewards = score_groups(groups, cfg.rewards)
                advantages = group_advantages(
                    rewards,
                    cfg.rollout.n_samples,
                    std_normalize=cfg.algo.advantage.std_normalize,
                    eps=cfg.algo.advantage.eps,
                )
                # update
                t1 = time.perf_counter()
                metrics = backend.step(
                    GRPOBatch(
                        groups,
                        advantages,
                        temperature=sampling.temperature,
                        lr=lr_at(step, cfg.run.steps, cfg.trainer.lr, cfg.trainer.lr_schedule),
                    )
                )
                t_train = time.perf_counter() - t1
                # the step's metrics, all but what needs the new weights on the engine
                metrics.update(rollout_metrics(groups, rewards))
                if sync is not None:  # engines with their own weights report their versions
                    metrics.update(staleness_metrics(groups, step - 1, cfg.rollout.max_staleness))
                metrics.update(watch.update(step, metrics))
                metrics.update({"time/rollout_s": t_rollout, "time/train_s": t_train})
                metrics.update(
                    {
                        f"data/{k}": float(v)
                        for k, v in train_set.stats().items()
                        if k.startswith("skipped")
                    }
                )
                # weight sync (engines with their own copy; the embedded engine shares the module)
                if sync is not None:
                    try:
                        metrics.update(push_weights(f"step-{step}"))
                    except Exception as err:
                        if find_interrupt(err) is not None:
                            raise  # a stop signal arrived during the sync: not a failed sync
                        # The sync retried what it could; keep the step's update before stopping,
                        # with its metrics row: the resume writes it once the weights are pushed.
                        state.step = step
                        metrics["time/step_s"] = time.perf_counter() - t0
                        state.extra[PENDING_ROW] = {"step": step, "metrics": plain(metrics)}
                        try:
                            checkpoint()
                        finally:
                            state.extra.pop(PENDING_ROW, None)
                        log.error(
                            "weight sync of step %d failed; saved the checkpoint of step %d first "
                            "(resume with --resume: the weights are pushed again)",
                            step,
                            step,
                        )
                        raise
                # eval / metrics row / checkpoint
                if eval_every and step % eval_every == 0 or step == cfg.run.steps:
                    last_eval = run_eval()
                    metrics.update(last_eval)
                metrics["time/step_s"] = time.perf_counter() - t0
                state.step = step
                if step % cfg.run.log_every == 0 or last_eval.keys() & metrics.keys():
                    logger.log(step, metrics)
                bar.update(step, metrics)
                if cfg.run.save_every and step % cfg.run.save_every == 0 or step == end:
                    checkpoint()
    finally:
        if ahead is not None:
            ahead.close()
        logger.close()
        if sync is not None:
            sync.close()
        engine.close()  # remote engines hold HTTP connection pools
        backend.close()
        if ray_run is not None:
            ray_run.close()
    plots = plot_run(run_dir) if cfg.run.plots and state.step == cfg.run.steps else []
    return TrainResult(run_dir, state.step, last_eval, plots, time.perf_counter() - t_start)


def rollout_metrics(groups: list[list[Completion]], rewards: torch.Tensor) -> dict[str, float]:
    """Reward statistics (overall and per modality), lengths, how many groups carry signal and
    the policy's entropy per modality.

    ``entropy/<modality>`` is the sampled-token estimate ``-mean(logprob)`` over the completions'
    tokens under the rollout sampling distribution (no extra forward, and it is what the engine
    actually sampled from); it falls towards 0 as a modality's policy turns deterministic, which
    is what precedes a zero-variance collapse. ``zero_variance_frac/<modality>`` is the share of
    its groups whose rewards are all equal (``1 - signal``): no advantage, no gradient.
    """
    has_groups = rewards.shape[1] > 1
    varied = rewards.std(dim=1) > 0 if has_groups else torch.zeros(len(groups), dtype=torch.bool)
    out: dict[str, float] = {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        "groups_with_signal": float(varied.float().mean()) if has_groups else 0.0,
        "zero_variance_frac": float(1.0 - varied.float().mean()) if has_groups else 1.0,
        "completion_len_mean": float(np.mean([len(c.token_ids) for g in groups for c in g])),
        "truncated_frac": float(np.mean([c.finish_reason == "length" for g in groups for c in g])),
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

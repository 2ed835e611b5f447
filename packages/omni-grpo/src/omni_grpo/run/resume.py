"""What a resumed run picks up, and the metrics row of a step whose weight sync failed.

The loop (``omni_grpo.trainer``) calls three things here, so that its step reads as the step:

* :func:`resume_point` before the first step: the newest checkpoint's state, weights, optimizer
  and RNGs restored (``run.resume``), and the row it left pending, if any;
* :func:`checkpoint_pending_row` when a step's weight sync fails: the step is trained, so its
  checkpoint is saved with its metrics row inside — the engine does not hold its weights yet,
  so the row is not written (its sync numbers and evaluation are missing);
* :func:`complete_pending_row` once the resumed run has pushed those weights: the row is written
  with the new sync's numbers, and the step is not trained again.

:func:`resume_note` says where an interrupted run stands, for the message that ends it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omni_grpo.run.checkpoint import TrainState, latest_checkpoint, load_checkpoint, restore_rng
from omni_grpo.run.metrics import read_metrics

if TYPE_CHECKING:
    from collections.abc import Callable

    from omni_grpo.run.health import SignalWatch
    from omni_grpo.types import TrainerBackend, WeightSync

log = logging.getLogger(__name__)

# state.extra key of a checkpoint saved because the step's weight sync failed: that step's
# metrics row, which the resume completes and writes (the step is not trained again).
PENDING_ROW = "pending_metrics_row"

# The fields of a row that the step's evaluation wrote (the warm-up's row has ``pre_warmup/``).
EVAL_PREFIXES = ("eval/", "pre_warmup/")


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
class ResumePoint:
    """Where the run starts: a fresh :class:`TrainState` or the checkpoint's."""

    state: TrainState
    checkpoint: Path | None = None
    # ``{"step", "metrics"}`` of a step stopped by its weight sync (see the module doc)
    pending: dict[str, Any] | None = None


def resume_point(
    run_dir: Path, backend: TrainerBackend, sync: WeightSync | None, *, resume: bool
) -> ResumePoint:
    """Restore the newest checkpoint of ``run_dir`` into ``backend`` and the RNGs (``resume``).

    An engine with its own weights (``sync``) gets the checkpoint's at once: the servers may hold
    older ones (a run stopped by a failed sync saves first). Without a checkpoint, the run starts
    from scratch with a warning."""
    ckpt = latest_checkpoint(run_dir) if resume else None
    if ckpt is None:
        if resume:
            log.warning(
                "resume requested but %s has no checkpoint; starting from scratch",
                run_dir / "checkpoints",
            )
        return ResumePoint(TrainState())
    state, weights, optim_state, rng = load_checkpoint(ckpt)
    pending = state.extra.pop(PENDING_ROW, None)
    backend.load_trainable_state(weights)
    backend.load_optimizer_state(optim_state)
    restore_rng(rng)
    log.info("resumed from %s (step %d)", ckpt, state.step)
    if sync is not None and state.step > 0:
        weights, layout = backend.weights_for_sync()
        sync.push(weights, version=f"step-{state.step}", layout=layout)
    return ResumePoint(state, ckpt, pending)


def checkpoint_pending_row(
    state: TrainState, step: int, row: dict[str, Any], save: Callable[[], None]
) -> None:
    """Save the checkpoint of trained step ``step`` whose weight sync failed, with its metrics
    ``row`` inside (``state.extra``, only for this save): the resume writes it once the engine
    holds the step's weights. The caller re-raises the sync's error."""
    state.step = step
    state.extra[PENDING_ROW] = {"step": step, "metrics": plain(row)}
    try:
        save()
    finally:
        state.extra.pop(PENDING_ROW, None)
    log.error(
        "weight sync of step %d failed; saved the checkpoint of step %d first "
        "(resume with --resume: the weights are pushed again)",
        step,
        step,
    )


def complete_pending_row(
    run_dir: Path,
    point: ResumePoint,
    pushed: dict[str, float],
    *,
    maybe_eval: Callable[[int], dict[str, float]],
    log_step: Callable[[int, dict[str, Any], dict[str, float]], None],
    watch: SignalWatch,
) -> dict[str, float]:
    """Write the pending row of ``point`` now that the engine holds its step's weights: with the
    sync's numbers (``pushed``), and its evaluation if one is due — the same ``maybe_eval`` and
    ``log_step`` as every step's row. A resume that already wrote it (and was stopped later)
    finds it in the file: not again. Returns the step's evaluation (empty without a pending row).
    """
    pending = point.pending
    if pending is None or pending.get("step") != point.state.step:
        return {}
    step = point.state.step
    for old in read_metrics(run_dir):
        if old["step"] == step:
            return {k: v for k, v in old.items() if k.startswith(EVAL_PREFIXES)}
    row = {**pending["metrics"], **pushed}
    evaluated = maybe_eval(step)
    row.update(evaluated)
    watch.replay([row])
    log_step(step, row, evaluated)
    return evaluated


def resume_note(run_dir: Path) -> str:
    """Where an interrupted run stands: the last step logged, what ``--resume`` continues from."""
    steps = [r["step"] for r in read_metrics(run_dir)]
    done = f" after step {steps[-1]}" if steps else ""
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        return f"{done}; {run_dir} holds no checkpoint yet: --resume starts it again from step 1"
    return f"{done}; rerun with --resume to continue {run_dir} from {ckpt.name}"

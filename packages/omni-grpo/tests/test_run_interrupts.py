"""A one-process run stopped at every moment of a step (issue 30): SIGTERM during a rollout,
SIGINT during an update, a weight sync that fails, SIGTERM while a checkpoint is written — each
stop says where the run stands in one line, each ``--resume`` continues, and ``metrics.jsonl``
ends with every step's row exactly once (the row of the step whose sync failed included: it is
kept in that step's checkpoint and written by the resume, with the step's evaluation).

The run directory is owned by one process: a second ``train`` into it while the first runs is
refused naming the owner's pid; a stopped run leaves nothing to clean up."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from omni_grpo.cli import main
from omni_grpo.config import load_config
from omni_grpo.run.checkpoint import latest_checkpoint
from omni_grpo.run.lock import RunDirBusyError
from omni_grpo.run.metrics import read_metrics
from omni_grpo.run.signals import RunInterrupted
from omni_grpo.testing.interrupts import at_moment, signal_self
from omni_grpo.trainer import train
from omni_grpo.types import WeightSyncError

STEPS = 6


def _overrides(run_dir: Path, model_dir: Path) -> list[str]:
    return [
        f"run.dir={run_dir}",
        f"run.steps={STEPS}",
        "run.save_every=1",
        "run.tensorboard=false",
        "run.plots=false",
        "model.make_tiny={vocab: small, seed: 0}",
        f"model.omni_checkpoint={model_dir / 'omni'}",
        f"model.extracted_dir={model_dir / 'vl'}",
        f"model.audio_dir={model_dir / 'audio'}",
        "data.synthetic={tasks: [image, audio], n_train: 4, n_eval: 2, seed: 0}",
        "rollout.n_samples=2",
        "rollout.prompts_per_step=2",
        "rollout.sampling.max_new_tokens=2",
        "rollout.eval_sampling.max_new_tokens=2",
        "rollout.max_staleness=1",  # a weight sync in one process: the policy snapshot
        "trainer.device=cpu",
        "eval.every=2",
    ]


def _cfg(run_dir: Path, model_dir: Path) -> Any:
    return load_config(None, _overrides(run_dir, model_dir))


def _fail_sync() -> None:
    raise WeightSyncError("injected: the rollout side went away")


def _steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run_dir)]


def test_stops_at_every_moment_keep_each_row_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run, model = tmp_path / "run", tmp_path / "model"
    cfg = _cfg(run, model)

    # 1. SIGTERM while step 3's rollout is generated (one step ahead: during step 2)
    with (
        at_moment(monkeypatch, "rollout", 3, signal_self(signal.SIGTERM), run) as hit,
        pytest.raises(RunInterrupted) as info,
    ):
        train(cfg, progress=False)
    assert hit.fired and info.value.signum == signal.SIGTERM
    assert "stopped by SIGTERM after step 1; rerun with --resume" in str(info.value)
    assert latest_checkpoint(run).name == "step_000001"

    # 2. SIGINT during step 3's update
    with (
        at_moment(monkeypatch, "update", 3, signal_self(signal.SIGINT), run) as hit,
        pytest.raises(RunInterrupted, match="stopped by SIGINT after step 2"),
    ):
        train(cfg, resume=True, progress=False)
    assert hit.fired and latest_checkpoint(run).name == "step_000002"

    # 3. step 4's weight sync fails: the step's update is checkpointed with its row pending
    with (
        at_moment(monkeypatch, "sync", 4, _fail_sync) as hit,
        pytest.raises(WeightSyncError, match="injected"),
    ):
        train(cfg, resume=True, progress=False)
    assert hit.fired and latest_checkpoint(run).name == "step_000004"
    assert _steps(run)[-1] == 3  # row 4 is not in the file yet

    # 4. the resume writes row 4 (with step 4's evaluation), then SIGTERM while step 5 is saved
    with (
        at_moment(monkeypatch, "checkpoint", 5, signal_self(signal.SIGTERM), run) as hit,
        pytest.raises(RunInterrupted, match="after step 5; .* from step_000004"),
    ):
        train(cfg, resume=True, progress=False)
    assert hit.fired and latest_checkpoint(run).name == "step_000004"
    assert not list((run / "checkpoints").glob(".step_000005.tmp-*"))  # no half checkpoint

    # 5. a second process cannot take the directory while one runs
    with at_moment(monkeypatch, "update", 5, lambda: _second_train(cfg), run) as hit:
        result = train(cfg, resume=True, progress=False)  # row 4 already written: not again
    assert hit.fired and result.steps == STEPS
    records = read_metrics(run)
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4, 5, 6], [r["step"] for r in records]
    row4 = records[4]
    assert "eval/accuracy/all" in row4 and "weight_sync/tensors" in row4, sorted(row4)
    assert "reward_mean" in row4 and "loss" in row4 and "time/step_s" in row4
    assert "eval/accuracy/all" in records[-1] and result.final_eval


def _second_train(cfg: Any) -> None:
    with pytest.raises(RunDirBusyError) as info:
        train(cfg, resume=True, progress=False)
    import os

    assert f"in use by pid {os.getpid()} on " in str(info.value), str(info.value)
    assert "choose another run.dir" in str(info.value)


def test_the_cli_stops_on_a_signal_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Through ``omni-grpo train``: the stop is one ``Error:`` line and the exit status of a
    process ended by that signal (128 + signum); no traceback."""
    run, model = tmp_path / "run", tmp_path / "model"
    args = ["train", "--no-progress"]
    for o in _overrides(run, model):
        args += ["--set", o]
    with at_moment(monkeypatch, "update", 2, signal_self(signal.SIGTERM), run):
        res = CliRunner().invoke(main, [*args, "--set", "run.steps=3"])
    assert res.exit_code == 128 + signal.SIGTERM, res.output
    assert "Traceback" not in res.output
    last = res.output.strip().splitlines()[-1]
    assert last.startswith("Error: stopped by SIGTERM after step 1; rerun with --resume"), last
    res = CliRunner().invoke(main, [*args, "--set", "run.steps=3", "--resume"])
    assert res.exit_code == 0, res.output
    assert _steps(run) == [0, 1, 2, 3]


def test_a_stop_wrapped_by_a_c_extension_is_still_found() -> None:
    """Raised inside Ray's ``CoreWorker.wait``, the stop comes back as the cause of a
    ``SystemError``; code cleaning up after it may raise again with it as the context."""
    from omni_grpo.run.signals import find_interrupt

    stop = RunInterrupted(signal.SIGTERM)
    try:
        try:
            raise SystemError(
                "<cyfunction CoreWorker.wait> returned a result with an exception set"
            ) from stop
        except SystemError:
            raise RuntimeError("closing the actors failed") from None
    except RuntimeError as err:
        assert find_interrupt(err) is stop
    assert find_interrupt(ValueError("plain")) is None

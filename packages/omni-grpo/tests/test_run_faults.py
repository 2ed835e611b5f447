"""Run-directory faults of issue 15 (items 11-14): a run dir is never silently reused, a resume
under another config is refused with the difference, a kill mid-write of metrics.jsonl or
TensorBoard does not break or double a resume, stale temp dirs are removed and reported, a full
disk during a save says so, where, and how much was needed."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omni_grpo import atomic_dir
from omni_grpo.config import load_config
from omni_grpo.run import checkpoint as ckpt_mod
from omni_grpo.run.checkpoint import TrainState, latest_checkpoint, save_checkpoint
from omni_grpo.run.metrics import MetricsLogger, read_metrics, truncate_metrics
from omni_grpo.run.rundir import (
    RunDirError,
    check_resume_config,
    claim_run_dir,
    clean_stale_temps,
    config_fingerprint,
)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# ----------------------------------------------------------------- 11. a run dir is not reused
def _fake_run(run_dir: Path) -> None:
    (run_dir / "checkpoints" / "step_000002").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    (run_dir / "model" / "vl").mkdir(parents=True)
    (run_dir / "model" / "vl" / "config.json").write_text("{}")


def test_a_run_dir_holding_a_run_is_refused(tmp_path: Path) -> None:
    _fake_run(tmp_path)
    with pytest.raises(RunDirError) as info:
        claim_run_dir(tmp_path, resume=False, overwrite=False)
    msg = str(info.value)
    assert "checkpoints/step_000002" in msg and "metrics.jsonl (2 lines)" in msg
    assert "--resume" in msg and "--overwrite" in msg
    claim_run_dir(tmp_path, resume=True, overwrite=False)  # continuing it is fine
    with pytest.raises(RunDirError, match="exclude each other"):
        claim_run_dir(tmp_path, resume=True, overwrite=True)
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 2  # nothing touched


def test_overwrite_removes_the_old_run_but_keeps_the_prepared_model(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _fake_run(tmp_path)
    with caplog.at_level(logging.WARNING):
        claim_run_dir(tmp_path, resume=False, overwrite=True)
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "metrics.jsonl").exists()
    assert (tmp_path / "model" / "vl" / "config.json").is_file()
    assert "removed the previous run's checkpoints/, metrics.jsonl" in caplog.text


def test_only_prepared_inputs_do_not_count_as_a_run(tmp_path: Path) -> None:
    (tmp_path / "model" / "omni").mkdir(parents=True)
    (tmp_path / "data").mkdir()
    claim_run_dir(tmp_path, resume=False, overwrite=False)
    with pytest.raises(RunDirError, match="is a file"):
        (tmp_path / "f").write_text("x")
        claim_run_dir(tmp_path / "f", resume=False, overwrite=False)


def test_resume_across_an_incompatible_config_prints_the_diff(tmp_path: Path) -> None:
    base = load_config(None, [f"run.dir={tmp_path}"])
    stored = config_fingerprint(base)
    for compatible in ("run.steps=500", "eval.every=3", "rollout.sglang.timeout_s=9"):
        check_resume_config(stored, config_fingerprint(load_config(None, [compatible])), tmp_path)
    changed = config_fingerprint(
        load_config(None, ["algo.kl_coef=0.1", "rollout.n_samples=4", "run.steps=7"])
    )
    with pytest.raises(RunDirError) as info:
        check_resume_config(stored, changed, tmp_path / "step_000003")
    msg = str(info.value)
    assert "algo.kl_coef: 0.0 -> 0.1" in msg and "rollout.n_samples: 8 -> 4" in msg
    assert "run.steps" not in msg and "\n" not in msg


def test_fingerprint_never_holds_the_admin_key() -> None:
    cfg = load_config(None, ["rollout.sglang.admin_api_key=SUPERSECRET-456"])
    assert "SUPERSECRET" not in json.dumps(config_fingerprint(cfg))


# ------------------------------------------------- 12. half-written metrics line, TensorBoard
def test_half_written_last_metrics_line_is_dropped_on_resume(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "r": 0.5}\n{"step": 2, "r": 0.7}\n{"step": 3, "r": 0.')
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]  # readers skip it too
    with caplog.at_level(logging.WARNING):
        truncate_metrics(tmp_path, 2)
    assert path.read_text() == '{"step": 1, "r": 0.5}\n{"step": 2, "r": 0.7}\n'
    assert "dropped 1 incomplete line" in caplog.text


def test_tensorboard_shows_resumed_steps_once(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = MetricsLogger(tmp_path, tensorboard=True)
    for step in (1, 2, 3):
        first.log(step, {"reward_mean": float(step)})
    first.close()  # "killed" after step 3, the checkpoint is at step 1
    resumed = MetricsLogger(tmp_path, tensorboard=True, resume_step=1)
    for step in (2, 3, 4):
        resumed.log(step, {"reward_mean": 10.0 + step})
    resumed.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    events = acc.Scalars("reward_mean")
    assert [(e.step, e.value) for e in events] == [(1, 1.0), (2, 12.0), (3, 13.0), (4, 14.0)]


# ---------------------------------------------------------------- 13. stale temp dirs removed
def test_stale_temp_siblings_are_removed_and_reported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    dead, live = _dead_pid(), os.getppid()
    stale_owned = tmp_path / f".step_000004.tmp-p{dead}-x1"
    stale_owned.mkdir()
    (stale_owned / "model.safetensors").write_bytes(b"\0" * 2_000_000)
    stale_sync = tmp_path / f".tmp-step-3-p{dead}-ab12"
    stale_sync.mkdir()
    old_unowned = tmp_path / ".vl.tmp-k2j3"  # an extraction from before pids were in names
    old_unowned.mkdir()
    os.utime(old_unowned, (1, 1))
    fresh_unowned = tmp_path / ".audio.tmp-zz"
    fresh_unowned.mkdir()
    live_owned = tmp_path / f".step_000005.tmp-p{live}-y"
    live_owned.mkdir()
    keep = tmp_path / ".hidden-user-dir"
    keep.mkdir()
    with caplog.at_level(logging.WARNING):
        removed = clean_stale_temps([tmp_path, tmp_path / "missing"])
    assert sorted(removed) == sorted([stale_owned, stale_sync, old_unowned])
    assert fresh_unowned.exists() and live_owned.exists() and keep.exists()
    assert "removed 3 stale temporary" in caplog.text and "2.0 MB" in caplog.text
    assert len([r for r in caplog.records if "stale" in r.getMessage()]) == 1


def test_staged_dir_names_its_writer(tmp_path: Path) -> None:
    with atomic_dir.staged_dir(tmp_path / "out") as tmp:
        assert f".out.tmp-p{os.getpid()}-" in tmp.name


# ------------------------------------------------------------------- 14. disk full on a save
def _save(tmp_path: Path) -> None:
    weights = {"w": torch.zeros(256, 256)}
    save_checkpoint(tmp_path, TrainState(step=3), weights, {"state": {"m": torch.zeros(256, 256)}})


def test_disk_full_is_refused_before_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = atomic_dir.shutil.disk_usage
    monkeypatch.setattr(atomic_dir.shutil, "disk_usage", lambda p: real(p)._replace(free=100_000))
    with pytest.raises(atomic_dir.DiskFullError) as info:
        _save(tmp_path)
    msg = str(info.value)
    assert msg.startswith("disk full while writing checkpoint step_000003: ")
    assert str(tmp_path / "checkpoints") in msg and "100.0 KB free, about 1.6 MB needed" in msg
    assert list((tmp_path / "checkpoints").iterdir()) == []


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError(
            "[enforce fail at inline_container.cc:603] . PytorchStreamWriter failed "
            "writing file data/0: file write failed"
        ),
        RuntimeError("basic_ios::clear: iostream error"),
        OSError(28, "No space left on device"),
    ],
)
def test_disk_full_mid_save_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: Exception
) -> None:
    def full(*args: object, **kwargs: object) -> None:
        raise error

    monkeypatch.setattr(ckpt_mod.torch, "save", full)
    with pytest.raises(atomic_dir.DiskFullError, match="disk full while writing checkpoint") as e:
        _save(tmp_path)
    assert e.value.__cause__ is error
    assert list((tmp_path / "checkpoints").iterdir()) == []  # no half-written checkpoint
    assert latest_checkpoint(tmp_path) is None


def test_other_save_errors_are_not_called_disk_full(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("cannot pickle 'generator' object")

    monkeypatch.setattr(ckpt_mod.torch, "save", broken)
    with pytest.raises(RuntimeError, match="cannot pickle"):
        _save(tmp_path)


# ------------------------------------------------------------------ the classes through train()
def _cfg(run_dir: Path, model_dir: Path, *extra: str) -> object:
    return load_config(
        None,
        [
            f"run.dir={run_dir}",
            "run.steps=2",
            "run.save_every=1",
            "run.tensorboard=false",
            "run.plots=false",
            "model.make_tiny={vocab: small, seed: 0}",
            f"model.omni_checkpoint={model_dir / 'omni'}",
            f"model.extracted_dir={model_dir / 'vl'}",
            f"model.audio_dir={model_dir / 'audio'}",
            "data.synthetic={tasks: [image], n_train: 2, n_eval: 1, seed: 0}",
            "rollout.n_samples=2",
            "rollout.prompts_per_step=1",
            "rollout.sampling.max_new_tokens=2",
            "trainer.device=cpu",
            "eval.every=0",
            *extra,
        ],
    )


def test_train_refuses_reuse_and_config_changes_and_resumes_cleanly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from omni_grpo.trainer import train

    run, model = tmp_path / "run", tmp_path / "model"
    train(_cfg(run, model), progress=False, stop_after=1)
    before = (run / "metrics.jsonl").read_text()
    with pytest.raises(RunDirError, match="already holds a run"):
        train(_cfg(run, model), progress=False)
    assert (run / "metrics.jsonl").read_text() == before  # the first run's record is intact
    with pytest.raises(RunDirError, match=r"algo.kl_coef: 0.0 -> 0.5"):
        train(_cfg(run, model, "algo.kl_coef=0.5"), resume=True, progress=False)
    # a kill mid-write: half a metrics line and an abandoned checkpoint temp dir
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "reward_mea')
    stale = run / "checkpoints" / f".step_000002.tmp-p{_dead_pid()}-q"
    stale.mkdir()
    with caplog.at_level(logging.WARNING):
        result = train(_cfg(run, model, "run.steps=3"), resume=True, progress=False)
    assert result.steps == 3
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]  # eval off: no step-0 row
    assert not stale.exists() and "removed 1 stale temporary" in caplog.text
    assert "dropped 1 incomplete line" in caplog.text
    # --overwrite starts over in the same directory
    again = train(_cfg(run, model), overwrite=True, progress=False)
    assert again.steps == 2 and [r["step"] for r in read_metrics(run)] == [1, 2]
    assert latest_checkpoint(run).name == "step_000002"


def test_every_staged_writer_reports_a_full_disk(tmp_path: Path) -> None:
    with (
        pytest.raises(atomic_dir.DiskFullError) as info,
        atomic_dir.staged_dir(tmp_path / "dataset") as tmp,
    ):
        (tmp / "part-0.jsonl").write_bytes(b"x" * 5000)
        raise OSError(28, "No space left on device")
    msg = str(info.value)
    assert msg.startswith(f"disk full while writing dataset: {tmp_path} has ")
    assert "at least 5.0 KB needed" in msg
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------- issue 30: a run directory has one owner
_HOLD = """
import sys, time
from omni_grpo.run.lock import own_run_dir
with own_run_dir(sys.argv[1]):
    print("held", flush=True)
    time.sleep(600)
"""


def test_a_run_dir_is_owned_by_one_process_and_freed_when_it_dies(tmp_path: Path) -> None:
    from omni_grpo.run.lock import LOCK_FILE, RunDirBusyError, own_run_dir

    run = tmp_path / "run"
    with own_run_dir(run):
        assert json.loads((run / LOCK_FILE).read_text())["pid"] == os.getpid()
        busy = pytest.raises(RunDirBusyError, match=f"in use by pid {os.getpid()} on ")
        with busy, own_run_dir(run):
            pass
    assert not (run / LOCK_FILE).exists()  # a finished owner leaves the directory as it was
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(run)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirBusyError) as info, own_run_dir(run):
            pass
        msg = str(info.value)
        assert (
            f"pid {holder.pid} on " in msg and "choose another run.dir" in msg and "\n" not in msg
        )
    finally:
        holder.kill()  # kill -9: the kernel drops the lock, the file stays behind
        holder.wait()
    assert (run / LOCK_FILE).exists()
    with own_run_dir(run):  # a dead owner's file is simply taken over
        assert json.loads((run / LOCK_FILE).read_text())["pid"] == os.getpid()

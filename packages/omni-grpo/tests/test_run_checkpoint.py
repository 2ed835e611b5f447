"""Checkpoints are atomic (a crash leaves the previous one intact) and restore every RNG."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from omni_grpo.run.checkpoint import (
    CheckpointError,
    DataCursor,
    TrainState,
    latest_checkpoint,
    load_checkpoint,
    restore_rng,
    rng_state,
    save_checkpoint,
)
from omni_grpo.run.metrics import MetricsLogger, read_metrics


def _save(run: Path, step: int, value: float = 0.0, **kw: object) -> Path:
    state = TrainState(step=step, cursor=DataCursor(1, step), warmup_done=True)
    weights = {"w": torch.full((2, 3), value)}
    return save_checkpoint(
        run, state, weights, {"optimizer": {"lr": 0.1}, "steps_done": step}, **kw
    )


def test_round_trip(tmp_path: Path) -> None:
    path = _save(tmp_path, 3, 1.5)
    state, weights, optim, _rng = load_checkpoint(path)
    assert state.step == 3 and state.cursor == DataCursor(1, 3) and state.warmup_done
    assert torch.equal(weights["w"], torch.full((2, 3), 1.5))
    assert optim["steps_done"] == 3
    assert latest_checkpoint(tmp_path) == path


def test_crash_while_saving_keeps_previous(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = _save(tmp_path, 1, 1.0)
    real_save = torch.save

    def crash(obj: object, f: object, *a: object, **k: object) -> None:
        if str(f).endswith("rng.pt"):
            raise OSError("disk full")
        real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        _save(tmp_path, 2, 2.0)
    monkeypatch.undo()
    ckpts = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_000001"]  # no temp dir left
    assert latest_checkpoint(tmp_path) == first
    assert torch.equal(load_checkpoint(first)[1]["w"], torch.full((2, 3), 1.0))


def test_incomplete_directory_is_ignored(tmp_path: Path) -> None:
    _save(tmp_path, 1)
    fake = tmp_path / "checkpoints" / "step_000009"
    fake.mkdir()
    (fake / "model.safetensors").write_bytes(b"partial")
    (tmp_path / "checkpoints" / "latest").unlink()  # even without the pointer
    assert latest_checkpoint(tmp_path).name == "step_000001"
    with pytest.raises(CheckpointError, match="state.json"):
        load_checkpoint(fake)


def test_missing_file_is_named(tmp_path: Path) -> None:
    path = _save(tmp_path, 1)
    (path / "optimizer.pt").unlink()
    with pytest.raises(CheckpointError, match="optimizer.pt"):
        load_checkpoint(path)


def test_keep_last(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, keep_last=2)
    names = sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*"))
    assert names == ["step_000003", "step_000004"]


def test_rng_state_restores_all_generators() -> None:
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    saved = rng_state()
    expected = (
        random.random(),
        np.random.rand(),
        torch.rand(3),
        torch.multinomial(torch.ones(10), 4),
    )
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    restore_rng(saved)
    got = (random.random(), np.random.rand(), torch.rand(3), torch.multinomial(torch.ones(10), 4))
    assert got[0] == expected[0] and got[1] == expected[1]
    assert torch.equal(got[2], expected[2]) and torch.equal(got[3], expected[3])


def test_metrics_truncated_on_resume(tmp_path: Path) -> None:
    logger = MetricsLogger(tmp_path, tensorboard=True)
    for step in range(1, 6):
        logger.log(step, {"reward_mean": step / 10, "nan": float("nan")})
    logger.close()
    assert (tmp_path / "tensorboard").is_dir()
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert records[0]["nan"] is None  # JSON has no NaN
    resumed = MetricsLogger(tmp_path, tensorboard=False, resume_step=3)
    resumed.log(4, {"reward_mean": 0.4})
    resumed.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2, 3, 4]


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.pt", "rng.pt", "state.json"])
def test_a_damaged_newest_checkpoint_is_named_with_the_way_out(tmp_path: Path, name: str) -> None:
    """Issue 30: a truncated file in the newest checkpoint is refused in one line naming the
    checkpoint and the file, pointing at the previous complete one (or --overwrite), both by
    the up-front check of a resume and by the loader itself."""
    from omni_grpo.run.checkpoint import verify_checkpoint
    from omni_grpo.run.rundir import check_resume
    from omni_grpo.testing.damage import truncate_file

    first = _save(tmp_path, 1)
    newest = _save(tmp_path, 2)
    truncate_file(newest / name, 0.6)
    for check in (verify_checkpoint, load_checkpoint):
        with pytest.raises(CheckpointError) as info:
            check(newest)
        msg = str(info.value)
        assert "\n" not in msg and msg.startswith(f"checkpoint {newest} is damaged ({name}: ")
        assert f"rm -r {newest}" in msg and first.name in msg and "--overwrite" in msg
    with pytest.raises(CheckpointError, match="is damaged"):
        check_resume(tmp_path, {"hash": "x", "settings": {}})
    import shutil

    shutil.rmtree(newest)  # the way out: the previous complete one is resumed
    assert latest_checkpoint(tmp_path) == first
    verify_checkpoint(first)
    truncate_file(first / name, 0.6)
    with pytest.raises(CheckpointError, match="no earlier checkpoint: start over with --overwrite"):
        verify_checkpoint(first)

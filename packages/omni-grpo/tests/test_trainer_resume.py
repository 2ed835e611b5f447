"""Kill-and-resume gives exactly the metrics of an uninterrupted run (fixed seed)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from omni_grpo.algo.schedule import lr_at
from omni_grpo.config import LrScheduleConfig, load_config
from omni_grpo.run.metrics import read_metrics
from omni_grpo.trainer import EpochSampler, train


def _cfg(run_dir: Path, model_dir: Path, steps: int) -> object:
    return load_config(
        None,
        [
            f"run.dir={run_dir}",
            f"run.steps={steps}",
            "run.seed=7",
            "run.save_every=0",
            "run.tensorboard=false",
            "run.plots=false",
            "model.make_tiny={vocab: small, seed: 0}",
            f"model.omni_checkpoint={model_dir / 'omni'}",
            f"model.extracted_dir={model_dir / 'vl'}",
            f"model.audio_dir={model_dir / 'audio'}",
            "data.synthetic={tasks: [image, audio, video], n_train: 2, n_eval: 1, seed: 0}",
            "rollout.n_samples=3",
            "rollout.prompts_per_step=2",
            "rollout.sampling.max_new_tokens=3",
            "rollout.eval_sampling.max_new_tokens=2",
            "trainer.device=cpu",
            "trainer.lr=1e-3",
            "trainer.lr_schedule={kind: cosine, min_lr_ratio: 0.1}",
            "trainer.warmup={steps: 1, lr: 1e-3}",
            "eval.every=2",
            "eval.ablations=[video]",
            "run.collapse_warn_steps=1",
        ],
    )


def _deterministic(records: list[dict]) -> list[dict]:
    """Without wall-clock metrics: the loop's ``time/*`` and the torch backend's ``time_*_s``."""
    return [
        {k: v for k, v in r.items() if not (k.startswith("time/") or k.startswith("time_"))}
        for r in records
    ]


def test_resume_after_stop_gives_identical_metrics(tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    straight = tmp_path / "straight"
    train(_cfg(straight, model_dir, 5), progress=False)
    full = _deterministic(read_metrics(straight))
    assert [r["step"] for r in full] == [0, 1, 2, 3, 4, 5]
    # the ablated evaluation runs with the plain one; the collapse watch count is logged
    assert {"eval/ablated/video/accuracy/video", "eval/ablated/video/accuracy/all"} <= set(full[2])
    assert any(k.startswith("no_signal_steps/") for k in full[3])
    # each update used the schedule's lr for its step (read back from the optimizer)
    schedule = LrScheduleConfig(kind="cosine", min_lr_ratio=0.1)
    assert [r["lr"] for r in full[1:]] == pytest.approx(
        [lr_at(s, 5, 1e-3, schedule) for s in range(1, 6)], rel=1e-12
    )
    assert full[1]["lr"] == pytest.approx(1e-3) and full[5]["lr"] == pytest.approx(1e-4)

    resumed = tmp_path / "resumed"
    shutil.copytree(straight / "data", resumed / "data")  # same dataset, no regeneration cost
    first = train(
        _cfg(resumed, model_dir, 5), progress=False, stop_after=2
    )  # "killed" after step 2
    assert first.steps == 2
    # a killed run may have logged past its last checkpoint: resume must drop those lines
    with open(resumed / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 3, "reward_mean": 123.0}) + "\n")
    second = train(_cfg(resumed, model_dir, 5), resume=True, progress=False)
    assert second.steps == 5
    again = _deterministic(read_metrics(resumed))
    assert [r["step"] for r in again] == [0, 1, 2, 3, 4, 5]
    assert again == full  # every line, including the ones after the resume point, bit for bit
    # (the lr too: the schedule is a function of the step, so the resumed run stays on its curve)
    # (no_signal_steps/* too: the watch rebuilt its counts from metrics.jsonl)


def test_epoch_sampler_cursor_reproduces_the_stream() -> None:
    a = EpochSampler(5, seed=3)
    stream = [a.next() for _ in range(13)]
    assert sorted(stream[:5]) == list(range(5)) and sorted(stream[5:10]) == list(range(5))
    b = EpochSampler(5, seed=3)
    head = [b.next() for _ in range(7)]
    c = EpochSampler(5, seed=3, cursor=b.cursor)
    assert head + [c.next() for _ in range(6)] == stream


def test_resume_without_checkpoint_starts_fresh(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = _cfg(tmp_path / "run", tmp_path / "model", 1)
    result = train(cfg, resume=True, progress=False)
    assert result.steps == 1
    assert "no checkpoint" in caplog.text


class _Rows:
    """A dataset whose odd rows cannot be loaded (skipped, counted), recording the load thread."""

    def __init__(self, size: int) -> None:
        self.size, self.skipped, self.threads = size, 0, set()

    def __len__(self) -> int:
        return self.size

    def load(self, index: int) -> int | None:
        import threading

        self.threads.add(threading.current_thread().name)
        if index % 2:
            self.skipped += 1
            return None
        return index


@pytest.mark.parametrize("ahead", [0, 3])
def test_prompt_stream_loads_ahead_in_the_samplers_order(ahead: int) -> None:
    """Loading ahead changes nothing a run sees: the same prompts in the same order, the cursor
    after the last prompt taken (not after the prefetched ones), every skipped row counted."""
    from omni_grpo.loop.data_order import PromptStream, next_prompts

    ref_rows, ref = _Rows(9), EpochSampler(9, seed=5)
    want = [next_prompts(ref_rows, ref, k) for k in (2, 3, 2)]  # type: ignore[arg-type]
    rows, sampler = _Rows(9), EpochSampler(9, seed=5)
    stream = PromptStream(rows, sampler, ahead=ahead)  # type: ignore[arg-type]
    got, cursors = [], []
    for k in (2, 3, 2):
        got.append(stream.take(k))
        cursors.append(stream.cursor)
    assert got == want
    assert stream.cursor == ref.cursor  # a resume redraws what was loaded ahead
    again = EpochSampler(9, seed=5, cursor=cursors[0])
    assert next_prompts(_Rows(9), again, 3) == want[1]  # type: ignore[arg-type]
    stream.close()
    if ahead:
        assert rows.skipped >= ref_rows.skipped  # the prefetched rows' skips are counted too
        assert any(t.startswith("omni-grpo-prompts") for t in rows.threads)
    else:
        assert rows.skipped == ref_rows.skipped and rows.threads == {"MainThread"}

"""The same rows as jsonl + media files, as a parquet file with the media embedded, and as a
``datasets.save_to_disk`` directory with ``Image`` / ``Audio`` / ``Video`` features train with the
same seed to IDENTICAL losses, rewards and accuracies; a corrupt embedded image costs its row
(skipped, counted in ``data/skipped_unreadable``) in every form while the run completes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omni_grpo.config import load_config
from omni_grpo.data.synthetic import generate_synthetic
from omni_grpo.testing.datasets import parquet_copy, save_to_disk_copy
from omni_grpo.trainer import train

STEPS = 3
# Keys that are timings (differ run to run by nature); everything else must match exactly.
TIMING_PREFIXES = ("time/", "time_")  # the loop's time/* and the torch backend's time_*_s


def _add_corrupt_image_row(train: Path) -> None:
    """A row whose image is not an image, in the middle of the file (same row in every form)."""
    rows = [json.loads(x) for x in train.read_text().splitlines()]
    bad_rel = "train/image/corrupt.png"
    (train.parent / bad_rel).write_bytes(b"\x89PNG\r\n\x1a\n but then nothing an image has")
    bad = {**rows[0], "uid": "corrupt", "media": [{"type": "image", "path": bad_rel}]}
    bad["prompt"] = next(r["prompt"] for r in rows if r["modality"] == "image")
    bad["modality"] = "image"
    rows.insert(len(rows) // 2, bad)
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture(scope="module")
def three_forms(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    base = tmp_path_factory.mktemp("forms")
    train, evaluation = generate_synthetic(base / "files", ["image", "audio", "video"], 3, 2, 0)
    _add_corrupt_image_row(train)
    root = train.parent
    forms = {"jsonl": (train, evaluation)}
    forms["parquet"] = tuple(  # type: ignore[assignment]
        parquet_copy(f, root, base / "pq" / f"{f.stem}.parquet") for f in (train, evaluation)
    )
    forms["save_to_disk"] = tuple(  # type: ignore[assignment]
        save_to_disk_copy(p, base / "hf" / p.stem) for p in forms["parquet"]
    )
    return forms


def _run(tmp_path: Path, name: str, train_spec: Path, eval_spec: Path, omni: Path) -> list[dict]:
    run_dir = tmp_path / name
    cfg = load_config(
        None,
        [
            f"run.dir={run_dir}",
            f"run.steps={STEPS}",
            "run.seed=3",
            f"eval.every={STEPS}",
            "run.save_every=0",
            "run.tensorboard=false",
            "run.plots=false",
            f"model.omni_checkpoint={omni}",
            "model.dtype=float32",
            f"data.train={train_spec}",
            f"data.eval={eval_spec}",
            "rollout.n_samples=3",
            "rollout.prompts_per_step=4",
            "rollout.sampling.max_new_tokens=2",
            "rollout.eval_sampling.max_new_tokens=2",
            "trainer.device=cpu",
            "trainer.warmup.steps=1",
        ],
    )
    train(cfg, progress=False)
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _comparable(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(TIMING_PREFIXES)} for r in records]


def test_same_rows_three_ways_train_identically(
    three_forms: dict[str, tuple[Path, Path]], tiny_omni_dir: Path, tmp_path: Path
) -> None:
    runs = {
        name: _run(tmp_path, name, *specs, tiny_omni_dir) for name, specs in three_forms.items()
    }
    base = _comparable(runs["jsonl"])
    steps = [r for r in base if "reward_mean" in r]
    assert len(steps) == STEPS and all("loss" in r for r in steps)
    assert any(k.startswith("eval/accuracy/") for k in base[-1])
    for name in ("parquet", "save_to_disk"):
        assert _comparable(runs[name]) == base, name
    # the corrupt image was drawn, skipped and counted the same way in every form
    skipped = [r.get("data/skipped_unreadable", 0) for r in runs["parquet"]]
    assert max(skipped) >= 1
    assert [r.get("data/skipped_unreadable", 0) for r in runs["jsonl"]] == skipped

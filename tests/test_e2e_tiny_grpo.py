"""End-to-end: `omni-grpo train` from nothing (tiny checkpoint, extraction, synthetic media) and
GRPO makes the policy better at a task it can only solve by looking at the image.

Smaller budget than examples/tiny.yaml (image task only, ~100 steps) so that it fits CI on 2 cores.
The format warm-up trains on RANDOM letters, so held-out accuracy starts at chance (0.5); the
assertion is that GRPO lifts both the training reward and the held-out accuracy well above it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import yaml
from click.testing import CliRunner
from omni_grpo.cli import main

REPO = Path(__file__).resolve().parents[1]


def test_train_cli_improves_reward(tmp_path: Path) -> None:
    cfg = yaml.safe_load((REPO / "examples" / "tiny.yaml").read_text())
    cfg["run"].update(dir=str(tmp_path / "run"), steps=100, save_every=50)
    cfg["eval"]["every"] = 50
    cfg["data"]["synthetic"].update(tasks=["image"], n_train=32, n_eval=16)
    cfg["rollout"]["prompts_per_step"] = 6
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(cfg))

    result = CliRunner().invoke(
        main, ["train", "--config", str(tmp_path / "tiny.yaml"), "--no-progress"]
    )
    assert result.exit_code == 0, result.output

    run = tmp_path / "run"
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward_mean"] for r in records if r.get("reward_mean") is not None]
    assert len(rewards) == 100
    first, last = float(np.mean(rewards[:20])), float(np.mean(rewards[-20:]))
    assert last > first + 0.2, (first, last)
    start = records[0]["eval/accuracy/image"]
    end = [r for r in records if "eval/accuracy/image" in r][-1]["eval/accuracy/image"]
    assert start <= 0.6 and end >= 0.8, (start, end)
    # run artefacts: checkpoint, TensorBoard events, plots, summary
    assert (run / "checkpoints" / "latest").is_file()
    assert any((run / "tensorboard").iterdir())
    assert (run / "plots" / "reward.png").is_file() and (run / "plots" / "accuracy.png").is_file()
    assert (run / "plots" / "health.png").is_file()
    assert {"entropy/image", "zero_variance_frac/image", "no_signal_steps/image"} <= set(
        records[-1]
    )
    lengths = ("completion_len_p50", "completion_len_p90", "completion_len_p99")
    assert {*lengths, "completion_len_max", "time/generation_tokens_per_s"} <= set(records[-1])
    assert records[-1]["time/generation_tokens_per_s"] > 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 100

    # The trained policy reads the image: with mid-grey images every row has the same prompt, so
    # it falls to chance; blanking a modality the task does not have changes nothing.
    result = CliRunner().invoke(
        main,
        ["eval", "--config", str(tmp_path / "tiny.yaml"), "--ablate", "image", "--ablate", "audio"],
    )
    assert result.exit_code == 0, result.output
    scores = json.loads(result.stdout.strip().splitlines()[-1])
    assert scores["eval/accuracy/image"] == end
    assert abs(scores["eval/ablated/image/accuracy/image"] - 0.5) <= 0.1, scores
    assert scores["eval/ablated/audio/accuracy/image"] == scores["eval/accuracy/image"]

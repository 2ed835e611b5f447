"""``rollout.exact_logprobs`` on the Ray scale path, on one GPU: ``examples/tiny-ray.yaml`` in bf16
on CUDA with two data-parallel trainer ranks and one embedded rollout actor, all three sharing
the device (``ray.gpus_per_trainer`` / ``rollout.embedded.gpus_per_actor`` fractions; their
collectives over gloo, since NCCL refuses two ranks of one group on one device).

The rollout actor samples from its own copy of the policy, which the weight sync keeps bitwise
equal to the trainer ranks' (full fine-tuning: the weights; LoRA: the unmerged adapters), so
every completion token's rollout logprob must equal the trainer's, every step
(``train_rollout_logprob_exact_fraction`` 1.0 in ``metrics.jsonl``). The default ``auto``
turns it on here, and the run's first lines say so.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from click.testing import CliRunner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
ray = pytest.importorskip("ray")

REPO = Path(__file__).resolve().parents[1]
STEPS = 4


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_tiny_ray_on_one_gpu_is_exact_every_step(
    tmp_path: Path, lora: bool, caplog: pytest.LogCaptureFixture
) -> None:
    from omni_grpo.cli import main

    caplog.set_level(logging.INFO)

    os.environ["RAY_ENABLE_UV_RUN_RUNTIME_ENV"] = "0"
    run = tmp_path / "run"
    trainer: dict[str, Any] = {
        "device": "cuda",
        "world_size": 2,
        "warmup": {"steps": 1},  # the format warm-up re-anchors the KL reference: synced too
    }
    if lora:
        trainer["lora"] = {"rank": 4, "targets": ["attention", "experts"]}
    body = {
        "extends": str(REPO / "examples" / "tiny-ray.yaml"),
        "run": {"dir": str(run), "steps": STEPS, "plots": False, "tensorboard": False},
        "model": {"dtype": "bfloat16"},
        "eval": {"every": 0},
        "data": {"synthetic": {"n_eval": 8}},
        "trainer": trainer,
        "rollout": {
            "sampling": {"max_new_tokens": 12},
            "embedded": {"actors": 1, "gpus_per_actor": 0.3},
        },
        "ray": {"gpus_per_trainer": 0.3, "num_cpus": 4},
    }
    cfg = tmp_path / "tiny-ray-gpu.yaml"
    cfg.write_text(yaml.safe_dump(body))
    try:
        result = CliRunner().invoke(main, ["train", "--config", str(cfg), "--no-progress"])
    finally:
        ray.shutdown()
    assert result.exit_code == 0, result.output
    assert "rollout.exact_logprobs: on (auto)" in caplog.text, caplog.text[-3000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [
        r for r in rows if r.get("step", 0) > 0 and "train_rollout_logprob_exact_fraction" in r
    ]
    assert len(steps) >= STEPS - 1, rows
    fractions = [r["train_rollout_logprob_exact_fraction"] for r in steps]
    print(f"{'lora' if lora else 'full'}: exact fraction per step {fractions}")
    assert fractions == [1.0] * len(steps), fractions

"""Every shipped example config validates against the config tree (typos fail here, not on a GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
from omni_grpo.config import load_config

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.yaml"))


def test_examples_exist():
    assert EXAMPLES, "examples/*.yaml is empty"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_config_validates(path: Path):
    cfg = load_config(path)
    assert cfg.run.steps > 0
    assert cfg.rollout.n_samples > 1


def test_scale_example_targets_megatron_and_sglang():
    cfg = load_config(Path(EXAMPLES[0]).parent / "qwen3-omni-30b-avqa.yaml")
    assert cfg.trainer.backend == "megatron"
    assert cfg.rollout.engine == "sglang-omni"
    assert cfg.trainer.megatron.sp  # MoE with TP > 1 requires sequence parallelism

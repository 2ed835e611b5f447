"""Shared fixtures of the cross-package tests."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest


@dataclass
class FakeServerRun:
    """What a ``train()`` run against the fake sglang-omni server left behind."""

    run_dir: Path
    omni: Path
    records: list
    weight_version: str | None


@pytest.fixture
def train_against_fake_server(tmp_path: Path) -> Callable[..., FakeServerRun]:
    """Run ``omni_grpo.trainer.train`` on a tiny Omni model with rollouts from the fake server.

    The fake answers the k-th sample of a prompt with answer letter ``k % letters`` (never a media
    marker) then ``<|im_end|>``, so every group holds right and wrong answers and the update is
    non-zero. ``overrides`` are extra dotted config overrides (backend, device, sync mode, ...).
    """

    def run(
        overrides: list[str],
        *,
        letters: str = "ABCD",
        n_samples: int = 4,
        prompts_per_step: int = 2,
        n_train: int = 4,
        n_eval: int = 2,
        arm: Callable[[Any], None] | None = None,
    ) -> FakeServerRun:
        from omni_extract.tiny import TinyOmniSpec, make_tiny_omni
        from omni_grpo.config import load_config
        from omni_grpo.trainer import train
        from omni_rollout_client.testing import FakeGeneration, FakeOmniServer, FakeRequest
        from transformers import AutoTokenizer

        run_dir = tmp_path / "run"
        omni = make_tiny_omni(run_dir / "model" / "omni", TinyOmniSpec(with_talker=False))
        config = json.loads((omni / "config.json").read_text())
        im_end = int(config["im_end_token_id"])
        vocab = int(config["thinker_config"]["text_config"]["vocab_size"])
        tok = AutoTokenizer.from_pretrained(str(omni))
        answer_ids = [tok.encode(c, add_special_tokens=False) for c in letters]
        assert all(len(ids) == 1 for ids in answer_ids)
        seen: dict[tuple[int, ...], int] = {}

        def answer_tokens(req: FakeRequest) -> FakeGeneration:
            key = tuple(req.input_ids)
            k = seen[key] = seen.get(key, -1) + 1
            ids = [*answer_ids[k % len(answer_ids)], im_end][: req.max_new_tokens]
            return FakeGeneration(token_ids=ids, logprobs=[-1.0] * len(ids))

        with FakeOmniServer(
            vocab_size=vocab, eos_token_id=im_end, generator=answer_tokens
        ) as server:
            cfg = load_config(
                None,
                [
                    f"run.dir={run_dir}",
                    "run.steps=2",
                    "eval.every=0",
                    "run.save_every=0",
                    "run.tensorboard=false",
                    "run.plots=false",
                    f"model.omni_checkpoint={omni}",
                    "model.dtype=float32",
                    f"data.synthetic.n_train={n_train}",
                    f"data.synthetic.n_eval={n_eval}",
                    "rollout.engine=sglang-omni",
                    f"rollout.sglang.urls=[{server.url}]",
                    f"rollout.n_samples={n_samples}",
                    f"rollout.prompts_per_step={prompts_per_step}",
                    "rollout.sampling.max_new_tokens=3",
                    *overrides,
                ],
            )
            if arm is not None:  # e.g. inject server faults before training starts
                arm(server)
            train(cfg, progress=False)
            return FakeServerRun(run_dir, omni, list(server.records), server.weight_version)

    return run

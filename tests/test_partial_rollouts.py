"""Partial rollouts (``rollout.partial``): groups in flight across calls, on the CPU.

A sample continued in a later call, weights unchanged, must be the sample drawn in one go (its
draws are keyed on the sample and the token index); a call returns as many ended groups as it
was given prompts, the oldest first; tokens drawn in an earlier call are counted as stale.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omni_extract import extract
from omni_grpo.data.prompt import PromptBuilder
from omni_grpo.models import load_thinker
from omni_grpo.rollout.embedded import EmbeddedEngine
from omni_grpo.rollout.partial import PartialRollouts
from omni_grpo.types import Sample, SamplingParams

TOL = 1e-5


@pytest.fixture(scope="module")
def world(tiny_omni_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("partial")
    extract(tiny_omni_dir, root / "vl", variant="vl")
    extract(tiny_omni_dir, root / "audio", variant="audio")
    thinker = load_thinker(root / "vl", dtype="float32")
    from omni_grpo.config import DataConfig

    builder = PromptBuilder(root / "vl", DataConfig())
    prompts = [
        builder.build(Sample(uid=f"p{i}", prompt=f"Question {i}: say {i}.", label=""), "/")
        for i in range(6)
    ]
    gen = json.loads((Path(thinker.source_dir) / "generation_config.json").read_text())
    return thinker, prompts, int(gen["pad_token_id"])


# sample j of the prompt with uid p<i>: a long tail (one sample of each group runs long)
LENGTHS = {0: [3, 40], 1: [5, 4], 2: [2, 6], 3: [30, 3], 4: [4, 4], 5: [7, 2]}


def _engine(thinker, pad):
    def plan(prompts, n):
        return [LENGTHS[int(p.sample.uid[1:])][j] for p in prompts for j in range(n)]

    return EmbeddedEngine(thinker, [pad], batching="continuous", max_batch_rows=3, length_plan=plan)


def test_groups_in_flight_continue_where_they_stopped(world):
    thinker, prompts, pad = world
    sampling = SamplingParams(temperature=0.9, max_new_tokens=40)
    stream = iter(prompts[2:])
    torch.manual_seed(0)
    pool = PartialRollouts(_engine(thinker, pad), 2, lambda k: [next(stream) for _ in range(k)])
    got = {}
    steps = [pool.generate(prompts[:2], 2, sampling)]
    assert len(steps[0]) == 2 and len(pool.carry) == 2
    steps.append(pool.generate([next(stream)], 2, sampling))
    steps.append(pool.generate([next(stream)], 2, sampling))
    assert [len(s) for s in steps] == [2, 1, 1]
    stale = 0
    for step in steps:
        for group in step:
            uid = int(group[0].prompt.sample.uid[1:])
            assert [len(c.token_ids) for c in group] == LENGTHS[uid]  # every sample ended
            assert all(c.finish_reason == "length" for c in group)
            got[uid] = group
            stale += sum(c.stale_tokens for c in group)
    assert stale > 0  # the long samples (40 and 30 tokens) ran over more than one call
    # The same prompts in one call, no groups in flight: the same keys, the same samples.
    torch.manual_seed(0)
    whole = PartialRollouts(_engine(thinker, pad), 0, lambda k: [])
    once = whole.generate(prompts[:4] + prompts[4:6], 2, sampling)
    for group in once:
        uid = int(group[0].prompt.sample.uid[1:])
        if uid not in got:
            continue
        for a, b in zip(group, got[uid], strict=True):
            assert a.token_ids == b.token_ids
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) <= TOL
            assert a.stale_tokens == 0


def test_partial_rollouts_need_continuous_batching(world):
    thinker, _, pad = world
    with pytest.raises(ValueError, match="continuous batching"):
        PartialRollouts(EmbeddedEngine(thinker, [pad]), 1, lambda k: [])


def test_train_with_groups_in_flight_and_resume(tmp_path: Path, caplog) -> None:
    """``omni-grpo train`` with ``rollout.embedded.extra_groups``: every step trains its groups,
    the metrics say how stale they were, and a resume says what it could not keep."""
    import logging

    import yaml
    from click.testing import CliRunner
    from omni_grpo.cli import main

    repo = Path(__file__).resolve().parents[1]
    cfg = yaml.safe_load((repo / "examples" / "tiny.yaml").read_text())
    cfg["run"].update(dir=str(tmp_path / "run"), steps=2, save_every=1)
    cfg["eval"]["every"] = 0
    cfg["data"]["synthetic"].update(tasks=["image"], n_train=16, n_eval=4)
    cfg["rollout"]["embedded"] = {"extra_groups": 2}
    cfg["rollout"]["sampling"]["max_new_tokens"] = 24
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(cfg))
    args = ["train", "--config", str(tmp_path / "tiny.yaml"), "--no-progress"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "rollout/groups_in_flight" in r]
    assert len(steps) == 2 and all(r["rollout/groups_in_flight"] == 2.0 for r in steps)
    assert all(0.0 <= r["rollout/stale_token_frac"] <= 1.0 for r in steps)
    cfg["run"]["steps"] = 3
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(cfg))
    with caplog.at_level(logging.WARNING, logger="omni_grpo.trainer"):
        result = CliRunner().invoke(main, [*args, "--resume"])
    assert result.exit_code == 0, result.output
    assert "2 groups of partial rollouts were in flight" in caplog.text
    last = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["rollout/dropped_groups"] == 2.0


def test_config_refuses_groups_in_flight_where_they_cannot_run() -> None:
    from omni_grpo.config import ConfigError, load_config

    for bad, fragment in (
        (["rollout.embedded.batching=static"], "needs rollout.embedded.batching continuous"),
        (["rollout.max_staleness=1"], "both train on samples of earlier policies"),
        (["rollout.embedded.actors=1"], "in the in-process embedded engine"),
        (["trainer.world_size=2"], "in the in-process embedded engine"),
    ):
        with pytest.raises(ConfigError, match=fragment):
            load_config(None, ["rollout.embedded.extra_groups=2", *bad])
    assert load_config(None, ["rollout.embedded.extra_groups=2"]).rollout.embedded.extra_groups


def test_engine_continues_groups_after_the_first_ended(world):
    """The engine level: one call stops once group 0 ended (groups 1 and 2 mid-sample), a
    second call finishes them; the same samples as one call decoding everything."""
    from omni_grpo.testing.partial_rollouts import continued_and_one_go

    thinker, prompts, pad = world
    engine = EmbeddedEngine(thinker, [pad], batching="continuous", max_batch_rows=5)
    sampling = SamplingParams(temperature=0.9, max_new_tokens=40)
    for x, y in continued_and_one_go(engine, prompts, sampling):
        assert len(x.token_ids) == x.limit and x.token_ids == y.token_ids
        assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs, strict=True)) <= TOL

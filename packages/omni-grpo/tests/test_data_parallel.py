"""Data parallelism of the torch backend: 2 gloo ranks on shards == 1 process on the whole batch.

Also the shard function: whole groups, balanced by forward tokens, deterministic, nothing lost.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from omni_grpo.algo.shard import group_tokens, shard_batch
from omni_grpo.backends.torch_backend import TorchBackend
from omni_grpo.config import AlgoConfig, TrainerConfig
from omni_grpo.types import Completion, GRPOBatch, PromptInputs, Sample


def _batch(sizes: list[tuple[int, list[int]]]) -> GRPOBatch:
    """Groups of (prompt length, completion lengths)."""
    groups = []
    for g, (prompt_len, lengths) in enumerate(sizes):
        p = PromptInputs(Sample(f"u{g}", "p", "A"), [1] * prompt_len)
        groups.append([Completion(p, [7] * n, [-1.0] * n, "stop") for n in lengths])
    adv = torch.arange(len(sizes) * 2, dtype=torch.float32).view(len(sizes), 2)
    return GRPOBatch(groups, adv, temperature=0.7)


def test_shards_keep_groups_whole_and_balance_forward_tokens() -> None:
    batch = _batch([(10, [30, 30]), (10, [5, 5]), (10, [20, 20]), (10, [1, 1]), (50, [0, 0])])
    assert group_tokens(batch) == [80, 30, 60, 22, 100]
    shards = shard_batch(batch, 2)
    # largest first to the least loaded: 100 -> r0, 80 -> r1, 60 -> r1, 30 -> r0, 22 -> r0
    ids = [[g[0].prompt.sample.uid for g in s.groups] for s in shards]
    assert ids == [["u1", "u3", "u4"], ["u0", "u2"]]  # batch order kept inside a shard
    assert [sum(group_tokens(s)) for s in shards] == [152, 140]
    for s in shards:  # each group keeps its own advantages row and the temperature
        for g, group in enumerate(s.groups):
            row = int(group[0].prompt.sample.uid[1:])
            assert torch.equal(s.advantages[g], batch.advantages[row])
        assert s.temperature == 0.7
    assert shard_batch(batch, 2)[1].groups == shards[1].groups  # deterministic


def test_more_ranks_than_groups_gives_empty_shards() -> None:
    shards = shard_batch(_batch([(4, [2, 2])]), 3)
    assert [len(s.groups) for s in shards] == [1, 0, 0]
    assert shards[1].advantages.shape == (0, 2)
    assert shard_batch(_batch([(4, [2, 2])]), 1)[0].advantages.shape == (1, 2)
    with pytest.raises(ValueError, match="world_size"):
        shard_batch(_batch([]), 0)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from omni_grpo.testing.rollouts import rollout_world

    w = rollout_world(tmp_path_factory.mktemp("dp"))
    w["groups"][2][1].token_ids, w["groups"][2][1].logprobs = [], []  # an empty one counts too
    return w


def test_two_gloo_ranks_equal_one_process(world: dict[str, Any]) -> None:
    from omni_grpo.models import load_thinker
    from omni_grpo.testing.data_parallel import run_world, torch_backend_steps

    groups = world["groups"]
    g = torch.Generator().manual_seed(5)
    steps = [
        GRPOBatch(groups, torch.randn(3, 4, generator=g), 0.8),  # shards of 2 and 1 groups
        GRPOBatch(groups[:1], torch.randn(1, 4, generator=g), 0.8),  # rank 1: an empty shard
        GRPOBatch(groups, torch.zeros(3, 4), 0.8),  # no signal anywhere: nobody steps
    ]
    # lr 1e-3: every update element is ~1e-3, 100x the tolerance. (Adam's first update
    # lr * g / (|g| + eps) turns fp32 summation-order noise on a gradient element that cancels to
    # ~eps into an error proportional to lr: 2.7e-5 at lr 1e-2, measured.)
    trainer = {"device": "cpu", "lr": 1e-3, "micro_batch_size": 2, "max_grad_norm": 0.5}
    algo: dict[str, Any] = {}
    # the vision tower trains too (its gradients take part in the sum), and in step 2 rank 1 has
    # no gradient at all: the sum must still line up parameter by parameter
    one = TorchBackend(
        load_thinker(world["vl"], audio_dir=world["audio"], freeze_visual=False),
        TrainerConfig(**trainer),
        AlgoConfig(**algo),
        pad_token_id=world["eos"],
    )
    # the format warm-up first: rank 0 gets 2 prompts, rank 1 one (the driver splits the list)
    prompts = world["prompts"]
    targets = [[5, world["eos"]], [6, 7, world["eos"]], [world["eos"]]]
    warm_nll = one.supervised_step(prompts, targets, 1e-3)
    warmup = ([prompts[:2], prompts[2:]], [targets[:2], targets[2:]], 1e-3)
    ref = []
    for batch in steps:
        ref.append((one.step(batch), one.trainable_state()))
    ranks = run_world(
        torch_backend_steps,
        2,
        str(world["vl"]),
        str(world["audio"]),
        trainer,
        algo,
        world["eos"],
        [shard_batch(b, 2) for b in steps],
        warmup,
        False,
    )
    assert [r["nll"] for r in ranks] == pytest.approx([warm_nll] * 2, abs=1e-5)
    assert [r["is_driver"] for r in ranks] == [True, False]
    assert [len(s.groups) for s in shard_batch(steps[1], 2)] == [1, 0]
    for s, (metrics, weights) in enumerate(ref):
        for r in ranks:
            got = r["metrics"][s]
            assert got.keys() == metrics.keys(), s
            for key, value in metrics.items():
                if key.startswith("time_"):  # the backend's wall-clock phases (time_*_s)
                    continue
                assert got[key] == pytest.approx(value, abs=1e-5, nan_ok=True), (s, key)
            for name, w in weights.items():
                assert torch.allclose(r["weights"][s][name], w, atol=1e-5, rtol=0), (s, name)
        same = [
            {k: v for k, v in r["metrics"][s].items() if not k.startswith("time_")} for r in ranks
        ]
        assert same[0] == same[1]  # every rank reports the same (its wall-clock phases aside)
    assert ref[0][0]["skipped_step"] == 0 and ref[0][0]["grad_norm"] > 0.5  # clipping was active
    assert ref[2][0]["no_signal_step"] == 1
    start = load_thinker(world["vl"], audio_dir=world["audio"]).state_dict()
    assert max(float((w - start[n]).abs().max()) for n, w in ref[0][1].items()) > 5e-4
    moved = [not torch.equal(ref[0][1][n], ref[1][1][n]) for n in ref[0][1]]
    assert any(moved)  # step 2 (one rank empty) still updated the weights

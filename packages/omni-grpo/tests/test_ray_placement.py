"""Ray placement planning (pure) and, when ray is installed, a real placement group on fake GPUs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from click.testing import CliRunner
from omni_grpo.cli import main
from omni_grpo.config import (
    EmbeddedRolloutConfig,
    MegatronConfig,
    RolloutConfig,
    SglangOmniConfig,
    TrainerConfig,
    load_config,
)
from omni_grpo.ray import PlacementError, plan_placement, rank_env
from omni_grpo.ray.placement import plan_run

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def _cfg(
    tp: int = 2, ep: int = 2, urls: tuple[str, ...] = ("http://a:30000", "http://b:30000")
) -> tuple[TrainerConfig, RolloutConfig]:
    trainer = TrainerConfig(
        backend="megatron", device="cuda", megatron=MegatronConfig(tp=tp, ep=ep, sp=tp > 1)
    )
    rollout = RolloutConfig(engine="sglang-omni", sglang=SglangOmniConfig(urls=list(urls)))
    return trainer, rollout


def test_tp2_ep2_on_two_gpus_with_two_servers() -> None:
    plan = plan_placement(*_cfg(), server_tp_sizes=[2, 4])
    assert plan.world_size == 2 and plan.dp == 1 and plan.strategy == "STRICT_PACK"
    assert [b["GPU"] for b in plan.bundles] == [1.0, 1.0]
    assert [(r.tp_rank, r.ep_rank, r.dp_rank) for r in plan.ranks] == [(0, 0, 0), (1, 1, 0)]
    assert [(s.url, s.rank_offset) for s in plan.servers] == [
        ("http://a:30000", 1),
        ("http://b:30000", 3),
    ]
    assert plan.sync_world_size == 1 + 2 + 4


def test_multi_node_coordinates() -> None:
    plan = plan_placement(*_cfg(tp=4, ep=8), trainer_gpus=16, gpus_per_node=8)
    assert plan.strategy == "PACK" and plan.dp == 4
    r = plan.ranks[13]
    assert (r.node_slot, r.local_rank, r.tp_rank, r.dp_rank, r.ep_rank, r.expert_dp_rank) == (
        1,
        5,
        1,
        3,
        5,
        1,
    )
    env = rank_env(plan, 13, "10.0.0.1", 29500)
    assert env["RANK"] == "13" and env["WORLD_SIZE"] == "16" and env["NCCL_NVLS_ENABLE"] == "0"


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"trainer_gpus": 3}, r"multiple of trainer.megatron.tp \* pp = 2"),
        ({"trainer_gpus": 8, "gpus_per_node": 2, "tp": 4}, "straddling"),
        ({"server_tp_sizes": [1]}, "1 entries for 2"),
    ],
)
def test_bad_layouts_are_refused(kw: dict, match: str) -> None:
    tp = kw.pop("tp", 2)
    with pytest.raises(PlacementError, match=match):
        plan_placement(*_cfg(tp=tp), **kw)


def test_embedded_engine_needs_rollout_actors_beyond_one_process() -> None:
    trainer, _ = _cfg()
    with pytest.raises(PlacementError, match="rollout.embedded.actors >= 1"):
        plan_placement(trainer, RolloutConfig())
    with pytest.raises(PlacementError, match="rollout.embedded.actors >= 1"):
        plan_placement(TrainerConfig(world_size=2), RolloutConfig())
    with pytest.raises(PlacementError, match="only for rollout.engine 'embedded'"):
        rollout = _cfg()[1].model_copy(update={"embedded": EmbeddedRolloutConfig(actors=1)})
        plan_placement(trainer, rollout)


def test_torch_ddp_on_cpu_with_rollout_actors() -> None:
    """The CI layout (examples/tiny-ray.yaml): 2 CPU trainer ranks, 2 embedded rollout actors."""
    plan = plan_placement(
        TrainerConfig(world_size=2, device="cpu"),
        RolloutConfig(embedded=EmbeddedRolloutConfig(actors=2)),
        cpus_per_rank=0.25,
    )
    assert plan.distributed and plan.device == "CPU" and plan.total_gpus == 0
    assert plan.bundles == ({"CPU": 0.25}, {"CPU": 0.25}) and plan.strategy == "STRICT_PACK"
    assert [(r.dp_rank, r.tp_rank) for r in plan.ranks] == [(0, 0), (1, 0)]
    assert [(s.role, s.rank_offset) for s in plan.servers] == [("embedded", 1), ("embedded", 2)]
    assert plan.sync_world_size == 3


def test_one_process_default_needs_no_ray() -> None:
    plan = plan_placement(TrainerConfig(device="cpu"), RolloutConfig())
    assert not plan.distributed and plan.world_size == 1 and plan.servers == ()


def test_scale_example_plans_for_16_gpus() -> None:
    cfg = load_config(EXAMPLES / "qwen3-omni-30b-avqa.yaml")
    plan = plan_run(cfg, available_gpus=16)
    assert (plan.world_size, plan.tp, plan.ep, plan.dp) == (8, 2, 8, 4)
    assert plan.total_gpus == 16 and plan.strategy == "STRICT_PACK"
    assert [(s.role, s.gpus, s.rank_offset) for s in plan.servers] == [("launched", 8, 1)]
    assert plan.sync_world_size == 9
    with pytest.raises(PlacementError, match="needs 16 GPUs .* but 15 are available"):
        plan_run(cfg, available_gpus=15)
    two_nodes = plan_run(
        load_config(EXAMPLES / "qwen3-omni-30b-avqa.yaml", ["trainer.world_size=16"])
    )
    assert two_nodes.strategy == "PACK" and two_nodes.ranks[9].node_slot == 1


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (["trainer.world_size=6"], "trainer.megatron.ep = 8"),
        (["trainer.world_size=3", "trainer.megatron.ep=1"], r"trainer.megatron.tp \* pp = 2"),
        (["ray.gpus_per_node=1"], "ray.gpus_per_node"),
    ],
)
def test_plan_cli_refuses_impossible_layouts_naming_the_field(overrides, field) -> None:
    args = ["train", "--config", str(EXAMPLES / "qwen3-omni-30b-avqa.yaml"), "--plan"]
    for o in overrides:
        args += ["--set", o]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 2 and res.exception is not None
    assert "Traceback" not in res.output
    assert re.search(field, res.output), res.output


def test_plan_cli_prints_ranks_and_servers() -> None:
    res = CliRunner().invoke(
        main,
        ["train", "--config", str(EXAMPLES / "qwen3-omni-30b-avqa.yaml"), "--plan", "--gpus", "16"],
    )
    assert res.exit_code == 0, res.output
    assert "tp 2 x ep 8 x dp 4" in res.output and "weight-sync group world 9" in res.output
    rows = [
        line.split() for line in res.output.splitlines() if re.match(r"\s+\d+\s+\d+\s+\d+", line)
    ]
    assert len(rows) == 8  # one line per trainer rank (the server line has a role word)
    res = CliRunner().invoke(main, ["show-config", "--plan", "--set", "trainer.device=cpu"])
    assert res.exit_code == 0 and "one process (no Ray)" in res.output


_RAY_SCRIPT = """
import json, os, sys
import ray
from omni_grpo.config import MegatronConfig, RolloutConfig, SglangOmniConfig, TrainerConfig
from omni_grpo.ray import plan_placement, rank_env
from omni_grpo.ray.placement import actor_options, create_placement_group

trainer = TrainerConfig(backend="megatron", device="cuda", megatron=MegatronConfig(tp=2, ep=2, sp=True))
rollout = RolloutConfig(engine="sglang-omni", sglang=SglangOmniConfig(urls=["http://a:1"]))
plan = plan_placement(trainer, rollout, trainer_gpus=4)
ray.init(num_cpus=4, num_gpus=4, include_dashboard=False, log_to_driver=False)
pg = create_placement_group(plan, timeout_s=60)
opts = actor_options(plan, 3, pg)
env = rank_env(plan, 3, "127.0.0.1", 29500)

table = ray.util.placement_group_table(pg)

# (tasks are not launched: worker start-up needs more than this CI box's 2 cores allow in time)
print(json.dumps({"rank": env["RANK"], "gpus": opts["num_gpus"], "state": table["state"],
                  "bundles": len(table["bundles"]), "bundle": opts["scheduling_strategy"].placement_group_bundle_index}), flush=True)
ray.shutdown()
os._exit(0)  # ray's atexit hooks can outlive the test otherwise
"""


def test_real_placement_group_on_fake_gpus() -> None:
    """A real Ray cluster (fake GPU resources) places the bundles; runs in a child process."""
    import json
    import subprocess
    import sys

    pytest.importorskip("ray")
    out = subprocess.run(
        [sys.executable, "-c", _RAY_SCRIPT], capture_output=True, text=True, timeout=180, check=True
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["rank"] == "3" and got["bundle"] == 3 and got["gpus"] == 1.0
    assert got["state"] == "CREATED" and got["bundles"] == 4


def test_ray_num_cpus_is_a_whole_number() -> None:
    """The raylet takes num_cpus as an int32 flag: 8.0 killed it at start (H200 box, 30 s
    "node timed out during startup"); a fractional count is refused in one line instead."""
    from omni_grpo.config import RayConfig

    assert type(RayConfig(num_cpus=8.0).num_cpus) is int
    with pytest.raises(ValueError, match="num_cpus"):
        RayConfig(num_cpus=1.5)


def test_ranks_and_actors_share_one_gpu_with_fractions() -> None:
    """The one-GPU scale path (docs/scale.md): 2 ranks x 0.3 GPU + 1 rollout actor x 0.3 fit one
    GPU; sharing ranks are flagged so their collectives and the sync take gloo, not NCCL."""
    cfg = load_config(
        EXAMPLES / "tiny-ray.yaml",
        [
            "trainer.device=cuda",
            "rollout.embedded.actors=1",
            "rollout.embedded.gpus_per_actor=0.3",
            "ray.gpus_per_trainer=0.3",
        ],
    )
    plan = plan_run(cfg)
    assert plan.device == "GPU" and plan.shares_gpus
    assert [b["GPU"] for b in plan.bundles] == [0.3, 0.3]
    assert plan.trainer_gpus == 1  # 0.6 of one GPU
    from omni_grpo.ray.placement import format_plan

    text = format_plan(plan, cfg)  # what --plan prints: 0.9 of one GPU in all
    assert text.startswith("plan: 1 GPUs (1 trainer on 1 node(s) + 1 rollout actor(s) x 0.3 GPU)")
    assert "(gpu: a 0.3 share, placed by Ray)" in text
    whole = plan_run(load_config(EXAMPLES / "tiny-ray.yaml", ["trainer.device=cuda"]))
    assert not whole.shares_gpus and whole.trainer_gpus == 2


@pytest.mark.parametrize("field", ["ray.gpus_per_trainer", "rollout.embedded.gpus_per_actor"])
@pytest.mark.parametrize("value", ["0", "1.5"])
def test_gpu_fractions_outside_0_1_are_refused(field: str, value: str) -> None:
    with pytest.raises(ValueError, match=field.split(".")[-1]):
        load_config(EXAMPLES / "tiny-ray.yaml", [f"{field}={value}"])

"""Placement checked before anything starts (issue 30): a layout the Ray cannot hold — an actor
asking for more CPUs or GPUs than any node has, a trainer placement group that must share one
node and does not fit it, or all actors together over the cluster's total — is refused in one
line naming the config field, by ``--plan`` and by ``train`` within seconds (before the model is
made); before, ``rollout.embedded.cpus_per_actor`` > ``ray.num_cpus`` waited with no error."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from omni_grpo.cli import main
from omni_grpo.config import load_config
from omni_grpo.ray.placement import PlacementError, plan_run
from omni_grpo.ray.resources import check_local_resources, check_resources

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
TINY_RAY = EXAMPLES / "tiny-ray.yaml"  # 2 trainer ranks x 0.25 CPU, 2 rollout actors x 0.25


def _cfg(*overrides: str):
    return load_config(TINY_RAY, overrides)


@pytest.mark.parametrize(
    ("overrides", "nodes", "needles"),
    [
        (
            ["rollout.embedded.cpus_per_actor=3"],
            [{"CPU": 2.0}],
            ["rollout.embedded.cpus_per_actor: a rollout actor asks for 3 CPU(s)", "more than 2"],
        ),
        (
            ["ray.cpus_per_trainer=1.5"],
            [{"CPU": 2.0}, {"CPU": 2.0}],  # each rank fits a node, the packed group does not
            ["ray.cpus_per_trainer: the 2 trainer ranks must share one node", "3 CPU(s)"],
        ),
        (
            ["rollout.embedded.cpus_per_actor=1"],
            [{"CPU": 2.0}],
            ["asks Ray for 2.5 CPU(s) at once", "[rollout.embedded.cpus_per_actor]"],
        ),
        (
            ["trainer.device=cuda"],
            [{"CPU": 8.0, "GPU": 3.0}],
            ["asks Ray for 4 GPU(s) at once", "[rollout.embedded.actors]"],
        ),
        (
            ["trainer.device=cuda"],
            [{"CPU": 8.0, "GPU": 0.0}],
            ["a trainer rank asks for 1 GPU(s) but no Ray node has more than 0"],
        ),
    ],
)
def test_layouts_the_nodes_cannot_hold_are_refused_naming_the_field(
    overrides: list[str], nodes: list[dict[str, float]], needles: list[str]
) -> None:
    cfg = _cfg(*overrides)
    with pytest.raises(PlacementError) as info:
        check_resources(plan_run(cfg), cfg, nodes, "test nodes")
    msg = str(info.value)
    assert "\n" not in msg and "test nodes" in msg
    for needle in needles:
        assert needle in msg, msg


def test_layouts_that_fit_pass_and_unknown_counts_are_not_checked() -> None:
    cfg = _cfg()
    check_resources(plan_run(cfg), cfg, [{"CPU": 2.0}], "exactly enough")  # 1.0 of 2
    cfg = _cfg("trainer.device=cuda")
    check_resources(plan_run(cfg), cfg, [{"CPU": 1.0}], "no GPU count: not checked")
    check_local_resources(_cfg("trainer.world_size=1", "rollout.embedded.actors=0"))  # 1 process
    shared = _cfg(
        "trainer.device=cuda",
        "rollout.embedded.actors=1",
        "rollout.embedded.gpus_per_actor=0.3",
        "ray.gpus_per_trainer=0.3",
    )
    check_resources(plan_run(shared), shared, [{"CPU": 2.0, "GPU": 1.0}], "one GPU, shared")
    with pytest.raises(PlacementError, match=r"ray\.gpus_per_trainer"):
        over = _cfg("trainer.device=cuda", "ray.gpus_per_trainer=0.75")  # 1.5 GPUs, STRICT_PACK
        check_resources(plan_run(over), over, [{"CPU": 2.0, "GPU": 1.0}], "one GPU")


def test_plan_and_train_refuse_at_once_and_make_nothing(tmp_path: Path) -> None:
    run = tmp_path / "run"
    sets = ["--set", "rollout.embedded.cpus_per_actor=3", "--set", f"run.dir={run}"]
    res = CliRunner().invoke(main, ["train", "--config", str(TINY_RAY), "--plan", *sets])
    assert res.exit_code == 2, res.output
    assert "rollout.embedded.cpus_per_actor: a rollout actor asks for 3 CPU(s)" in res.output
    assert "ray.num_cpus 2" in res.output
    start = time.monotonic()
    res = CliRunner().invoke(main, ["train", "--config", str(TINY_RAY), "--no-progress", *sets])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert "rollout.embedded.cpus_per_actor" in res.output.strip().splitlines()[-1]
    assert time.monotonic() - start < 30 and not run.exists()
    # a plan for other machines: --gpus sets the GPUs, the CPUs of this one are not assumed
    res = CliRunner().invoke(
        main,
        [
            "train",
            "--config",
            str(TINY_RAY),
            "--plan",
            "--gpus",
            "3",
            "--set",
            "trainer.device=cuda",
            "--set",
            "ray.num_cpus=null",
        ],
    )
    assert res.exit_code == 2 and "asks Ray for 4 GPU(s)" in res.output, res.output


def test_a_ray_that_does_not_start_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray's own start-up failure (a bare ``Exception`` on a machine too busy) names Ray and the
    way out instead of being an internal error."""
    ray = pytest.importorskip("ray")
    from omni_grpo.config import RayConfig
    from omni_grpo.ray.driver import connect

    def init(**_: object) -> None:
        raise Exception("The current node timed out during startup.\nSee the raylet logs.")

    monkeypatch.setenv("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")  # connect() sets it otherwise
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError) as info:
        connect(RayConfig(num_cpus=2))
    msg = str(info.value)
    assert msg.startswith("Ray did not start on this machine (The current node timed out")
    assert "\n" not in msg and "ray.address" in msg

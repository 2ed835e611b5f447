"""One run across many processes on Ray (issue 11): the driver, trainer ranks, rollout actors and
launched servers, on this machine's CPU.

Ray is started once for the module and shared by every run in it (the driver joins a running Ray
instead of starting its own); each run starts and ends its own actors.

* ``test_tiny_ray_survives_a_killed_rank_and_learns``: ``examples/tiny-ray.yaml`` (2 DDP trainer
  ranks over gloo, 2 embedded rollout actors) in a shorter form (40 steps; the 200-step demo is
  ``benchmarks/tiny_ray.py``). Trainer rank 1 is killed with SIGKILL mid-run: the run stops with
  a non-zero exit naming the rank and quoting its log. ``--resume`` restarts every actor and
  finishes. ``metrics.jsonl`` holds steps 1..40 exactly once, and held-out accuracy ends >= 0.9
  on image, audio and video.
* ``test_two_rank_ddp_step_equals_one_process``: the first step of 2-rank DDP through the real
  driver equals the one-process step on the same batch: same loss, grad norm and updated weights
  within 1e-5 (fp32). Rank 1 ends with the same weights as rank 0. ``..._lora_...``: the same
  with ``trainer.lora`` (adapters only; the merged weights rank 0 streams equal the one-process
  ``W + scale*BA``).
* ``test_sglang_engine_against_launched_fake_servers``: the sglang-omni engine against servers
  that the driver launched as Ray actors (the project's fake server, started by the same
  ``omni-grpo serve`` code path). Weight sync runs both ways: ``disk``, and ``distributed`` over
  a real gloo group into receiver processes in each server. The distributed run checks that the
  last push carried exactly the final checkpoint's weights under server names.
* ``test_one_step_ahead_on_ray``: ``rollout.max_staleness: 1`` with the trainer as a Ray actor and
  embedded rollout actors (every batch after the first exactly one version old) or a launched fake
  server (0 or 1 old); staleness histogram in ``metrics.jsonl``, step 1 on-policy.
* ``test_an_exception_in_an_actor_is_one_line_with_its_log``: an actor that raises (rather than
  dies) gives the same one-line error, with the exception and the actor's last log lines.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from click.testing import CliRunner
from omni_grpo.cli import main

ray = pytest.importorskip("ray")

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def ray_cluster() -> Any:
    os.environ["RAY_ENABLE_UV_RUN_RUNTIME_ENV"] = "0"
    os.environ.setdefault("OMNI_GRPO_TORCH_THREADS", "1")
    from omni_grpo.config import RayConfig
    from omni_grpo.ray.driver import connect

    connect(RayConfig(num_cpus=2))
    yield
    ray.shutdown()


def write_config(tmp: Path, name: str, body: dict[str, Any]) -> Path:
    """A config that extends ``examples/tiny-ray.yaml`` with ``body`` merged over it."""
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"extends": str(REPO / "examples" / "tiny-ray.yaml"), **body}))
    return path


def metrics(run: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def kill_when(run: Path, step: int, rank: int, done: threading.Event, out: dict) -> None:
    """SIGKILL trainer ``rank``'s process once ``metrics.jsonl`` reaches ``step``."""
    log = run / "logs" / f"trainer-{rank}.log"
    while not done.is_set():
        path = run / "metrics.jsonl"
        if path.is_file() and any(
            json.loads(x).get("step", 0) >= step for x in path.read_text().splitlines() if x
        ):
            pid = int(re.search(rf"trainer rank {rank} pid (\d+)", log.read_text()).group(1))
            os.kill(pid, signal.SIGKILL)
            out["pid"], out["t"] = pid, time.monotonic()
            return
        time.sleep(0.2)


def test_tiny_ray_survives_a_killed_rank_and_learns(tmp_path: Path) -> None:
    run = tmp_path / "run"
    cfg = write_config(
        tmp_path,
        "tiny-ray-ci",
        {
            "run": {
                "dir": str(run),
                "steps": 80,
                "save_every": 10,
                "plots": False,
            },
            "eval": {"every": 40},
            "data": {"synthetic": {"n_eval": 16}},
        },
    )
    args = ["train", "--config", str(cfg), "--no-progress"]
    done, killed = threading.Event(), {}
    watcher = threading.Thread(target=kill_when, args=(run, 15, 1, done, killed), daemon=True)
    watcher.start()
    first = CliRunner().invoke(main, args)
    done.set()
    watcher.join(5)
    assert killed, "the run ended before the kill"
    assert first.exit_code == 1, first.output
    err = first.output.strip().splitlines()
    assert any(line.startswith("Error: trainer rank 1 died during") for line in err), first.output
    assert "Traceback" not in first.output
    assert "trainer-1.log" in first.output  # its last log lines are quoted
    print(f"stopped {time.monotonic() - killed['t']:.1f}s after the kill:\n{first.output}")

    second = CliRunner().invoke(main, [*args, "--resume"])
    assert second.exit_code == 0, second.output
    records = metrics(run)
    steps = [r["step"] for r in records if r["step"] > 0]
    assert steps == list(range(1, 81)), steps
    final = records[-1]
    for modality in ("image", "audio", "video"):
        assert final[f"eval/accuracy/{modality}"] >= 0.9, final
    assert (run / "logs" / "rollout-1.log").is_file()


def _two_rank_vs_one_process(tmp_path: Path, overrides: list[str]) -> dict[str, Any]:
    """The first step of 2-rank DDP through the real driver and the one-process step on the same
    batch, from the same starting weights (rank 0's, which every rank receives)."""
    from omni_grpo.algo import group_advantages
    from omni_grpo.backends import create_backend
    from omni_grpo.config import load_config
    from omni_grpo.data.dataset import OmniDataset
    from omni_grpo.data.prompt import PromptBuilder
    from omni_grpo.ray.driver import ActorSet, RayTrainerGroup, start_trainers
    from omni_grpo.ray.placement import plan_run
    from omni_grpo.rollout.embedded import EmbeddedEngine
    from omni_grpo.trainer import media_token_ids, prepare_data, prepare_model, seed_everything
    from omni_grpo.types import GRPOBatch

    path = write_config(tmp_path, "ddp", {"run": {"dir": str(tmp_path / "run")}})
    cfg = load_config(path, ["data.synthetic.n_train=8", "data.synthetic.n_eval=2", *overrides])
    run_dir = Path(cfg.run.dir)
    vl_dir, _ = prepare_model(cfg.model, run_dir)
    data = prepare_data(cfg.data, run_dir)
    builder = PromptBuilder(vl_dir, data)
    dataset = OmniDataset(data.train, data.root, builder)
    eos = builder.tokenizer.eos_token_id
    seed_everything(0)
    local = create_backend("torch", cfg.model, cfg.trainer, cfg.algo, pad_token_id=eos)
    engine = EmbeddedEngine(local.policy, [eos], banned_token_ids=media_token_ids(local.policy))
    # five prompts (an odd count: the shards differ in size) of all three modalities
    prompts = [dataset.load(i) for i in range(5)]
    groups = engine.generate(prompts, 4, cfg.rollout.sampling)
    # advantages of a group with signal in every row (what the loop computes from rewards)
    rewards = torch.rand(5, 4, generator=torch.Generator().manual_seed(0))
    advantages = group_advantages(rewards, 4)
    batch = GRPOBatch(groups, advantages, temperature=1.0)

    plan = plan_run(cfg)
    assert plan.world_size == 2
    trainers, pg, setups = start_trainers(cfg, plan, run_dir, eos)
    try:
        infos = trainers.get(setups, range(2), "start-up")
        group = RayTrainerGroup(trainers, plan, 1 << 20, infos[0]["layout"])
        local.load_trainable_state(group.trainable_state())  # LoRA: rank 0's random A
        want = local.step(batch)
        want_w = local.trainable_state()
        got = group.step(batch)
        got_w = group.trainable_state()
        rank1_w = trainers.get([trainers.handles[1].trainable_state.remote()], [1], "state")[0]
        names, layout = group.weights_for_sync()
        streamed = dict(names)
    finally:
        trainers.kill()
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(pg)
    assert isinstance(trainers, ActorSet) and layout == "hf_memory"
    for key in ("loss", "pg_loss", "grad_norm", "response_tokens"):
        assert got[key] == pytest.approx(want[key], abs=1e-5), (key, got[key], want[key])
    assert set(got_w) == set(want_w)
    worst = max(float((got_w[k] - want_w[k]).abs().max()) for k in want_w)
    print(
        f"2-rank vs 1-process: worst weight diff {worst:.2e}, loss {got['loss']!r} vs {want['loss']!r}"
    )
    assert worst <= 1e-5, worst
    assert all(torch.equal(got_w[k], rank1_w[k]) for k in got_w)  # DDP keeps the ranks equal
    return {"local": local, "want_w": want_w, "streamed": streamed}


def test_two_rank_ddp_step_equals_one_process(tmp_path: Path) -> None:
    """Loss, grad norm and updated weights of 2-rank DDP equal one process within 1e-5 (fp32)."""
    out = _two_rank_vs_one_process(tmp_path, [])
    assert set(out["streamed"]) >= {k for k in out["want_w"] if not k.startswith("model.audio")}


def test_two_rank_lora_step_equals_one_process(tmp_path: Path) -> None:
    """trainer.lora on the data-parallel path (issue 21): the ranks start from rank 0's adapters,
    step to the one-process adapters within 1e-5, and rank 0 streams the merged W + scale*BA of
    the adapted tensors only, under their base names (what the rollout actors load)."""
    from omni_grpo.models.lora import is_adapter_name

    lora = "trainer.lora={rank: 4, alpha: 8, targets: [attention, experts, visual, lm_head]}"
    out = _two_rank_vs_one_process(tmp_path, [lora, "trainer.lr=1e-3"])
    assert out["want_w"] and all(is_adapter_name(n) for n in out["want_w"])
    merged, _ = out["local"].weights_for_sync()
    assert set(out["streamed"]) == set(merged)
    assert not any(is_adapter_name(n) or ".base_layer" in n for n in merged)
    worst = max(float((out["streamed"][k] - merged[k]).abs().max()) for k in merged)
    assert worst <= 1e-5, worst


@pytest.mark.parametrize("sync_mode", ["disk", "distributed"])
def test_sglang_engine_against_launched_fake_servers(tmp_path: Path, sync_mode: str) -> None:
    from omni_extract import names as omni_names
    from omni_grpo.run.checkpoint import latest_checkpoint, load_checkpoint
    from omni_grpo.testing.sync import ServerSideReceivers

    run = tmp_path / "run"
    receive = tmp_path / "received"
    cfg = write_config(
        tmp_path,
        "sglang-ray",
        {
            "run": {"dir": str(run), "steps": 2, "save_every": 0, "plots": False},
            "eval": {"every": 0, "max_samples": 2},
            "data": {"synthetic": {"n_train": 8, "n_eval": 2}},
            "trainer": {"world_size": 1, "warmup": None},
            "rollout": {
                "engine": "sglang-omni",
                "prompts_per_step": 2,
                "n_samples": 2,
                "embedded": {"actors": 0},
                "sglang": {
                    "sync_mode": sync_mode,
                    "launch": {
                        "servers": 2,
                        "kind": "fake",
                        "gpus_per_server": 0,
                        "cpus_per_server": 0.1,
                        "extra_args": ["--receive-dir", str(receive)],
                    },
                },
            },
        },
    )
    res = CliRunner().invoke(main, ["train", "--config", str(cfg), "--no-progress"])
    assert res.exit_code == 0, res.output
    records = metrics(run)
    assert [r["step"] for r in records] == [1, 2]  # no eval: no step-0 baseline row
    assert all(r["weight_sync/tensors"] > 0 for r in records)
    for i in range(2):
        log = (run / "logs" / f"server-{i}.log").read_text()
        assert "fake sglang-omni server at http://" in log
    _, weights, _, _ = load_checkpoint(latest_checkpoint(run))
    want = dict(omni_names.to_server_tensors(weights.items(), "hf_memory", towers="skip"))
    if sync_mode == "disk":
        from omni_grpo.testing.sync import read_hub_tensors

        got = read_hub_tensors(run / "weight_sync" / "step-2")
        assert set(got) == set(want)
        assert all(torch.equal(got[k], want[k].to(got[k].dtype)) for k in want)
        return
    (group,) = [p.name for p in receive.iterdir()]
    # the last push (step-2) is the last bucket: the tiny model fits one 512 MiB bucket
    received = ServerSideReceivers([], receive).received(group, slice(-1, None))
    assert sorted(received) == [1, 2]  # one thinker rank per server, rank offsets 1 and 2
    for rank, got in received.items():
        assert set(got) == set(want), rank
        assert all(torch.equal(got[k], want[k].to(got[k].dtype)) for k in want), rank


@pytest.mark.parametrize("engine", ["embedded", "sglang-omni"])
def test_one_step_ahead_on_ray(tmp_path: Path, engine: str) -> None:
    """``rollout.max_staleness: 1`` on the Ray paths: the trainer as a Ray actor with embedded
    rollout actors, or with the sglang-omni engine against a launched fake server. Step 1 is
    on-policy; a rollout actor serves one call at a time, so its later batches are exactly one
    version old; a server's in-flight samples may finish under the new weights (0 or 1 old)."""
    run = tmp_path / "run"
    rollout: dict[str, Any] = {"max_staleness": 1, "prompts_per_step": 2, "n_samples": 2}
    if engine == "embedded":
        rollout["embedded"] = {"actors": 1}
    else:
        rollout |= {
            "engine": "sglang-omni",
            "embedded": {"actors": 0},
            "sglang": {
                "sync_mode": "disk",
                "launch": {"servers": 1, "kind": "fake", "gpus_per_server": 0},
            },
        }
    cfg = write_config(
        tmp_path,
        f"ahead-{engine}",
        {
            "run": {"dir": str(run), "steps": 3, "save_every": 0, "plots": False},
            "eval": {"every": 0},
            "data": {"synthetic": {"n_train": 8, "n_eval": 2}},
            "trainer": {"world_size": 1, "warmup": None},
            "rollout": rollout,
            "algo": {"tis": {"enabled": True, "mode": "icepop"}},
        },
    )
    res = CliRunner().invoke(main, ["train", "--config", str(cfg), "--no-progress"])
    assert res.exit_code == 0, res.output
    records = metrics(run)
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert r["staleness/frac_over_bound"] == 0.0
        assert r["staleness/frac_0"] + r["staleness/frac_1"] == pytest.approx(1.0)
    assert records[0]["staleness/frac_0"] == 1.0
    if engine == "embedded":
        assert [r["staleness/frac_1"] for r in records[1:]] == [1.0, 1.0]
    else:
        assert any(r["staleness/frac_1"] > 0 for r in records[1:])


class _Raises:
    """An actor whose method raises, logging first (as the real actors do, into its file)."""

    def __init__(self, log_path: str) -> None:
        from omni_grpo.ray.actors import log_to_file

        log_to_file(log_path, "test actor")

    def step(self) -> None:
        import logging

        logging.getLogger("test").error("about to fail: the last line before the error")
        raise ValueError("boom in the step")


def test_an_exception_in_an_actor_is_one_line_with_its_log(tmp_path: Path) -> None:
    from omni_grpo.ray.driver import ActorFailure, ActorSet

    log = tmp_path / "logs" / "trainer-0.log"
    actors = ActorSet(
        "trainer rank", [ray.remote(_Raises).options(num_cpus=0.1).remote(str(log))], [log]
    )
    try:
        with pytest.raises(ActorFailure) as err:
            actors.get([actors.handles[0].step.remote()], [0], "step")
    finally:
        actors.kill()
    head, *rest = str(err.value).splitlines()
    assert head.startswith("trainer rank 0 raised during step: ValueError: boom in the step")
    assert str(log) in head and any("about to fail" in line for line in rest)


class _Peer:
    """A rank whose step either raises as a peer of a killed rank does (its collective broken)
    after ``raise_after`` s, or dies (process exit, as under kill -9) after ``die_after`` s."""

    def step(self, raise_after: float | None, die_after: float | None) -> None:
        import os
        import time

        if raise_after is not None:
            time.sleep(raise_after)
            raise RuntimeError("gloo: Read error: Connection reset by peer")
        if die_after is not None:
            time.sleep(die_after)
            os._exit(1)
        time.sleep(60)  # blocked in a collective with a rank that raised


@pytest.mark.parametrize("peer_dies", [True, False])
def test_a_broken_collective_is_blamed_on_the_rank_that_died(
    tmp_path: Path, peer_dies: bool
) -> None:
    """The CI race of the killed-rank run: rank 0's broken collective reaches the driver before
    Ray has marked the killed rank 1 dead; the error names the death, the cause. When no peer
    dies, the exception itself is the failure (after the grace for news of a death)."""
    from omni_grpo.ray.driver import ActorFailure, ActorSet

    logs = [tmp_path / f"trainer-{r}.log" for r in range(2)]
    actors = ActorSet(
        "trainer rank", [ray.remote(_Peer).options(num_cpus=0.1).remote() for _ in range(2)], logs
    )
    refs = [
        actors.handles[0].step.remote(0.0, None),
        actors.handles[1].step.remote(None, 1.0 if peer_dies else None),
    ]
    try:
        with pytest.raises(ActorFailure) as err:
            actors.get(refs, [0, 1], "step")
    finally:
        actors.kill()
    head = str(err.value).splitlines()[0]
    if peer_dies:
        assert head.startswith("trainer rank 1 died during step"), head
    else:
        assert head.startswith("trainer rank 0 raised during step: RuntimeError: gloo"), head


# ------------------------------------------------------------------ issue 30: kills and signals
def _fault_config(tmp_path: Path, name: str, run: Path, steps: int) -> Path:
    return write_config(
        tmp_path,
        name,
        {
            "run": {"dir": str(run), "steps": steps, "save_every": 2, "plots": False},
            "eval": {"every": 0},
            "data": {"synthetic": {"n_train": 8, "n_eval": 2}},
            # one trainer rank and one rollout actor: a Ray run at its cheapest (2 actors)
            "trainer": {"warmup": None, "world_size": 1},
            "rollout": {"n_samples": 4, "prompts_per_step": 4, "embedded": {"actors": 1}},
        },
    )


def test_a_ray_run_stopped_at_several_moments_keeps_every_row_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One Ray run (a trainer rank and a rollout actor), stopped twice, resumed each time:

    1. the rollout actor is killed during step 3's weight sync: the run stops naming it, after
       checkpointing step 3 with its metrics row (before issue 30 that row was never written);
    2. ``omni-grpo train --resume`` as its own process (a driver of this module's Ray) writes the
       row, trains on; a second ``train`` into its directory is refused naming its pid; SIGTERM
       stops it in one line, exit status 143, without the native stack dump Ray's handler printed.

    The last resume finishes: ``metrics.jsonl`` holds steps 1..6, each exactly once. (A kill at
    the checkpoint or the update goes back to the last checkpoint like any kill: the one-process
    test covers those moments, ``test_tiny_ray_survives_a_killed_rank_and_learns`` a rank.)"""
    import subprocess
    import sys

    from omni_grpo.run.checkpoint import latest_checkpoint
    from omni_grpo.testing.interrupts import at_moment, kill_actor

    run = tmp_path / "run"
    cfg = _fault_config(tmp_path, "stops", run, 6)
    args = ["train", "--config", str(cfg), "--no-progress"]

    killer = kill_actor(run, "rollout-0.log", "rollout actor 0")
    with at_moment(monkeypatch, "sync", 3, killer, run) as hit:
        first = CliRunner().invoke(main, args)
    errors = [line for line in first.output.splitlines() if line.startswith("Error:")]
    assert hit.fired and first.exit_code == 1 and len(errors) == 1, first.output
    assert errors[0].startswith("Error: rollout actor 0 died during"), errors
    assert "Traceback" not in first.output
    assert latest_checkpoint(run).name == "step_000003"
    assert [r["step"] for r in metrics(run)] == [1, 2]

    exe = Path(sys.executable).parent / "omni-grpo"
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    proc = subprocess.Popen(
        [str(exe), *args, "--resume"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 600
        while not any(r["step"] >= 4 for r in _records(run)):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no step 4 in 600 s"
            time.sleep(0.2)
        busy = CliRunner().invoke(main, [*args, "--resume"])
        assert busy.exit_code == 1, busy.output
        assert f"is in use by pid {proc.pid} on " in busy.output, busy.output
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "SIGTERM received" not in err and "PC: @" not in err and "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("Error: stopped by SIGTERM after step "), last
    assert "rerun with --resume" in last

    last_run = CliRunner().invoke(main, [*args, "--resume"])
    assert last_run.exit_code == 0, last_run.output
    records = metrics(run)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert records[2]["weight_sync/tensors"] > 0 and "reward_mean" in records[2]


def _records(run: Path) -> list[dict[str, Any]]:
    from omni_grpo.run.metrics import read_metrics

    return read_metrics(run)


class _Hog:
    """Holds CPUs of the cluster, as another job would."""

    def ready(self) -> bool:
        return True


def test_an_actor_left_pending_stops_the_run_at_the_placement_deadline(tmp_path: Path) -> None:
    """The layout fits the cluster, but its CPUs are taken: the rollout actor is never placed.
    The run stops after ray.start_timeout_s naming the field (before issue 30 it waited for the
    whole start-up deadline, 4 x ray.start_timeout_s, without saying why)."""
    hog = ray.remote(_Hog).options(num_cpus=1.6).remote()  # 0.4 of 2 left: the trainer fits
    try:
        ray.get(hog.ready.remote(), timeout=120)
        run = tmp_path / "run"
        cfg = _fault_config(tmp_path, "pending", run, 2)
        start = time.monotonic()
        res = CliRunner().invoke(
            main, ["train", "--config", str(cfg), "--set", "ray.start_timeout_s=5"]
        )
        took = time.monotonic() - start
    finally:
        ray.kill(hog)
    assert res.exit_code == 2, res.output
    last = res.output.strip().splitlines()[-1]
    assert last.startswith("Error: rollout actor [0] still not placed by Ray after 5s"), last
    assert "rollout.embedded.cpus_per_actor" in last and "ray.start_timeout_s" in last
    assert took < 120, took


class _SlowStart:
    """An actor whose constructor takes a while (loading a model on a busy machine)."""

    def __init__(self, seconds: float) -> None:
        time.sleep(seconds)

    def ready(self) -> bool:
        return True


def test_a_placed_actor_still_starting_is_not_taken_for_a_pending_one() -> None:
    """Ray says PENDING_CREATION until ``__init__`` returns; the placement deadline must only
    stop actors that no node took (no worker process yet), not slow starters."""
    from omni_grpo.ray.driver import ActorSet
    from ray._private import state

    actors = ActorSet("trainer rank", [ray.remote(_SlowStart).options(num_cpus=0.1).remote(15.0)])
    try:
        actor_id = actors.handles[0]._actor_id.hex()
        deadline = time.monotonic() + 120
        while not state.actors(actor_id=actor_id).get("Pid"):  # a worker took it: placed
            assert time.monotonic() < deadline, "the actor got no worker in 120 s"
            time.sleep(0.2)
        info = state.actors(actor_id=actor_id)
        print("state while its constructor runs:", info["State"])
        placed_by = (time.monotonic() - 1.0, 1.0)  # the deadline has passed
        refs = [actors.handles[0].ready.remote()]
        assert actors.get(refs, [0], "start-up", 120, placed_by) == [True]
    finally:
        actors.kill()

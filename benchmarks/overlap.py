"""Throughput of rollouts overlapped with training (``rollout.max_staleness: 1``) as a ratio to the
on-policy loop (``0``) on ``examples/tiny.yaml``, per pair: ``sglang``, ``sglang_trainer_actor``,
``sglang_trainer_pinned`` (not by default) and ``ray``: docs/benchmarks.md, "Overlapped rollouts".

    uv run python benchmarks/overlap.py [--steps 24] [--pairs sglang,sglang_trainer_actor,ray]
        [--work DIR] [--set trainer.device=cuda ...]
"""

import contextlib
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import harness
from omni_grpo.config import load_config
from omni_grpo.testing.interrupts import actor_pid
from omni_grpo.trainer import prepare_model, train

TOKENS_PER_SAMPLE = 2  # a letter and <|im_end|> (the fake's letter answers)
RAY_PROBE_TOKENS = (3, 12)  # the recipe's answer budget, and a longer one (ray pair calibration)
RAY_MAX_TOKENS = 64
PHASES = {"time/step_s": "step", "time/rollout_s": "rollout", "time/train_s": "train"}
PHASES["weight_sync/seconds"] = "sync"  # metrics.jsonl key -> name in the output
EXTRA = ("staleness/mean", "train_rollout_logprob_abs_diff")
SGLANG = ["rollout.engine=sglang-omni", "rollout.sglang.sync_mode=disk"]
TIS = "algo.tis={enabled: true, mode: truncate, clip_high: 2.0}"


def recipe(config: str, run_dir: Path, steps: int, overrides: list[str]) -> Any:
    """``examples/<config>`` in ``run_dir`` with the shared tiny model: no saves, plots or eval."""
    model = run_dir.parent / "model"
    sets = [f"run.dir={run_dir}", f"run.steps={steps}", "run.plots=false", "run.save_every=0"]
    sets += ["run.tensorboard=false", "trainer.warmup=null", "eval.every=0"]
    sets += [f"model.omni_checkpoint={model / 'omni'}", f"model.extracted_dir={model / 'vl'}"]
    sets += [f"model.audio_dir={model / 'audio'}", *overrides]
    return load_config(harness.REPO / "examples" / config, sets)


def run(config: str, run_dir: Path, steps: int, overrides: list[str]) -> dict[str, Any]:
    """One training run: samples/s and each phase's mean (``steady``: without step 1)."""
    cfg = recipe(config, run_dir, steps, overrides)
    train(cfg, progress=False)
    records = [r for r in harness.train_metrics(run_dir) if r["step"] > 0]
    samples = cfg.rollout.prompts_per_step * cfg.rollout.n_samples

    def rate(rows: list[dict]) -> float:
        return round(samples * len(rows) / sum(r["time/step_s"] for r in rows), 3)

    steady = harness.means(records[1:], PHASES)
    out = {"samples_per_s": rate(records), "steady_samples_per_s": rate(records[1:])}
    out["phases_s"] = {name: steady.get(k, float("nan")) for k, name in PHASES.items()}
    return out | harness.means(records, EXTRA)


@contextlib.contextmanager
def fake_server(work: Path, delay: float) -> Iterator[str]:
    """The fake sglang-omni server (real HTTP, the 0.1.9 contract) in its own process, as a real
    one: its request handling shares no GIL with the trainer, only the cores. Yields its URL."""
    cmd = [sys.executable, "-m", "omni_grpo.testing.fake_server", "--token-delay-s", str(delay)]
    cmd += ["--model-path", str(work / "model" / "omni")]
    with open(work / "fake_server.log", "ab") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
        try:
            line = proc.stdout.readline()  # type: ignore[union-attr]  # "fake ... at URL (...)"
            if " at http" not in line:
                raise RuntimeError(f"fake server did not start: {line!r} (see {log.name})")
            yield line.split(" at ", 1)[1].split()[0]
        finally:
            proc.terminate()
            proc.wait(60)


def sglang_pair(work: Path, steps: int, extra: list[str], measure: bool = True) -> dict[str, Any]:
    """The sglang engine against the fake, its per-token delay CHOSEN so that the whole on-policy
    rollout (fixed cost + generation) takes one train step: a probe run measures the train step
    and the rollout's fixed cost, a second short run checks the choice and moves the delay by the
    gap left (the fake's requests overlap each other and the client's decoding)."""

    def sets(name: str, url: str, staleness: int) -> list[str]:
        out = [f"rollout.sglang.urls=[{url}]", f"rollout.sglang.sync_dir={work / name / 'sync'}"]
        return [*SGLANG, *out, f"rollout.max_staleness={staleness}", TIS, *extra]

    def on(name: str, url: str, staleness: int, n: int) -> dict[str, Any]:
        return run("tiny.yaml", work / name, n, sets(name, url, staleness))

    prep = recipe("tiny.yaml", work / "prep", 1, sets("prep", "http://unused", 0))
    prepare_model(prep.model, work / "prep")
    probe_delay = 0.01
    with fake_server(work, probe_delay) as url:
        probe = on("calibrate", url, 0, 4)["phases_s"]
    fixed_s = max(0.0, probe["rollout"] - TOKENS_PER_SAMPLE * probe_delay)
    first = delay = max(0.0, probe["train"] - fixed_s) / TOKENS_PER_SAMPLE
    with fake_server(work, delay) as url:
        check = on("calibrate-2", url, 0, 4)["phases_s"]
    delay = max(0.0, delay + (check["train"] - check["rollout"]) / TOKENS_PER_SAMPLE)
    calibration = {"train_s": probe["train"], "rollout_fixed_s": round(fixed_s, 4)}
    calibration["fixed_exceeds_train"] = fixed_s > probe["train"]
    calibration["first_token_delay_s"] = round(first, 4)
    calibration["first_rollout_over_train"] = round(check["rollout"] / check["train"], 3)
    out: dict[str, Any] = {"token_delay_s": round(delay, 4), "calibration": calibration}
    for staleness in (0, 1) if measure else ():
        with fake_server(work, delay) as url:
            out[f"max_staleness_{staleness}"] = on(f"staleness-{staleness}", url, staleness, steps)
    return out


@contextlib.contextmanager
def trainer_on_its_own_core(run_dir: Path) -> Iterator[None]:
    """Core 0 for the trainer actor, the other cores for everything else (this driver, the fake,
    Ray's processes inherit this affinity): what separate hardware gives a real run; unpinned, on
    2 cores, the ratio is bimodal with where the scheduler puts the trainer. Linux only."""
    everything = os.sched_getaffinity(0)
    os.sched_setaffinity(0, everything - {0})
    done = threading.Event()

    def pin() -> None:
        while not done.is_set():
            with contextlib.suppress(OSError, IndexError):  # no log, or no pid in it yet
                pid = actor_pid(run_dir, "trainer-0.log", "trainer rank 0")
                return os.sched_setaffinity(pid, {0})
            time.sleep(0.05)

    watcher = threading.Thread(target=pin, daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join(5)
        os.sched_setaffinity(0, everything)


def sglang_actor_pair(work: Path, steps: int, delay: float, extra: list, pin: bool = False) -> dict:
    """The sglang pair with the trainer as ONE Ray actor and a launched fake (the scale path's
    topology): the client's HTTP work no longer shares a GIL with training."""
    out: dict[str, Any] = {"token_delay_s": round(delay, 4), "trainer_pinned": pin}
    launch = "{servers: 1, kind: fake, gpus_per_server: 0, cpus_per_server: 0.5, "
    launch += f"extra_args: [--token-delay-s, '{delay}']}}"
    for staleness in (0, 1):
        name = f"sglang-actor{'-pinned' if pin else ''}-{staleness}"
        sync = f"rollout.sglang.sync_dir={work / name / 'sync'}"
        sets = [f"rollout.sglang.launch={launch}", sync, f"rollout.max_staleness={staleness}", TIS]
        sets += ["ray.cpus_per_trainer=0.5", *extra]
        with trainer_on_its_own_core(work / name) if pin else contextlib.nullcontext():
            out[f"max_staleness_{staleness}"] = run("tiny.yaml", work / name, steps, SGLANG + sets)
    return out


def ray_pair(work: Path, steps: int, extra: list[str]) -> dict[str, Any]:
    """One trainer rank and one embedded rollout actor, the answer budget CHOSEN so that the
    on-policy rollout takes one train step (on the recipe's <= 3 tokens it is half of it: overlap
    could win ~1.45x at most): two short runs at two budgets give its fixed and per-token cost."""
    trainers = actors = 1

    def on(name: str, staleness: int, n: int, tokens: int) -> dict[str, Any]:
        sets = [f"rollout.max_staleness={staleness}", f"trainer.world_size={trainers}"]
        sets += [f"rollout.embedded.actors={actors}", f"rollout.sampling.max_new_tokens={tokens}"]
        return run("tiny-ray.yaml", work / name, n, [*sets, *extra])

    short, long = RAY_PROBE_TOKENS
    probe_short = on("ray-calibrate-short", 0, 4, short)["phases_s"]
    probe_long = on("ray-calibrate-long", 0, 4, long)["phases_s"]
    per_token = max(1e-6, (probe_long["rollout"] - probe_short["rollout"]) / (long - short))
    train_s = (probe_short["train"] + probe_long["train"]) / 2
    tokens = int(round(short + (train_s - probe_short["rollout"]) / per_token))
    tokens = max(1, min(RAY_MAX_TOKENS, tokens))
    ratio = probe_short["rollout"] / probe_short["train"]
    calibration = {"recipe_max_new_tokens": short, "recipe_rollout_over_train": round(ratio, 3)}
    calibration |= {"rollout_s_per_token": round(per_token, 4), "train_s": round(train_s, 4)}
    out = {"trainer_ranks": trainers, "rollout_actors": actors, "max_new_tokens": tokens}
    out["calibration"] = calibration
    for staleness in (0, 1):
        out[f"max_staleness_{staleness}"] = on(f"ray-{staleness}", staleness, steps, tokens)
    return out


def ratios(pair: dict[str, Any]) -> dict[str, Any]:
    """Overlapped over on-policy samples/s, and what the reader checks them against: on-policy
    rollout / train, and the ratio if the shorter of the two were hidden completely."""
    zero, one = pair["max_staleness_0"], pair["max_staleness_1"]
    p = zero["phases_s"]
    ideal = p["step"] / (p["step"] - min(p["rollout"], p["train"]))
    out = {"ratio": round(one["samples_per_s"] / zero["samples_per_s"], 3)}
    out["steady_ratio"] = round(one["steady_samples_per_s"] / zero["steady_samples_per_s"], 3)
    out["rollout_over_train"] = round(p["rollout"] / p["train"], 3)
    return out | {"ideal_steady_ratio": round(ideal, 3)} | pair


if __name__ == "__main__":
    ap = harness.parser(__doc__, steps=24, pairs="sglang,sglang_trainer_actor,ray", work=Path)
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="for every run")
    args = ap.parse_args()
    extra = args.overrides  # e.g. trainer.device=cuda or trainer.backend=megatron
    os.environ.setdefault("OMNI_GRPO_TORCH_THREADS", "1")
    work = args.work or Path(tempfile.mkdtemp(prefix="overlap-bench-"))
    t0, load_before = time.perf_counter(), [round(x, 2) for x in os.getloadavg()]
    result: dict[str, Any] = {"benchmark": "overlap", "steps": args.steps, "overrides": extra}
    pairs = set(args.pairs.split(","))
    sglang = sglang_pair(work, args.steps, extra, measure="sglang" in pairs)
    result["sglang"] = ratios(sglang) if "sglang" in pairs else sglang
    for name, pin in (("sglang_trainer_actor", False), ("sglang_trainer_pinned", True)):
        if name in pairs:
            pair = sglang_actor_pair(work, args.steps, sglang["token_delay_s"], extra, pin)
            result[name] = ratios(pair)
    if "ray" in pairs:
        result["ray"] = ratios(ray_pair(work, args.steps, extra))
    for pair in ("sglang", "sglang_trainer_actor", "sglang_trainer_pinned", "ray"):
        prefix = "" if pair == "sglang" else pair + "_"
        for key in ("ratio", "steady_ratio"):
            result[prefix + key] = result.get(pair, {}).get(key)
    result |= {"target_ratio": 1.6, "limit_ratio": 2.0}
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    result |= {"cpus": os.cpu_count(), "load_avg_before": load_before}
    result["load_avg_after"] = [round(x, 2) for x in os.getloadavg()]
    result["torch_threads"] = int(os.environ["OMNI_GRPO_TORCH_THREADS"])
    harness.emit("overlap", result, args.save)

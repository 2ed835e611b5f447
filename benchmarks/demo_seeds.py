"""Benchmark: does the embedded demo learn for every seed and thread count, and at what cost?

Per seed x ``OMNI_GRPO_TORCH_THREADS`` one ``omni-grpo train`` of ``examples/tiny.yaml``, each
``--baseline`` run right after it: final accuracies, collapses, pass/fail, wall and CPU time and
their ratios. Minutes per run; the method: docs/benchmarks.md, "Methods".

    uv run python benchmarks/demo_seeds.py [--seeds 0-4] [--threads 1,2] [--baseline main]
        [--set rollout.max_staleness=1 ...] [--work DIR: keep the run directories]
"""

import contextlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import harness
import yaml

REPO = harness.REPO
MODALITIES = ("image", "audio", "video")
TARGET = 0.9
WINDOW = 5  # training-reward steps averaged by the between-evaluations collapse check

# The baselines as overrides of the current examples/tiny.yaml.
OLD_LR = ("trainer.lr_schedule.kind=constant", "trainer.betas=[0.9, 0.999]")
BASELINES: dict[str, tuple[str, ...]] = {
    # the recipe on main at cff798f: the exact KL at a constant learning rate, Adam beta2 0.999
    "main": OLD_LR,
    # the demo issue 16 was filed against (main at 46b1011): no KL anchor, 200 steps, evaluation
    # every 25, the tiny model and data pinned to seed 0
    "issue16": ("algo.kl_coef=0.0", "algo.kl_type=k1", *OLD_LR, "run.steps=200", "eval.every=25")
    + ("model.make_tiny.seed=0", "data.synthetic.seed=0"),
}


def parse_ints(text: str) -> list[int]:
    """``0-4`` or ``0,2,3``; ``''`` is none."""
    out: list[int] = []
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def eval_history(records: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    key = "eval/accuracy/{}".format
    return {m: [(r["step"], float(r[key(m)])) for r in records if key(m) in r] for m in MODALITIES}


def collapses(records: list[dict], chance: dict[str, float], warn_after: int) -> list[dict]:
    """Every post-learning collapse, per modality after its first held-out evaluation >= TARGET:
    a later evaluation below it; a stretch where the mean training reward of the last ``WINDOW``
    logged steps falls below the midpoint between chance and TARGET (a dip between evaluations);
    or ``no_signal_steps/<m>`` reaching ``warn_after`` (the trainer's own warning). The first
    step of each stretch, with its worst value."""
    events: list[dict[str, Any]] = []
    history = eval_history(records)
    for m in MODALITIES:
        learned = next((step for step, v in history[m] if v >= TARGET), None)
        if learned is None:
            continue
        later = [(step, v) for step, v in history[m] if step > learned and v < TARGET]
        events += [{"modality": m, "kind": "eval", "step": step, "value": v} for step, v in later]
        floor = (chance.get(m, 0.5) + TARGET) / 2
        window: list[float] = []
        open_event: dict[str, Any] | None = None
        for record in records:
            reward = record.get(f"reward/{m}")
            if reward is None or record["step"] <= learned:
                continue
            window = [*window, float(reward)][-WINDOW:]
            mean = statistics.mean(window)
            if len(window) < WINDOW or mean >= floor:
                open_event = None
                continue
            if open_event is None:
                open_event = {"modality": m, "kind": "train_reward", "step": record["step"]}
                events.append(open_event)
            open_event["value"] = min(open_event.get("value", math.inf), round(mean, 3))
        key = f"no_signal_steps/{m}"
        lost = [r["step"] for r in records if r["step"] > learned and r.get(key, 0) >= warn_after]
        if warn_after and lost:
            events.append({"modality": m, "kind": "no_signal", "step": lost[0]})
    return events


def run_one(config: Path, work: Path, name: str, seed: int, threads: int, extra: tuple) -> dict:
    """One ``omni-grpo train`` child: exit, wall and CPU time (``wait4``: comparable under load),
    final and learned-at accuracies, collapses."""
    run_dir = work / name
    sets = [f"run.dir={run_dir}", f"run.seed={seed}", "run.plots=false", "run.tensorboard=false"]
    cmd = [sys.executable, "-m", "omni_grpo.cli", "train", "--config", str(config), "--no-progress"]
    cmd += [a for o in (*sets, *extra) for a in ("--set", o)]
    env = {**os.environ, "OMNI_GRPO_TORCH_THREADS": str(threads)}
    load_before = os.getloadavg()[0]
    with harness.timed() as wall, open(work / f"{name}.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        except KeyboardInterrupt:  # stopped from outside: end the child, report what finished
            proc.terminate()
            proc.wait()
            raise
    code = os.waitstatus_to_exitcode(status)
    out: dict[str, Any] = {"seed": seed, "threads": threads, "exit_code": code}
    out |= {"wall_s": round(wall.s, 1), "cpu_s": round(usage.ru_utime + usage.ru_stime, 1)}
    out["load_avg_1m"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    if code != 0:
        out["error"] = (work / f"{name}.log").read_text().strip().splitlines()[-1:]
        return out
    records = harness.train_metrics(run_dir)
    history = eval_history(records)
    final = {m: history[m][-1][1] for m in MODALITIES if history[m]}
    learned = {m: next((s for s, v in history[m] if v >= TARGET), None) for m in MODALITIES}
    warn = yaml.safe_load((run_dir / "config.yaml").read_text()).get("run", {})
    inverse: dict[str, list[float]] = {m: [] for m in MODALITIES}  # 1 / #choices per eval row
    for line in (run_dir / "data" / "eval.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row.get("modality") in inverse and row.get("choices"):
            inverse[row["modality"]].append(1.0 / len(row["choices"]))
    chance = {m: statistics.mean(v) for m, v in inverse.items() if v}
    found = collapses(records, chance, int(warn.get("collapse_warn_steps", 0)))
    passes = all(final.get(m, 0.0) >= TARGET for m in MODALITIES) and not found
    return out | {"final": final, "learned_at": learned, "collapses": found, "pass": passes}


def sweep(order: list[tuple[str, int, int]], configs: dict, work: Path | None) -> tuple[dict, bool]:
    """:func:`run_one` for each (kind, seed, threads) with ``configs[kind]`` (config, overrides);
    SIGTERM or Ctrl-C ends the sweep, and what finished is still reported (``interrupted``)."""
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in configs}
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    with contextlib.ExitStack() as stack:
        tmp = work or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="seeds-")))
        tmp.mkdir(parents=True, exist_ok=True)
        try:
            for kind, s, t in order:
                config, extra = configs[kind]
                runs[kind].append(run_one(config, tmp, f"{kind}_s{s}_t{t}", s, t, extra))
                harness.progress({kind: runs[kind][-1]})
        except KeyboardInterrupt:
            return runs, True
    return runs, False


def record(args: Any, order: list, runs: dict, interrupted: bool, **facts: Any) -> dict[str, Any]:
    """What every sweep reports (``facts`` after its config); ``all_pass``: of the first kind."""
    out = {"config": str(args.config), **facts, "cpus": os.cpu_count(), "target": TARGET}
    first = next(iter(runs.values()))
    out |= {"interrupted": interrupted, "planned_runs": len(order)}
    return out | {"all_pass": bool(first) and all(r.get("pass") for r in first)}


def summarise(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if r.get("exit_code") == 0]
    return round(statistics.mean(values), 1) if values else None


def passed(runs: list[dict[str, Any]]) -> str:
    return f"{sum(bool(r.get('pass')) for r in runs)}/{len(runs)}"


if __name__ == "__main__":
    ap = harness.parser(__doc__, config=REPO / "examples" / "tiny.yaml", seeds="0-4", threads="1,2")
    harness.add_options(ap, baseline_seeds="0", baseline_threads="1,2", work=Path)  # '': none
    ap.add_argument("--baseline", choices=sorted(BASELINES), default="main")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="recipe runs only")
    args = ap.parse_args()
    seeds, threads = parse_ints(args.seeds), parse_ints(args.threads)
    base_seeds, base_threads = parse_ints(args.baseline_seeds), parse_ints(args.baseline_threads)
    # threads-major (the fast thread count first: a stopped sweep still covers every seed), each
    # baseline run right after the recipe run of its seed and thread count (load drifts hit both)
    both = {(s, t) for s in base_seeds for t in base_threads}
    order = [(k, s, t) for t in threads for s in seeds for k in ("recipe", "baseline")]
    order = [(k, s, t) for k, s, t in order if k == "recipe" or (s, t) in both]
    configs = {"recipe": (args.config, tuple(args.overrides))}
    configs["baseline"] = (args.config, BASELINES[args.baseline])
    runs, interrupted = sweep(order, configs, args.work)
    by_threads: dict[str, Any] = {}
    for t in threads:
        recipe, baseline = ([r for r in kind if r["threads"] == t] for kind in runs.values())
        entry: dict[str, Any] = {"recipe_pass": passed(recipe)}
        for kind, rows in (("recipe", recipe), ("baseline", baseline)):
            entry |= {f"{kind}_{k}_mean": summarise(rows, k) for k in ("wall_s", "cpu_s")}
        for key in ("wall_s", "cpu_s"):
            a, b = entry[f"recipe_{key}_mean"], entry[f"baseline_{key}_mean"]
            entry[f"{key}_ratio"] = round(a / b, 3) if a and b else None
            for r in recipe:  # each seed's run against the baseline mean of its thread count
                if b and r.get("exit_code") == 0:
                    r[f"{key}_ratio"] = round(r[key] / b, 3)
        ratios = [r["wall_s_ratio"] for r in recipe if "wall_s_ratio" in r]
        by_threads[str(t)] = entry | {"wall_s_ratio_max": max(ratios) if ratios else None}
    base = {"baseline": args.baseline, "baseline_overrides": list(BASELINES[args.baseline])}
    out = record(args, order, runs, interrupted, **base, recipe_overrides=args.overrides)
    found = [(r, c) for r in runs["recipe"] for c in r.get("collapses", [])]
    out["collapses"] = [{"seed": r["seed"], "threads": r["threads"], **c} for r, c in found]
    harness.emit("demo_seeds", out | {"by_threads": by_threads, "runs": runs}, args.save)

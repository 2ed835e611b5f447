"""Wall time of the multi-process demo (``examples/tiny-ray.yaml``: local Ray, 2 trainer ranks, 2
rollout actors) against the one-process demo (``examples/tiny.yaml``), both from nothing in this
process. ``ratio`` = ray / baseline wall (issue 11 target: <= 1.5), with each run's final accuracy,
mean ``time/*`` per step, and the machine's load (on 2 cores the actors compete for them).

    uv run python benchmarks/tiny_ray.py [--steps 200] [--work DIR]
"""

import os
import tempfile
from pathlib import Path
from typing import Any

import harness
from omni_grpo.config import load_config
from omni_grpo.trainer import train

TIMES = ("time/step_s", "time/rollout_s", "time/train_s", "weight_sync/seconds")


def run(config: str, run_dir: Path, steps: int) -> dict[str, Any]:
    sets = [f"run.dir={run_dir}", f"run.steps={steps}", "run.plots=false"]
    cfg = load_config(harness.REPO / "examples" / config, sets)
    with harness.timed() as wall:
        result = train(cfg, progress=False)
    records = [r for r in harness.train_metrics(run_dir) if r["step"] > 0]
    out = {"wall_s": round(wall.s, 2), "steps": result.steps}
    out["final_eval"] = {k.rsplit("/", 1)[-1]: v for k, v in result.final_eval.items()}
    return out | {"mean_per_step": harness.means(records, TIMES)}


if __name__ == "__main__":
    args = harness.parser(__doc__, steps=200, work=Path).parse_args()
    os.environ.setdefault("OMNI_GRPO_TORCH_THREADS", "1")
    work = args.work or Path(tempfile.mkdtemp(prefix="tiny-ray-bench-"))
    baseline = run("tiny.yaml", work / "tiny", args.steps)
    ray_run = run("tiny-ray.yaml", work / "tiny-ray", args.steps)
    record = {"steps": args.steps, "baseline": baseline, "ray": ray_run}
    record |= {"ratio": round(ray_run["wall_s"] / baseline["wall_s"], 3), "target_ratio": 1.5}
    record |= {"cpus": os.cpu_count(), "load_avg": [round(x, 2) for x in os.getloadavg()]}
    record["torch_threads"] = int(os.environ["OMNI_GRPO_TORCH_THREADS"])
    harness.emit("tiny_ray", record, args.save)

"""Wall time of the multi-process demo (``examples/tiny-ray.yaml``) against the one-process demo
(``examples/tiny.yaml``), both run by ``omni_grpo.trainer.train`` in this process, one after the
other, from nothing (tiny checkpoint, extraction, synthetic media, warm-up, GRPO, evaluation).

* ``baseline``: ``tiny.yaml``, the trainer and the embedded engine in this process.
* ``ray``: ``tiny-ray.yaml``, the same recipe with this process as the driver: a local Ray, 2
  trainer ranks (torch backend, data-parallel over gloo) and 2 embedded rollout actors, and a
  weight broadcast to the actors after every step. Ray's start and the actors' start-up (each
  imports torch and loads the model) are counted.

``ratio`` = ray wall / baseline wall (issue 11 target: <= 1.5). Also printed: each run's final
held-out accuracy per modality, and the mean of its per-step ``time/*`` metrics, which show where
the time goes. On a shared 2-core machine the actors compete with each other for the cores (and
with whatever else runs), so read the numbers with the machine's load beside them
(``load_avg``).

    uv run python benchmarks/tiny_ray.py [--steps 200] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def run(config: str, run_dir: Path, steps: int) -> dict[str, object]:
    from omni_grpo.config import load_config
    from omni_grpo.trainer import train

    cfg = load_config(
        REPO / "examples" / config, [f"run.dir={run_dir}", f"run.steps={steps}", "run.plots=false"]
    )
    t0 = time.perf_counter()
    result = train(cfg, progress=False)
    wall = time.perf_counter() - t0
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps_ = [r for r in records if r["step"] > 0]
    times = {
        k: round(float(np.mean([r[k] for r in steps_ if k in r])), 4)
        for k in ("time/step_s", "time/rollout_s", "time/train_s", "weight_sync/seconds")
        if any(k in r for r in steps_)
    }
    return {
        "wall_s": round(wall, 2),
        "steps": result.steps,
        "final_eval": {k.rsplit("/", 1)[-1]: v for k, v in result.final_eval.items()},
        "mean_per_step": times,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--work", type=Path, default=None)
    args = parser.parse_args()
    os.environ.setdefault("OMNI_GRPO_TORCH_THREADS", "1")
    work = args.work or Path(tempfile.mkdtemp(prefix="tiny-ray-bench-"))
    baseline = run("tiny.yaml", work / "tiny", args.steps)
    ray_run = run("tiny-ray.yaml", work / "tiny-ray", args.steps)
    print(
        json.dumps(
            {
                "benchmark": "tiny_ray",
                "steps": args.steps,
                "baseline": baseline,
                "ray": ray_run,
                "ratio": round(ray_run["wall_s"] / baseline["wall_s"], 3),
                "target_ratio": 1.5,
                "cpus": os.cpu_count(),
                "load_avg": [round(x, 2) for x in os.getloadavg()],
                "torch_threads": int(os.environ["OMNI_GRPO_TORCH_THREADS"]),
            }
        )
    )


if __name__ == "__main__":
    main()

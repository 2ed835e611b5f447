"""Throughput of rollouts overlapped with training (``rollout.max_staleness: 1``) as a ratio to the
on-policy loop (``max_staleness: 0``), both run by ``omni_grpo.trainer.train`` in this process, one
after the other, on the same recipe (``examples/tiny.yaml``: tiny Qwen3-Omni thinker, image /
audio / video tasks, torch backend on the CPU).

* ``sglang``: the sglang-omni engine against the project's fake server in its own process
  (``omni_grpo.testing.fake_server``: ``FakeOmniServer``, real HTTP, the 0.1.9 contract: pause
  with ``retract``, disk weight updates, weight versions), answering letters. Its per-token delay
  is CHOSEN so that the server's generation of one batch takes as long as one training step (a
  calibration run measures the train time); the client's and the fake's own CPU work per batch
  (payload encoding, HTTP, decoding: ``rollout_fixed_s``) comes on top and, on a small machine,
  competes with training for the same cores. Rollout >= train is the case the issue asks about
  (verl-omni's Qwen3-Omni recipe: rollout ~75 % of a step); the ideal ratio is then
  (rollout + train) / max(rollout, train) <= 2x, less the weight sync (the servers pause for it)
  and the first step, which no run can overlap.
* ``ray`` (``--ray``): the embedded rollout actors of ``examples/tiny-ray.yaml`` (2 trainer ranks,
  2 rollout actors). Here rollout and training are both CPU work, and on a 2-core machine they
  compete for the same cores, so the ratio says what overlap buys when the hardware is shared;
  with rollout actors on their own GPUs it is the sglang case.

samples/s = samples trained / sum of ``time/step_s`` over the steps (data, rollout wait, train,
weight sync, metrics; no start-up, no evaluation); ``steady`` leaves out step 1, which no run
can overlap. One JSON object.

    uv run python benchmarks/overlap.py [--steps 8] [--ray] [--work DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
TOKENS_PER_SAMPLE = 2  # a letter and <|im_end|> (the fake's letter answers)


def config(config: str, run_dir: Path, model_dir: Path, steps: int, extra: list[str]) -> Any:
    from omni_grpo.config import load_config

    return load_config(
        REPO / "examples" / config,
        [
            f"run.dir={run_dir}",
            f"run.steps={steps}",
            "run.plots=false",
            "run.tensorboard=false",
            "run.save_every=0",
            f"model.omni_checkpoint={model_dir / 'omni'}",
            f"model.extracted_dir={model_dir / 'vl'}",
            f"model.audio_dir={model_dir / 'audio'}",
            "trainer.warmup=null",
            "eval.every=0",
            *extra,
        ],
    )


def run(cfg: Any) -> dict[str, Any]:
    from omni_grpo.trainer import train

    train(cfg, progress=False)
    records = [
        json.loads(x) for x in (Path(cfg.run.dir) / "metrics.jsonl").read_text().splitlines()
    ]
    steps = [r for r in records if r["step"] > 0]
    samples = cfg.rollout.prompts_per_step * cfg.rollout.n_samples

    def rate(rows: list[dict]) -> float:
        return round(samples * len(rows) / sum(r["time/step_s"] for r in rows), 3)

    mean = {
        k: round(float(np.mean([r[k] for r in steps if k in r])), 4)
        for k in (
            "time/step_s",
            "time/rollout_s",
            "time/train_s",
            "weight_sync/seconds",
            "staleness/mean",
            "train_rollout_logprob_abs_diff",
        )
        if any(k in r for r in steps)
    }
    return {
        "samples_per_s": rate(steps),
        "steady_samples_per_s": rate(steps[1:]),
        "mean_per_step": mean,
    }


def sglang_pair(work: Path, steps: int) -> dict[str, Any]:
    from omni_grpo.trainer import prepare_model

    model_dir = work / "model"

    def cfg(name: str, url: str, staleness: int, n_steps: int) -> Any:
        return config(
            "tiny.yaml",
            work / name,
            model_dir,
            n_steps,
            [
                "rollout.engine=sglang-omni",
                f"rollout.sglang.urls=[{url}]",
                "rollout.sglang.sync_mode=disk",
                f"rollout.sglang.sync_dir={work / name / 'sync'}",
                f"rollout.max_staleness={staleness}",
                "algo.tis={enabled: true, mode: truncate, clip_high: 2.0}",
            ],
        )

    @contextlib.contextmanager
    def serve(delay: float) -> Iterator[str]:
        """The fake as its own process (``omni_grpo.testing.fake_server``, what ``omni-grpo
        serve --kind fake`` runs): its request handling does not share this process's GIL, as
        a real server's would not; it still shares the machine's cores."""
        cmd = [sys.executable, "-m", "omni_grpo.testing.fake_server"]
        cmd += ["--model-path", str(model_dir / "omni"), "--token-delay-s", str(delay)]
        with open(work / "fake_server.log", "ab") as log:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
            try:
                assert proc.stdout is not None
                line = proc.stdout.readline()  # "fake sglang-omni server at URL (model ...)"
                if " at http" not in line:
                    raise RuntimeError(f"fake server did not start: {line!r} (see {log.name})")
                yield line.split(" at ", 1)[1].split()[0]
            finally:
                proc.terminate()
                proc.wait(60)

    prepare_model(cfg("prep", "http://unused", 0, 1).model, work / "prep")
    probe_delay = 0.02
    with serve(probe_delay) as url:
        probe = run(cfg("calibrate", url, 0, 3))
    train_s = probe["mean_per_step"]["time/train_s"]
    fixed_s = max(0.0, probe["mean_per_step"]["time/rollout_s"] - TOKENS_PER_SAMPLE * probe_delay)
    # The server's generation time (the delay) equals the train step; the client's and the fake's
    # own CPU work per batch (payload encoding, HTTP, decoding: ``rollout_fixed_s``) comes on top.
    delay = train_s / TOKENS_PER_SAMPLE
    out: dict[str, Any] = {
        "token_delay_s": round(delay, 4),
        "rollout_fixed_s": round(fixed_s, 3),
        "calibration": probe,
    }
    for staleness in (0, 1):
        with serve(delay) as url:
            out[f"max_staleness_{staleness}"] = run(
                cfg(f"staleness-{staleness}", url, staleness, steps)
            )
    return out


def ray_pair(work: Path, steps: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for staleness in (0, 1):
        out[f"max_staleness_{staleness}"] = run(
            config(
                "tiny-ray.yaml",
                work / f"ray-{staleness}",
                work / "model",
                steps,
                [f"rollout.max_staleness={staleness}"],
            )
        )
    return out


def ratios(pair: dict[str, Any]) -> dict[str, float]:
    zero, one = pair["max_staleness_0"], pair["max_staleness_1"]
    return {
        "ratio": round(one["samples_per_s"] / zero["samples_per_s"], 3),
        "steady_ratio": round(one["steady_samples_per_s"] / zero["steady_samples_per_s"], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--ray", action="store_true", help="also the embedded rollout actors")
    parser.add_argument("--work", type=Path, default=None)
    args = parser.parse_args()
    os.environ.setdefault("OMNI_GRPO_TORCH_THREADS", "1")
    work = args.work or Path(tempfile.mkdtemp(prefix="overlap-bench-"))
    t0 = time.perf_counter()
    result: dict[str, Any] = {"benchmark": "overlap", "steps": args.steps}
    sglang = sglang_pair(work, args.steps)
    result["sglang"] = {**ratios(sglang), **sglang}
    if args.ray:
        ray = ray_pair(work, args.steps)
        result["ray"] = {**ratios(ray), **ray}
    result.update(
        ratio=result["sglang"]["ratio"],
        target_ratio=1.6,
        limit_ratio=2.0,
        wall_s=round(time.perf_counter() - t0, 1),
        cpus=os.cpu_count(),
        load_avg=[round(x, 2) for x in os.getloadavg()],
        torch_threads=int(os.environ["OMNI_GRPO_TORCH_THREADS"]),
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()

"""Benchmark: does the LoRA demo (examples/tiny-lora.yaml) learn every modality for every seed, and
what does it cost against the full fine-tuning demo (examples/tiny.yaml) measured in the same run?

Runs ``omni-grpo train --config examples/tiny-lora.yaml --set run.seed=S`` for each seed x
``OMNI_GRPO_TORCH_THREADS`` value (the runner of ``benchmarks/demo_seeds.py``: one run at a time,
final and post-learning minimum held-out accuracy per modality, wall and CPU time of the child),
and the full demo for ``--baseline-seeds``, each baseline run right after the LoRA run of its seed
and thread count so that load drifts on a shared machine hit both alike. Prints one JSON object:
per run the accuracies and times, per thread count the pass count and the LoRA / full ratios of
mean wall and CPU time (the CPU time is the comparable one on a loaded box).

    uv run python benchmarks/lora_seeds.py [--seeds 0-4] [--threads 1] [--baseline-seeds 0] \
        [--set algo.kl_type=full ...]

Not a test: minutes per run. ``--work DIR`` keeps the run directories.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo_seeds import REPO, TARGET, parse_ints, run_one, summarise  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", type=Path, default=REPO / "examples" / "tiny-lora.yaml")
    ap.add_argument("--baseline-config", type=Path, default=REPO / "examples" / "tiny.yaml")
    ap.add_argument("--seeds", default="0-4")
    ap.add_argument("--threads", default="1")
    ap.add_argument("--baseline-seeds", default="0", help="'' skips the full fine-tuning runs")
    ap.add_argument("--work", type=Path, default=None, help="keep the run directories here")
    ap.add_argument(
        "--set", dest="overrides", action="append", default=[], help="extra override (both sides)"
    )
    args = ap.parse_args()

    seeds, threads = parse_ints(args.seeds), parse_ints(args.threads)
    base_seeds = parse_ints(args.baseline_seeds) if args.baseline_seeds else []
    tmp = None if args.work else tempfile.TemporaryDirectory(prefix="lora-seeds-")
    work = args.work or Path(tmp.name)  # type: ignore[union-attr]
    work.mkdir(parents=True, exist_ok=True)
    order = []
    for t in threads:
        for s in seeds:
            order.append(("lora", s, t))
            if s in base_seeds:
                order.append(("full", s, t))
    runs: dict[str, list[dict[str, Any]]] = {"lora": [], "full": []}
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    interrupted = False
    try:
        for kind, s, t in order:
            config = args.config if kind == "lora" else args.baseline_config
            r = run_one(config, work, f"{kind}_s{s}_t{t}", s, t, tuple(args.overrides))
            runs[kind].append(r)
            print(json.dumps({kind: r}), file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        if tmp is not None:
            tmp.cleanup()
    by_threads: dict[str, Any] = {}
    for t in threads:
        lora = [r for r in runs["lora"] if r["threads"] == t]
        full = [r for r in runs["full"] if r["threads"] == t]
        entry: dict[str, Any] = {
            "lora_pass": f"{sum(bool(r.get('pass')) for r in lora)}/{len(lora)}",
            "full_pass": f"{sum(bool(r.get('pass')) for r in full)}/{len(full)}",
        }
        for key in ("wall_s", "cpu_s"):
            # the ratio on the seeds both ran (same seed, same thread count, adjacent in time)
            paired = {r["seed"] for r in full} & {r["seed"] for r in lora}
            a = summarise([r for r in lora if r["seed"] in paired], key)
            b = summarise([r for r in full if r["seed"] in paired], key)
            entry[f"lora_{key}_mean"], entry[f"full_{key}_mean"] = a, b
            entry[f"{key}_ratio_lora_over_full"] = round(a / b, 3) if a and b else None
        by_threads[str(t)] = entry
    print(
        json.dumps(
            {
                "benchmark": "lora_seeds",
                "config": str(args.config),
                "baseline_config": str(args.baseline_config),
                "overrides": args.overrides,
                "cpus": os.cpu_count(),
                "target": TARGET,
                "interrupted": interrupted,
                "planned_runs": len(order),
                "all_pass": bool(runs["lora"]) and all(r.get("pass") for r in runs["lora"]),
                "by_threads": by_threads,
                "runs": runs,
            }
        )
    )


if __name__ == "__main__":
    main()

"""Benchmark: does the LoRA demo (examples/tiny-lora.yaml) learn every modality for every seed, and
what does it cost against the full fine-tuning demo (examples/tiny.yaml) measured in the same run?

The sweep of ``demo_seeds.py``, the full demo for ``--baseline-seeds`` right after the LoRA run
of its seed and thread count: per run accuracies and times; per thread count the pass counts and
LoRA / full ratios of the mean wall and CPU time on the seeds both ran. Minutes per run.

    uv run python benchmarks/lora_seeds.py [--seeds 0-4] [--threads 1] [--baseline-seeds 0] \\
        [--set algo.kl_type=full ...] [--work DIR]
"""

from pathlib import Path
from typing import Any

import harness
from demo_seeds import REPO, parse_ints, passed, record, summarise, sweep

if __name__ == "__main__":
    examples = REPO / "examples"
    ap = harness.parser(__doc__, config=examples / "tiny-lora.yaml", seeds="0-4", threads="1")
    harness.add_options(ap, baseline_config=examples / "tiny.yaml", baseline_seeds="0", work=Path)
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="both sides")
    args = ap.parse_args()
    seeds, threads, base_seeds = map(parse_ints, (args.seeds, args.threads, args.baseline_seeds))
    order = [(kind, s, t) for t in threads for s in seeds for kind in ("lora", "full")]
    order = [(kind, s, t) for kind, s, t in order if kind == "lora" or s in base_seeds]
    extra = tuple(args.overrides)
    configs = {"lora": (args.config, extra), "full": (args.baseline_config, extra)}
    runs, interrupted = sweep(order, configs, args.work)
    by_threads: dict[str, Any] = {}
    for t in threads:
        lora, full = ([r for r in kind if r["threads"] == t] for kind in runs.values())
        entry: dict[str, Any] = {"lora_pass": passed(lora), "full_pass": passed(full)}
        # the ratio on the seeds both ran (same seed, same thread count, adjacent in time)
        paired = {r["seed"] for r in full} & {r["seed"] for r in lora}
        for key in ("wall_s", "cpu_s"):
            a, b = (summarise([r for r in rs if r["seed"] in paired], key) for rs in (lora, full))
            entry[f"lora_{key}_mean"], entry[f"full_{key}_mean"] = a, b
            entry[f"{key}_ratio_lora_over_full"] = round(a / b, 3) if a and b else None
        by_threads[str(t)] = entry
    facts = {"baseline_config": str(args.baseline_config), "overrides": args.overrides}
    out = record(args, order, runs, interrupted, **facts)
    harness.emit("lora_seeds", out | {"by_threads": by_threads, "runs": runs}, args.save)

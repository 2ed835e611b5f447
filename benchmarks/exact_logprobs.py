"""``rollout.exact_logprobs`` on one GPU: bitwise rollout == trainer logprobs, and what it costs.

The thinker at real widths (``thinker_rig``, ``--layers`` text layers), per training mode (LoRA,
full) ``--steps`` GRPO steps with the option off, then on: per step the share of completion
tokens whose rollout logprob equals the trainer's bitwise, mean |delta|, seconds; ``samples_per_s``
after step 1 and ``on_over_off`` (target >= 0.85). The setup: docs/exact-logprobs.md, "Measured".

    python benchmarks/exact_logprobs.py --work /tmp/og                 # H200: 8 x 8 x 256, 5 steps
    python benchmarks/exact_logprobs.py --work /tmp/og --modes lora --steps 2 --max-new-tokens 64
"""

import gc
from functools import partial
from pathlib import Path
from typing import Any

import harness
import released
import thinker_rig as rig
import torch
from omni_grpo.config import LoraConfig
from omni_grpo.data.prompt import PromptBuilder
from omni_grpo.exact import enable_exact_logprobs
from omni_grpo.models.item_cache import clear_item_caches
from omni_grpo.types import GRPOBatch, SamplingParams

KINDS = ("image", "audio", "video", "text")


def run_one(args: Any, cfg: dict, vl_dir: Path, mode: str, exact: bool) -> dict[str, Any]:
    skeleton, device = Path(args.work) / "skeleton", torch.device("cuda")
    with harness.timed(device) as build:
        # seeded: the same weights in every run
        thinker = rig.thinker_at(cfg, vl_dir, skeleton, device, torch.bfloat16)
        torch.manual_seed(1)
        rig.real_audio_tower(thinker, skeleton / "audio", device, torch.bfloat16)
        builder = PromptBuilder(vl_dir, rig.synthetic_media(args))
        _, _, prompts = rig.samples(Path(args.work), builder, args, KINDS, "Describe it in detail.")
        eos, pad = rig.stop_ids(vl_dir, builder.tokenizer)
        spec = {"rank": 16, "alpha": 32.0, "targets": ["attention", "experts"]}
        lora = LoraConfig(**spec) if mode == "lora" else None
        mb = {k: vars(args)[k] for k in ("micro_batch_size", "micro_batch_tokens")}
        backend = rig.trainer(thinker, device, pad, lora, 0.01, lr=1e-5 if lora else 1e-6, **mb)
        switched = enable_exact_logprobs(thinker) if exact else {}
        engine = rig.engine(thinker, eos, device)
        sampling = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens)
    torch.manual_seed(args.seed)
    steps = []
    for _ in range(args.steps):
        torch.cuda.reset_peak_memory_stats()
        # the same prompts every step: drop the towers' items so that each step encodes its
        # media as a step of new prompts does (the trainer's forwards then reuse the rollout's)
        clear_item_caches(thinker)
        with harness.timed(device) as gen:
            groups = engine.generate(prompts, args.group, sampling)
        adv = rig.advantages(groups, args.group)
        with harness.timed(device) as upd:
            metrics = backend.step(GRPOBatch(groups, adv, temperature=sampling.temperature))
        row: dict[str, Any] = {"generation_s": round(gen.s, 3), "update_s": round(upd.s, 3)}
        row["step_s"] = round(gen.s + upd.s, 3)
        row["new_tokens"] = sum(len(c.token_ids) for g in groups for c in g)
        for k in ("exact_fraction", "abs_diff", "pearson"):
            row[k] = metrics.get(f"train_rollout_logprob_{k}")
        row["skipped_step"] = metrics.get("skipped_step")
        row["peak_gib"] = round(torch.cuda.max_memory_allocated() / harness.GIB, 2)
        # the update's phases (TorchBackend's clock): KL reference forward, policy passes
        for k in ("reference", "policy"):
            row[f"{k}_s"] = round(float(metrics.get(f"time_{k}_s", 0.0)), 3)
        if exact:
            totals = backend.exact_watch.totals
            row["by_modality"] = {m: {"differ": b, "tokens": n} for m, (b, n) in totals.items()}
            totals.clear()
        steps.append(row)
        harness.progress({"mode": mode, "exact": exact, "step": row})
    if args.profile:  # one more generation and update, not timed: where their GPU time goes
        out, tag = Path(args.profile), f"{mode}_{'on' if exact else 'off'}"
        out.mkdir(parents=True, exist_ok=True)
        clear_item_caches(backend.model)
        generate = partial(engine.generate, prompts, args.group, sampling)
        groups = harness.profile_table(generate, out / f"profile_{tag}_generation.txt")
        adv = rig.advantages(groups, args.group)
        batch = GRPOBatch(groups, adv, temperature=sampling.temperature)
        harness.profile_table(partial(backend.step, batch), out / f"profile_{tag}.txt")
    timed, rows = steps[1:] or steps, args.prompts * args.group
    out = {"build_s": round(build.s, 1), "switched": switched, "steps": steps}
    out["samples_per_s"] = rows * len(timed) / sum(s["step_s"] for s in timed)
    out["exact_fraction_min"] = min(float(s["exact_fraction"]) for s in steps)
    out["abs_diff_max"] = max(float(s["abs_diff"]) for s in steps)
    del backend, engine, thinker
    gc.collect()
    torch.cuda.empty_cache()
    return out


if __name__ == "__main__":
    ap = harness.parser(__doc__, work="/tmp/exact_logprobs", layers=4, prompts=8, group=8)
    harness.add_options(ap, max_new_tokens=256, image_size=448, audio_seconds=30.0)
    harness.add_options(ap, video_frames=16, video_size=224, micro_batch_size=16)
    harness.add_options(ap, micro_batch_tokens=16384, steps=5, modes="lora,full", seed=0)
    ap.add_argument("--profile", default="", help="a folder: profile one extra update per run")
    args = ap.parse_args()
    harness.cuda_device("exact_logprobs.py (exact logprobs are GPU-only)")
    harness.torch_threads(4)
    work = Path(args.work)
    skeleton = released.make_skeleton(work / "skeleton")
    vl_dir, cfg = rig.vl_dir_at(skeleton, work / f"vl-{args.layers}", args.layers, "real")
    config = {k: v for k, v in vars(args).items() if k not in ("work", "save")}
    result = {"device": torch.cuda.get_device_name(), "config": config, "modes": {}}
    for mode in args.modes.split(","):
        runs = {k: run_one(args, cfg, vl_dir, mode, k == "on") for k in ("off", "on")}
        runs["on_over_off"] = runs["on"]["samples_per_s"] / runs["off"]["samples_per_s"]
        result["modes"][mode] = runs
    harness.emit("exact_logprobs", result, args.save)

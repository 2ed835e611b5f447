"""The one-GPU memory model of LoRA GRPO on the Qwen3-Omni thinker: measured per depth, fitted per
layer, projected to the released 48 text layers and checked against a run at the deepest depth
that fits (``--deep``, else ``--deep-fallback``). Each depth in its own process (``thinker_rig``),
with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` unless set otherwise; the method:
docs/one-gpu-lora.md, "The memory model (measured)".

    python benchmarks/lora_memory.py --work /tmp/lm                       # H200: 2,4,8 + 48
    python benchmarks/lora_memory.py --device cpu --widths tiny --layers 1,2 --deep 3 \\
        --prompts 2 --group 2 --max-new-tokens 4 --image-size 64 --steps 1  # CPU smoke run
"""

import argparse
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import harness
import released
import thinker_rig as rig
import torch
from omni_grpo.config import DataConfig, LoraConfig
from omni_grpo.data.prompt import PromptBuilder
from omni_grpo.types import GRPOBatch, SamplingParams


def _mem(device: torch.device) -> dict[str, float]:
    if device.type != "cuda":
        return {"max_rss_gib": harness.peak_bytes(device) / harness.GIB}
    allocated, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    return {"allocated_gib": allocated / harness.GIB, "reserved_gib": reserved / harness.GIB}


def run_depth(args: argparse.Namespace, layers: int) -> dict[str, Any]:
    """One depth: build, then ``args.steps`` full GRPO steps; peaks and sizes."""
    work, device = Path(args.work), torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    vl_dir, cfg = rig.vl_dir_at(work / "skeleton", work / f"vl-{layers}", layers, args.widths)
    with harness.timed(device) as build:
        thinker = rig.thinker_at(cfg, vl_dir, work / "skeleton", device, dtype)
        model_bytes = harness.nbytes(thinker.parameters())
        model_params = sum(p.numel() for p in thinker.parameters())
    after_build = _mem(device)  # includes the random init's transients (the 48-layer build
    # peaked at 2x the model, 114.7 GiB): none of that is the training step's, so the cache is
    # released before the steps (a loaded checkpoint never goes through the init)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        after_build["reserved_after_release_gib"] = torch.cuda.memory_reserved() / harness.GIB
    builder = PromptBuilder(vl_dir, DataConfig(image_max_pixels=args.image_size**2))
    _, _, prompts = rig.samples(work, builder, args, ("image",), "Describe the colours in detail.")
    eos, pad = rig.stop_ids(vl_dir, builder.tokenizer)
    lora = LoraConfig(rank=args.rank, alpha=args.alpha, targets=args.targets.split(","))
    ckpt = {"micro_batch_size": args.group, "gradient_checkpointing": not args.no_checkpointing}
    backend = rig.trainer(thinker, device, pad, lora, args.kl_coef, **ckpt)
    adapters = [p for p in thinker.parameters() if p.requires_grad]
    engine = rig.engine(thinker, eos, device, builder.tokenizer)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens)
    gen_peak, upd_peak, steps = {}, {}, []
    torch.manual_seed(args.seed)
    for _ in range(args.steps):
        harness.peak_bytes(device, reset=True)
        with harness.timed(device) as gen:
            groups = engine.generate(prompts, args.group, sampling)
        gen_peak = {k: max(v, gen_peak.get(k, 0.0)) for k, v in _mem(device).items()}
        adv = rig.advantages(groups, args.group)
        harness.peak_bytes(device, reset=True)
        with harness.timed(device) as upd:
            metrics = backend.step(GRPOBatch(groups, adv, temperature=sampling.temperature))
        upd_peak = {k: max(v, upd_peak.get(k, 0.0)) for k, v in _mem(device).items()}
        row = {"generation_s": round(gen.s, 2), "update_s": round(upd.s, 2)}
        row["new_tokens"] = sum(len(c.token_ids) for gr in groups for c in gr)
        steps.append(row | {k: metrics.get(k) for k in ("skipped_step", "loss", "kl_loss")})
    out = {"layers": layers, "model_params": model_params, "model_gib": model_bytes / harness.GIB}
    out |= {"adapter_params": sum(p.numel() for p in adapters)}
    out |= {"adapter_gib": harness.nbytes(adapters) / harness.GIB}
    out["adamw_state_gib"] = harness.nbytes(harness.state_tensors(backend.optimizer)) / harness.GIB
    out |= {"after_build": after_build, "peak_generation": gen_peak, "peak_update": upd_peak}
    out["peak_step"] = {k: max(gen_peak.get(k, 0.0), upd_peak.get(k, 0.0)) for k in gen_peak}
    out |= {"build_s": round(build.s, 1), "prompt_tokens": [len(p.input_ids) for p in prompts]}
    out["steps"] = steps
    if device.type == "cuda":
        out["card_total_gib"] = torch.cuda.mem_get_info()[1] / harness.GIB
    return out


def child(layers: int) -> dict[str, Any]:
    """One depth in its own process (its peak is its own); a failure recorded, OOM or not."""
    env = dict(os.environ)
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    t = time.perf_counter()
    result = harness.rerun(str(layers), check=False, env=env)
    if "error" in result:
        tail = result.pop("stderr_tail")[-6:]
        oom = any("OutOfMemoryError" in x or "out of memory" in x for x in tail)
        result = {"layers": layers, **result, "oom": oom, "tail": tail}
    else:
        result["process_s"] = round(time.perf_counter() - t, 1)
    harness.progress({"run": result})
    return result


if __name__ == "__main__":
    # --skeleton: a dir with an extracted vl/ + audio/ pair; --layers: the fit's depths; --deep 0:
    # no deep run; --deep-fallback: the depths tried in order if --deep runs out of memory
    ap = harness.parser(__doc__, work="/tmp/lora_memory", skeleton=str, device="cuda")
    harness.add_options(ap, widths=("real", "tiny"), layers="2,4,8", deep=released.LAYERS)
    harness.add_options(ap, deep_fallback="40,32,24", prompts=8, group=8, max_new_tokens=512)
    harness.add_options(ap, image_size=448, rank=16, alpha=32.0, targets="attention,experts")
    harness.add_options(ap, kl_coef=0.01, no_checkpointing=False, steps=2, seed=0)
    args = ap.parse_args()
    harness.torch_threads(4)
    if args.side is not None:  # a child: one depth
        harness.reply(run_depth(args, int(args.side)))
    (work := Path(args.work)).mkdir(parents=True, exist_ok=True)
    if not args.skeleton:
        released.make_skeleton(work / "skeleton")
    elif not (work / "skeleton").exists():
        shutil.copytree(args.skeleton, work / "skeleton")
    t0 = time.perf_counter()
    depths = [int(x) for x in args.layers.split(",") if x]
    runs = [child(d) for d in depths]
    ok = [r for r in runs if "error" not in r]
    models: dict[str, Any] = {}
    keys = ["allocated_gib", "reserved_gib"] if args.device == "cuda" else ["max_rss_gib"]
    for k in keys if len(ok) >= 2 else []:  # a line needs two depths
        points = [(r["layers"], r["peak_step"][k]) for r in ok]  # peak = a + b * layers
        slope, intercept = statistics.linear_regression(*zip(*points, strict=True))
        resid = max(abs(intercept + slope * x - y) for x, y in points)
        f = {"intercept_gib": intercept, "per_layer_gib": slope, "max_residual_gib": resid}
        models[k] = f | {"projected_48_gib": intercept + released.LAYERS * slope}
    deep: dict[str, Any] | None = None
    if args.deep:
        fallback = [int(x) for x in args.deep_fallback.split(",") if x and int(x) < args.deep]
        for d in [args.deep, *fallback]:  # the deepest that fits
            deep = child(d)
            if "error" not in deep or not deep.get("oom"):
                break
    comparison: dict[str, Any] = {}
    if deep is not None and "error" not in deep and models:
        for k, f in models.items():
            projected = f["intercept_gib"] + deep["layers"] * f["per_layer_gib"]
            m = deep["peak_step"][k]
            c = {"layers": deep["layers"], "projected_gib": projected, "measured_gib": m}
            comparison[k] = c | {"measured_over_projected": m / projected}
    config = {k: vars(args)[k] for k in ("widths", "prompts", "group", "max_new_tokens")}
    config |= {"fit_layers": depths, "samples_per_step": args.prompts * args.group}
    config |= {k: vars(args)[k] for k in ("image_size", "kl_coef", "steps")}
    config["lora"] = {"rank": args.rank, "alpha": args.alpha, "targets": args.targets}
    config["gradient_checkpointing"] = not args.no_checkpointing
    config |= {"micro_batch_size": args.group, "dtype": "bf16" if args.device == "cuda" else "fp32"}
    config["alloc_conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    record = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"}
    record |= {"config": config, "fit": models, "deep": comparison, "runs": runs, "deep_run": deep}
    record |= {"wall_s": round(time.perf_counter() - t0, 1), "versions": harness.versions("peft")}
    harness.emit("lora_memory", record, args.save)

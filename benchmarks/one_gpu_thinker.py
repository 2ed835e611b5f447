"""The released Qwen3-Omni thinker on ONE GPU: a LoRA GRPO step per phase, against the hardware.

The released architecture (text 48 layers, vision 27, audio 32, real widths and vocabulary) with
random bf16 weights drawn on the GPU (``thinker_rig``); the real ``TorchBackend`` with
``trainer.lora`` and checkpointing; rollouts from the embedded engine; image, audio and video
prompts mixed in one step, end-of-turn ids banned (every sample ``--max-new-tokens`` long). Per
step: generation, reference forward and update seconds; tokens/s against the decode roofline and
update MFU (``roofline``, over ``harness.device_limits`` measured in the same run); peak memory;
rollout<->trainer logprob mismatch. The method: docs/one-gpu-lora.md. ``--lengths
lognormal:MEDIAN:SIGMA``; ``--long-prompts`` (every prompt a 32-frame video and 60 s of audio);
``--batching both`` (each step with each decoder; ``--static-batch-rows``: 64 for 256 x 4096);
``--extra-groups N`` (partial rollouts, N groups in flight); ``--micro-batch-tokens`` (pack rows),
``--compile``, ``--checkpoint-policy``: the trainer's; ``--[no-]exact-logprobs``: default as
``rollout.exact_logprobs: auto`` (on for CUDA with layer checkpointing and no extra groups);
``--write-run DIR`` (model, media and a train config: cli_run.py); ``--trl-steps N`` (then TRL +
peft); ``--profile``; ``--sync-sites`` (one more update: the lines that made the host wait for
the GPU, counted: ``harness.sync_sites``).

    python benchmarks/one_gpu_thinker.py --work /tmp/og                       # H200, 8 x 8 x 512
    python benchmarks/one_gpu_thinker.py --work /tmp/og --prompts 32          # 256 rows
    python benchmarks/one_gpu_thinker.py --device cpu --widths tiny --layers 2 --prompts 3 \\
        --group 2 --max-new-tokens 4 --image-size 64 --audio-seconds 2 --video-frames 4 --steps 1
"""

import argparse
import contextlib
import gc
import os
import sys
from functools import partial
from pathlib import Path
from typing import Any
from unittest import mock

import cli_run
import harness
import numpy as np
import released
import roofline
import thinker_rig as rig
import torch
from omni_grpo.config import LoraConfig
from omni_grpo.data.prompt import PromptBuilder
from omni_grpo.exact import enable_exact_logprobs
from omni_grpo.models.item_cache import clear_item_caches, item_cache_counts
from omni_grpo.models.lora import peft_config
from omni_grpo.rollout.partial import PartialRollouts
from omni_grpo.types import GRPOBatch, SamplingParams
from torch._dynamo.utils import counters

CONFIG_KEYS = ("checkpoint_policy", "compile", "exact_logprobs", "lengths", "batching")
CONFIG_KEYS += ("static_batch_rows", "long_prompts", "audio_seconds", "video_frames")
CONFIG_KEYS += ("generation_only", "extra_groups")  # the options the result's config repeats


def update_phase_marks(backend_type: type, labels: list[str] | None) -> Any:
    """Marker kernels at the starts of the update's phases (``harness.phase_marks``): each KL
    reference forward, each policy forward (the one that records a graph), each backward (the
    recompute and the gradients) and the clip + optimizer step. ``None``: no markers (CPU)."""
    if labels is None:
        return contextlib.nullcontext()
    return harness.phase_marks(
        labels,
        (backend_type, "_reference_logp", "reference", None),
        (backend_type, "_logits", "policy forward", torch.is_grad_enabled),
        (torch.Tensor, "backward", "backward (recompute + gradients)", None),
        (torch.nn.utils, "clip_grad_norm_", "clip + optimizer", None),
    )


def draw_lengths(spec: str, rows: int, limit: int, seed: Any) -> list[int]:
    """Each row's completion length: ``uniform`` (every row ``limit``: the worst case) or
    ``lognormal:MEDIAN:SIGMA`` (ceil of a lognormal draw, clipped to [1, limit]); ``seed``: a
    seed or a numpy Generator (partial rollouts draw each new group's lengths from one)."""
    if spec == "uniform":
        return [limit] * rows
    kind, median, sigma = spec.split(":")
    if kind != "lognormal":
        raise SystemExit(f"--lengths: unknown distribution {kind!r} (uniform, lognormal:M:S)")
    draw = np.random.default_rng(seed).lognormal(np.log(float(median)), float(sigma), rows)
    return [int(x) for x in np.clip(np.ceil(draw), 1, limit)]


def run_trl_side(args: Any, cfg: dict, vl_dir: Path, samples: list, images: list) -> dict:
    """The same random model (same seed), prompts and batch through TRL's ``GRPOTrainer`` with
    peft (our LoRA targets as peft's config), vision frozen, checkpointing on, after our model is
    freed. TRL gets every prompt as an image prompt (recorded in the result: ``media``), so the
    ratio is against TRL on the cheaper prompts."""
    from vs_trl import run_trl

    gc.collect()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model = rig.build_vl(cfg, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    # every prompt as its index's image prompt: the VL model has no audio tower, and TRL 1.16
    # passes a mixed image + video batch's frame lists to the processor as separate videos
    texts = [x.prompt.replace(f"<{x.modality}>", "<image>") for x in samples]
    pairs = zip(samples, images, texts, strict=True)
    rows = [{"id": x.uid, "path": str(p), "text": t} for x, p, t in pairs]
    lora = LoraConfig(rank=args.rank, alpha=args.alpha, targets=args.targets.split(","))
    steps = {"warmup": args.trl_warmup, "steps": args.trl_steps}
    trl_args = argparse.Namespace(**vars(args) | steps | {"media": "image", "lr": 1e-5})
    with contextlib.redirect_stdout(sys.stderr):  # TRL logs its steps on stdout: one JSON here
        out = run_trl(trl_args, vl_dir, rows, model, peft_config(lora), True)
    return out | {"media": ["image"] * len(rows)}


if __name__ == "__main__":
    ap = harness.parser(__doc__, work="/tmp/one_gpu_thinker", device="cuda", layers=released.LAYERS)
    harness.add_options(ap, widths=("real", "tiny"), prompts=8, group=8, max_new_tokens=512)
    harness.add_options(ap, image_size=448, video_size=224, audio_seconds=float, video_frames=int)
    harness.add_options(ap, rank=16, alpha=32.0, targets="attention,experts", micro_batch_size=8)
    harness.add_options(ap, expert_path=("grouped", "peft"), micro_batch_tokens=int, compile=False)
    harness.add_options(ap, checkpoint_policy=("layer", "selective"), steps=2, seed=0)
    harness.add_options(ap, extra_groups=0, lengths="uniform", trl_steps=0)
    ap.add_argument("--exact-logprobs", action=argparse.BooleanOptionalAction)  # None: auto
    harness.add_options(ap, batching=("static", "continuous", "both"), static_batch_rows=512)
    harness.add_options(ap, long_prompts=False, generation_only=False, write_run=Path)
    args = harness.add_options(ap, trl_warmup=1, profile=str, sync_sites=False).parse_args()
    args.audio_seconds = args.audio_seconds or (60.0 if args.long_prompts else 30.0)
    args.video_frames = args.video_frames or (32 if args.long_prompts else 16)
    harness.torch_threads(4)
    work, device, cuda = Path(args.work), torch.device(args.device), args.device == "cuda"
    if args.exact_logprobs is None:  # rollout.exact_logprobs auto: on where it can hold
        args.exact_logprobs = cuda and args.checkpoint_policy == "layer" and not args.extra_groups
    dtype = torch.bfloat16 if cuda else torch.float32
    skeleton, limits = released.make_skeleton(work / "skeleton"), harness.device_limits(device)
    vl_dir, cfg = rig.vl_dir_at(skeleton, work / f"vl-{args.layers}", args.layers, args.widths)
    with harness.timed(device) as build:
        thinker = rig.thinker_at(cfg, vl_dir, skeleton, device, dtype)
        if args.widths == "real":
            rig.real_audio_tower(thinker, skeleton / "audio", device, dtype)
    if cuda:
        torch.cuda.empty_cache()
    builder = PromptBuilder(vl_dir, rig.synthetic_media(args))
    tok, kinds, question = builder.tokenizer, ("image", "audio", "video"), "Describe it in detail."
    samples, images, prompts = rig.samples(work, builder, args, kinds, question)
    if args.write_run:  # before the trainer wraps the module with its adapters
        made = (args.write_run, thinker, vl_dir, skeleton, samples, images, args)
        print(f"omni-grpo train --config {cli_run.write_run(*made)}", file=sys.stderr, flush=True)
    eos, pad = rig.stop_ids(vl_dir, tok)
    targets = args.targets.split(",")
    spec = {"rank": args.rank, "alpha": args.alpha, "targets": targets}
    lora = LoraConfig(**spec, expert_path=args.expert_path)
    keys = ("micro_batch_size", "micro_batch_tokens", "compile", "checkpoint_policy")
    backend = rig.trainer(thinker, device, pad, lora, 0.01, **{k: vars(args)[k] for k in keys})
    if args.exact_logprobs:  # rollout.exact_logprobs: the same switch the trainer makes
        enable_exact_logprobs(thinker)
    plan: dict[str, list[int]] = {}  # this step's drawn lengths, read by the engines

    def length_plan(batch: list[Any], n: int) -> list[int]:
        return [plan["lengths"][i * n + j] for i in range(len(batch)) for j in range(n)]

    def make_engine(batching: str, plan: Any) -> Any:
        kw = {"max_batch_rows": args.static_batch_rows if batching == "static" else 512}
        return rig.engine(thinker, eos, device, tok, batching=batching, length_plan=plan, **kw)

    batchings = ["static", "continuous"] if args.batching == "both" else [args.batching]
    engines = {name: make_engine(name, length_plan) for name in batchings}
    if args.extra_groups:  # partial rollouts: groups in flight across steps (own length draws)
        rng = np.random.default_rng([args.seed, 7])
        extra = iter(prompts * (args.extra_groups + args.steps * args.prompts))

        def partial_plan(batch: list[Any], n: int) -> list[int]:
            return draw_lengths(args.lengths, len(batch) * n, args.max_new_tokens, rng)

        more = lambda k: [next(extra) for _ in range(k)]  # noqa: E731
        inner = make_engine("continuous", partial_plan)
        engines["partial"] = PartialRollouts(inner, args.extra_groups, more)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens)
    sizes = roofline.text_sizes(cfg, args.rank, targets)
    prompt_lens = [len(p.input_ids) for p in prompts]
    width, rows = max(prompt_lens), args.prompts * args.group
    # decode steps 1..N-1 (the first token comes from the prefill); row r at step t reads width + t keys
    steps_kv = [rows * (width + t) for t in range(1, args.max_new_tokens)]
    decode_bytes = sum(roofline.decode_step_bytes(sizes, rows, kv) for kv in steps_kv)
    prefill_flops = roofline.forward_flops(sizes, [width] * args.prompts, args.prompts)
    copy_rate, matmul_rate = limits["copy_bytes_per_s"], limits["matmul_flops_per_s"]
    roofline_s = decode_bytes / copy_rate + prefill_flops / matmul_rate
    row_prompt_lens = [n for n in prompt_lens for _ in range(args.group)]
    steps: list[dict[str, Any]] = []
    torch.manual_seed(args.seed)
    peak = 0.0
    for _ in range(args.steps):
        harness.peak_bytes(device, reset=True)
        seed = args.seed * 1000 + len(steps)
        plan["lengths"] = draw_lengths(args.lengths, rows, args.max_new_tokens, seed)
        var_bytes = roofline.variable_decode_bytes(sizes, row_prompt_lens, plan["lengths"])
        var_roofline_s = var_bytes / copy_rate + prefill_flops / matmul_rate
        by_engine: dict[str, dict[str, Any]] = {}
        for name, engine in engines.items():
            # the same prompts every step: each rollout drops the towers' kept items (both paths
            # keep them) and is timed as new prompts cost it
            clear_item_caches(thinker)
            with harness.timed(device) as gen:
                groups = engine.generate(prompts, args.group, sampling)
            made = sum(len(c.token_ids) for gr in groups for c in gr)
            stats, engine_roofline_s = getattr(engine, "last_stats", None), var_roofline_s
            if stats:  # partial rollouts: what the call generated and read, not what it returned
                made, fills = int(stats["generated_tokens"]), engine.last_prefill
                # the rows it decoded (each from where it resumed), the prompts it prefilled
                contexts, drawn = zip(*[(c, max(1, n)) for c, n in engine.last_rows], strict=True)
                decode = roofline.variable_decode_bytes(sizes, list(contexts), list(drawn))
                prefill = roofline.forward_flops(sizes, fills, len(fills))
                engine_roofline_s = decode / copy_rate + prefill / matmul_rate
            rec = {"generation_s": round(gen.s, 3), "new_tokens": made}
            rec |= {"tokens_per_s": round(made / gen.s, 1)}
            rec["variable_roofline_ratio"] = round(engine_roofline_s / gen.s, 4)
            rec["peak_gib"] = round(harness.peak_bytes(device) / harness.GIB, 2) if cuda else None
            by_engine[name] = rec | ({"partial": stats} if stats else {})
            harness.progress({name: by_engine[name]})
        gen_s = gen.s  # the last engine's rollout is the one trained on
        lengths = [len(c.token_ids) for gr in groups for c in gr]
        adv = rig.advantages(groups, args.group)
        metrics: dict[str, Any] = {}
        upd = harness.Timing(s=0.0)
        towers = item_cache_counts(thinker)  # after the rollout: what the update finds or encodes
        if not args.generation_only:
            with harness.timed(device) as upd:
                metrics = backend.step(GRPOBatch(groups, adv, temperature=sampling.temperature))
        towers = {k: v - towers[k] for k, v in item_cache_counts(thinker).items()}
        if cuda:
            peak = max(peak, harness.peak_bytes(device) / harness.GIB)
        new_tokens = sum(lengths)
        train_seqs = [len(c.prompt.input_ids) + len(c.token_ids) for gr in groups for c in gr]
        # reference + policy forward + activation-gradient backward, and the recompute
        recompute = roofline.recompute_flops(sizes, train_seqs, new_tokens, args.checkpoint_policy)
        update_flops = roofline.forward_flops(sizes, train_seqs, new_tokens) * 3 + recompute
        if args.lengths == "uniform":
            var_roofline_s = roofline_s
        arr = np.asarray(lengths, dtype=float)  # completion-length percentiles, mean and max
        percentiles = {f"p{q}": float(np.percentile(arr, q)) for q in (50, 90, 99)}
        percentiles |= {"mean": float(arr.mean()), "max": float(arr.max())}
        step = {"batching": by_engine, "completion_lengths": percentiles}
        step |= {"variable_roofline_s": round(var_roofline_s, 3), "generation_s": round(gen_s, 3)}
        for phase in ("reference", "policy"):
            step[f"{phase}_s"] = round(metrics.get(f"time_{phase}_s", float("nan")), 3)
        step |= {"update_s": round(upd.s, 3), "step_s": round(gen_s + upd.s, 3)}
        step |= {"new_tokens": new_tokens, "tokens_per_s": round(new_tokens / gen_s, 1)}
        step["generation_roofline_ratio"] = round(var_roofline_s / gen_s, 4)
        step["update_mfu"] = round(update_flops / upd.s / matmul_rate, 4) if upd.s else None
        for k in ("pearson", "abs_diff", "exact_fraction"):
            step[f"logprob_{k}"] = metrics.get(f"train_rollout_logprob_{k}")
        step |= {k: metrics.get(k) for k in ("kl_loss", "grad_norm")}  # the reference's effect
        step["update_tower_items"] = {"found": towers["hits"], "encoded": towers["misses"]}
        steps.append(step | {"skipped_step": metrics.get("skipped_step")})
        harness.progress({"step": steps[-1]})
    sync_counts: dict[str, int] | None = None
    if args.sync_sites:  # one more update (the last batch again), each wait for the GPU counted
        again = GRPOBatch(groups, adv, temperature=sampling.temperature)
        _, sync_counts = harness.sync_sites(lambda: backend.step(again))
        harness.progress({"update_sync_sites": sync_counts})
    if args.profile:  # one more update, then 64 new tokens of eager generation (a CUDA graph's
        # kernels are not traced one by one), media encoded as in a timed step: <dst>.generation.txt
        dst, batch = Path(args.profile), GRPOBatch(groups, adv, temperature=sampling.temperature)
        backend.exact_watch.enabled = False  # the last step's batch after its update: its
        # rollout logprobs are one policy version old, so they differ by design
        labels: list[str] | None = [] if cuda else None  # the update's phases (GPU markers)
        with update_phase_marks(type(backend), labels):
            harness.profile_table(lambda: backend.step(batch), dst, labels)
        clear_item_caches(thinker)  # the generation below encodes its media as a step does
        short = sampling.model_copy(update={"max_new_tokens": 64})
        with mock.patch.dict(os.environ, {"OMNI_GRPO_CUDA_GRAPH": "0"}):
            generate = partial(engine.generate, prompts, args.group, short)
            harness.profile_table(generate, dst.with_name(dst.name + ".generation.txt"))
    last = steps[-1]
    trl: dict[str, Any] | None = None
    if args.trl_steps:
        engines.clear()  # each engine holds the model: TRL's side measures its own memory
        del backend, engine, thinker, groups, adv
        trl = run_trl_side(args, cfg, vl_dir, samples, images)
    ours = rows / last["step_s"]
    config = {k: vars(args)[k] for k in ("layers", "widths", "prompts", "group")}
    config |= {"rows": rows, "max_new_tokens": args.max_new_tokens, "lora": spec}
    config |= {"modalities": [s.modality for s in samples], "prompt_tokens": prompt_lens}
    config |= {k: vars(args)[k] for k in ("expert_path", "micro_batch_size", "micro_batch_tokens")}
    config["gradient_checkpointing"] = True
    out = {"device": torch.cuda.get_device_name() if cuda else "cpu"}
    out |= {"config": config | {k: vars(args)[k] for k in CONFIG_KEYS}, "limits": limits}
    out["roofline"] = {"decode_bytes": decode_bytes, "prefill_flops": prefill_flops}
    out["roofline"] |= {"generation_s": roofline_s, "update_flops": update_flops}
    out |= {"build_s": round(build.s, 1), "steps": steps}
    # each engine over every step: tokens/s (all tokens / all seconds), the mean roofline ratio,
    # and its tokens/s against the static decoder's (the engine before batching) when run
    out["batching_summary"] = summary = {}
    for name in steps[0]["batching"]:
        runs = [st["batching"][name] for st in steps]
        rate = sum(r["new_tokens"] for r in runs) / sum(r["generation_s"] for r in runs)
        ratio = sum(r["variable_roofline_ratio"] for r in runs) / len(runs)
        summary[name] = {"tokens_per_s": round(rate, 1), "variable_roofline_ratio": round(ratio, 4)}
    for entry in summary.values() if "static" in summary else ():
        entry["vs_static"] = round(entry["tokens_per_s"] / summary["static"]["tokens_per_s"], 3)
    out |= {"last": last, "peak_allocated_gib": round(peak, 2), "samples_per_s": ours, "trl": trl}
    out["samples_per_s_ratio_vs_trl"] = ours / trl["samples_per_s"] if trl else None
    out |= {"update_sync_sites": sync_counts}
    out |= {"versions": harness.versions("peft"), "dynamo": None}
    if args.compile:  # the graphs it made and where it broke them (a break costs fusion)
        breaks = {k.split("\n")[0][:120]: v for k, v in counters["graph_break"].items()}
        out["dynamo"] = {"stats": dict(counters["stats"]), "graph_breaks": breaks}
    harness.emit("one_gpu_thinker", out, args.save)

"""``rollout.exact_logprobs`` on one GPU: bitwise rollout == trainer logprobs, and what it costs.

The thinker at real widths and vocabulary with random bf16 weights (``--layers`` text layers,
vision 27, audio 32; built as in ``one_gpu_thinker.py``), the real embedded engine and
``TorchBackend``; prompts cycle image (448²), 30 s audio, 16-frame video and text, one medium
each, mixed in every step. For each training mode (LoRA r16 on attention + experts, and full
fine-tuning) the same model, prompts and seed run ``--steps`` GRPO steps with updates in between,
once with the option off and once on. Per step: the share of completion tokens whose rollout
logprob equals the trainer's bitwise (``train_rollout_logprob_exact_fraction``), mean |delta|,
generation and update seconds; with the option on also per modality. ``samples_per_s`` counts
every step after the first (Triton's compilation and the CUDA graph's capture are in step 1);
``on_over_off`` is the on/off ratio of it (target >= 0.85).

Prints ONE JSON object.

    python benchmarks/exact_logprobs.py --work /tmp/og                 # H200: 8 x 8 x 256, 5 steps
    python benchmarks/exact_logprobs.py --work /tmp/og --modes lora --steps 2 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lora_memory import build_vl, vl_dir_at, write_images  # noqa: E402
from one_gpu_thinker import real_audio_tower, synthetic_media  # noqa: E402
from vs_trl import make_skeleton  # noqa: E402

GIB = 1 << 30
KINDS = ("image", "audio", "video", "text")


def _sync() -> float:
    torch.cuda.synchronize()
    return time.perf_counter()


def make_prompts(args: argparse.Namespace, work: Path, vl_dir: Path) -> tuple[Any, list[Any]]:
    from omni_grpo.config import DataConfig
    from omni_grpo.data.prompt import PromptBuilder
    from omni_grpo.types import Sample

    synthetic_media(args)
    data = DataConfig(
        image_max_pixels=args.image_size**2,
        audio_max_seconds=args.audio_seconds,
        max_frames=args.video_frames,
        video_max_pixels=args.video_size**2,
    )
    builder = PromptBuilder(vl_dir, data)
    images = write_images(work / "media", args.prompts, args.image_size)
    samples = []
    for i in range(args.prompts):
        kind = KINDS[i % len(KINDS)]
        media: list[dict[str, str]] = []
        if kind == "image":
            media = [{"type": "image", "path": str(images[i])}]
        elif kind != "text":  # the loaders are synthetic; the file must exist
            path = work / "media" / f"{kind}{i}.bin"
            path.write_bytes(b"synthetic")
            media = [{"type": kind, "path": str(path)}]
        tag = f"<{kind}>" if kind != "text" else ""
        samples.append(
            Sample(
                uid=f"p{i}",
                prompt=f"{tag}Question {i}. Describe it in detail.",
                label="",
                media=media,
                modality=kind,
            )
        )
    return builder, [builder.build(s, "/") for s in samples]


def run_one(
    args: argparse.Namespace, cfg: dict[str, Any], vl_dir: Path, mode: str, exact: bool
) -> dict[str, Any]:
    from omni_grpo.algo import group_advantages
    from omni_grpo.backends.torch_backend import TorchBackend
    from omni_grpo.config import AlgoConfig, LoraConfig, TrainerConfig
    from omni_grpo.exact import enable_exact_logprobs
    from omni_grpo.exact.towers import clear_item_caches
    from omni_grpo.models.loader import wrap_vl
    from omni_grpo.models.sideband import media_token_ids
    from omni_grpo.rollout.embedded import EmbeddedEngine
    from omni_grpo.trainer import end_of_turn_ids
    from omni_grpo.types import GRPOBatch, SamplingParams

    work = Path(args.work)
    device = torch.device("cuda")
    t0 = _sync()
    vl = build_vl(cfg, device, torch.bfloat16)  # seeded: the same weights in every run
    thinker = wrap_vl(vl, vl_dir, audio_dir=work / "skeleton" / "audio", freeze_visual=True)
    torch.manual_seed(1)
    real_audio_tower(thinker, work / "skeleton" / "audio", device, torch.bfloat16)
    builder, prompts = make_prompts(args, work, vl_dir)
    tok = builder.tokenizer
    eos = end_of_turn_ids(vl_dir, tok)
    pad = int(tok.pad_token_id if tok.pad_token_id is not None else eos[0])
    lora = None
    if mode == "lora":
        lora = LoraConfig(rank=16, alpha=32.0, targets=["attention", "experts"])
    trainer_cfg = TrainerConfig(
        device="cuda",
        lr=1e-5 if lora else 1e-6,
        micro_batch_size=args.micro_batch_size,
        micro_batch_tokens=args.micro_batch_tokens,
        lora=lora,
        gradient_checkpointing=True,
    )
    algo = AlgoConfig(kl_coef=0.01, kl_type="k3", clip_eps_low=0.2, clip_eps_high=0.28)
    backend = TorchBackend(thinker, trainer_cfg, algo, pad_token_id=pad, device=device)
    switched = enable_exact_logprobs(thinker) if exact else {}
    engine = EmbeddedEngine(
        thinker,
        [],
        device=device,
        autocast_dtype=torch.bfloat16,
        banned_token_ids=media_token_ids(thinker) + eos,
    )
    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens)
    build_s = _sync() - t0
    torch.manual_seed(args.seed)
    steps = []
    for _ in range(args.steps):
        torch.cuda.reset_peak_memory_stats()
        # the same prompts every step: drop the towers' items so that each step encodes its
        # media as a step of new prompts does (the trainer's forwards then reuse the rollout's)
        clear_item_caches(thinker)
        t = _sync()
        groups = engine.generate(prompts, args.group, sampling)
        gen_s = _sync() - t
        adv = group_advantages(
            torch.rand(len(groups), args.group), args.group, std_normalize=True, eps=1e-6
        )
        t = _sync()
        metrics = backend.step(GRPOBatch(groups, adv, temperature=sampling.temperature))
        upd_s = _sync() - t
        row: dict[str, Any] = {
            "generation_s": round(gen_s, 3),
            "update_s": round(upd_s, 3),
            "step_s": round(gen_s + upd_s, 3),
            "new_tokens": sum(len(c.token_ids) for g in groups for c in g),
            "exact_fraction": metrics.get("train_rollout_logprob_exact_fraction"),
            "abs_diff": metrics.get("train_rollout_logprob_abs_diff"),
            "pearson": metrics.get("train_rollout_logprob_pearson"),
            "skipped_step": metrics.get("skipped_step"),
            "peak_gib": round(torch.cuda.max_memory_allocated() / GIB, 2),
            # the update's phases (TorchBackend's clock): KL reference forward, policy passes
            "reference_s": round(float(metrics.get("time_reference_s", 0.0)), 3),
            "policy_s": round(float(metrics.get("time_policy_s", 0.0)), 3),
        }
        if exact:
            watch = backend.exact_watch
            row["by_modality"] = {
                m: {"differ": b, "tokens": n} for m, (b, n) in watch.totals.items()
            }
            watch.totals.clear()
        steps.append(row)
        print(json.dumps({"mode": mode, "exact": exact, "step": row}), file=sys.stderr, flush=True)
    if args.profile:  # one more step, not timed: where the update's GPU time goes
        profile_update(
            args, backend, engine, prompts, sampling, f"{mode}_{'on' if exact else 'off'}"
        )
    timed = steps[1:] or steps
    rows = args.prompts * args.group
    out = {
        "build_s": round(build_s, 1),
        "switched": switched,
        "steps": steps,
        "samples_per_s": rows * len(timed) / sum(s["step_s"] for s in timed),
        "exact_fraction_min": min(float(s["exact_fraction"]) for s in steps),
        "abs_diff_max": max(float(s["abs_diff"]) for s in steps),
    }
    del backend, engine, thinker, vl
    gc.collect()
    torch.cuda.empty_cache()
    return out


def profile_update(
    args: argparse.Namespace, backend: Any, engine: Any, prompts: Any, sampling: Any, tag: str
) -> None:
    """``--profile DIR``: torch.profiler over one generation and one update; the kernels by
    total GPU time and by CPU time go to ``DIR/profile_<tag>_generation.txt`` and
    ``DIR/profile_<tag>.txt``."""
    from omni_grpo.algo import group_advantages
    from omni_grpo.exact.towers import clear_item_caches
    from omni_grpo.types import GRPOBatch
    from torch.profiler import ProfilerActivity, profile

    out = Path(args.profile)
    out.mkdir(parents=True, exist_ok=True)
    clear_item_caches(backend.model)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        groups = engine.generate(prompts, args.group, sampling)
        torch.cuda.synchronize()
    _write_table(prof, out / f"profile_{tag}_generation.txt")
    adv = group_advantages(
        torch.rand(len(groups), args.group), args.group, std_normalize=True, eps=1e-6
    )
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        backend.step(GRPOBatch(groups, adv, temperature=sampling.temperature))
        torch.cuda.synchronize()
    _write_table(prof, out / f"profile_{tag}.txt")


def _write_table(prof: Any, path: Path) -> None:
    """The kernels by total GPU time, then by CPU time (launch-bound phases show there)."""
    table = prof.key_averages()
    path.write_text(
        table.table(sort_by="cuda_time_total", row_limit=45, max_name_column_width=70)
        + "\n\n"
        + table.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70)
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", default="/tmp/exact_logprobs")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--image-size", type=int, default=448)
    ap.add_argument("--audio-seconds", type=float, default=30.0)
    ap.add_argument("--video-frames", type=int, default=16)
    ap.add_argument("--video-size", type=int, default=224)
    ap.add_argument("--micro-batch-size", type=int, default=16)
    ap.add_argument("--micro-batch-tokens", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--modes", default="lora,full")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", default="", help="a folder: profile one extra update per run")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit(
            "exact_logprobs.py needs a CUDA device (rollout.exact_logprobs is GPU-only)"
        )
    torch.set_num_threads(max(1, int(os.environ.get("OMNI_GRPO_TORCH_THREADS", "0")) or 4))
    work = Path(args.work)
    if not (work / "skeleton" / "vl").exists():
        make_skeleton(work / "skeleton")
    vl_dir, cfg = vl_dir_at(work / "skeleton", work / f"vl-{args.layers}", args.layers, "real")
    result: dict[str, Any] = {
        "benchmark": "exact_logprobs",
        "device": torch.cuda.get_device_name(),
        "config": {k: v for k, v in vars(args).items() if k != "work"},
        "modes": {},
    }
    for mode in args.modes.split(","):
        runs = {}
        for exact in (False, True):
            runs["on" if exact else "off"] = run_one(args, cfg, vl_dir, mode, exact)
        runs["on_over_off"] = runs["on"]["samples_per_s"] / runs["off"]["samples_per_s"]
        result["modes"][mode] = runs
    import transformers

    result["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__}
    print(json.dumps(result))


if __name__ == "__main__":
    main()

"""The released Qwen3-Omni thinker on ONE GPU: a LoRA GRPO step per phase, against the hardware.

The model is the released architecture with random bf16 weights drawn directly on the GPU (no
checkpoint exists offline): text 48 layers at real widths and vocabulary (hidden 2048, 32 heads /
4 KV groups, head dim 128, 128 experts top-8, expert FFN 768, vocab 152064), the vision tower at
real widths and depth 27, the audio tower at real widths and depth 32 (d_model 1280, 20 heads,
FFN 5120). The trainer is the real ``TorchBackend`` with ``trainer.lora`` (rank 16 on attention
+ experts by default, grouped low-rank experts) and gradient checkpointing; rollouts come from
the real embedded engine (one prefill per prompt, static-KV CUDA-graph decode). Prompts mix the
three modalities, one medium each, in one step: an image (448 x 448), 30 s of audio, a 16-frame
video (synthetic pixels and waveform: media decoding is not what is measured). End-of-turn ids
are banned, so every sample is ``--max-new-tokens`` long (the worst case).

Per step: generation seconds, the reference-logprob forward (k3 KL to the adapters-disabled
base), the policy forward/backward/optimizer; generated tokens/s and its ratio to the decode
roofline; update MFU; peak memory; rollout<->trainer logprob Pearson and mean |delta|.

Limits measured in the same run: the device-to-device copy bandwidth (a 4 GiB copy, bytes read +
written) and the bf16 matmul rate (8192^3). The decode roofline counts, for every decode step,
the bytes it must read once (``decode_step_bytes``): every dense weight of the text model (attention
projections, norms, router, LM head), the expected distinct experts hit by the step's rows
(``E * (1 - (1 - k/E)^rows)`` of 128, each 3 x 768 x 2048 bf16), the LoRA factors read in bf16,
and the KV cache of every row up to its current length (left-padding included: it is read).
Prefill is counted as FLOPs (2 x active parameters per prompt token) at the measured matmul
rate. ``generation_roofline_ratio`` = (decode bytes / copy bandwidth + prefill FLOPs / matmul
rate) / measured generation seconds. Update MFU = model FLOPs done / seconds / matmul rate, with
the FLOPs of every pass done: the reference forward, the policy forward, its recompute
(checkpointing: the decoder layers only — the LM head is outside them; with
``--checkpoint-policy selective`` without the attention's projections and core, which are kept)
and the backward's activation gradients (1x forward: the base weights are frozen, so no weight
gradients), LoRA's own FLOPs and the towers left out (small, frozen). (Until session 33 the
recompute counted the LM head too: 1.5 % more FLOPs at 8 x 8 x 512.)

Real lengths (``--lengths lognormal:MEDIAN:SIGMA``): each row's completion ends at a length drawn
per step (seeded) from a lognormal, clipped to ``--max-new-tokens``, instead of the uniform worst
case; ``--batching both`` generates every step with the static decoder and the continuous one
(``models.continuous``) on the same drawn lengths, in the same process, and reports their
tokens/s and ratio. Their roofline counts only the rows still running at each decode step (their
distinct experts and their KV): finished rows are not free in the ratio. ``--long-prompts``: 60 s
of audio and a 32-frame video in every prompt. ``--generation-only`` skips the update.

Prints ONE JSON object.

    python benchmarks/one_gpu_thinker.py --work /tmp/og                       # H200, 8 x 8 x 512
    python benchmarks/one_gpu_thinker.py --work /tmp/og --prompts 32          # 256 rows
    python benchmarks/one_gpu_thinker.py --device cpu --widths tiny --layers 2 --prompts 3 \\
        --group 2 --max-new-tokens 4 --image-size 64 --audio-seconds 2 --video-frames 4 --steps 1
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lora_memory import build_vl, vl_dir_at, write_images  # noqa: E402
from vs_trl import make_skeleton  # noqa: E402

GIB = 1 << 30
RELEASED_LAYERS = 48
REAL_AUDIO = {
    "d_model": 1280,
    "encoder_layers": 32,
    "encoder_attention_heads": 20,
    "encoder_ffn_dim": 5120,
    "downsample_hidden_size": 480,
    "conv_chunksize": 500,
}


def _sync(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def measure_limits(device: torch.device) -> dict[str, float]:
    """Copy bandwidth (bytes read + written per second) and bf16 matmul FLOP/s, medians of 10."""
    if device.type != "cuda":
        return {"copy_bytes_per_s": float("nan"), "matmul_flops_per_s": float("nan")}
    src = torch.empty(1 << 31, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)

    def timed(fn: Any) -> float:
        for _ in range(3):
            fn()
        times = []
        for _ in range(10):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return float(np.median(times))

    copy_s = timed(lambda: dst.copy_(src))
    mm_s = timed(lambda: a @ b)
    out = {
        "copy_bytes_per_s": 2 * src.numel() * src.element_size() / copy_s,
        "matmul_flops_per_s": 2 * 8192**3 / mm_s,
    }
    return out  # the buffers go with the frame; run() empties the cache after the build


def text_sizes(cfg: dict[str, Any], lora_rank: int, targets: list[str]) -> dict[str, float]:
    """Parameter counts of the text model, per kind (what a token reads and computes)."""
    t = cfg["text_config"]
    h, heads, kvh, hd = (
        t["hidden_size"],
        t["num_attention_heads"],
        t["num_key_value_heads"],
        t["head_dim"],
    )
    e, k, ffn, vocab, layers = (
        t["num_experts"],
        t["num_experts_per_tok"],
        t["moe_intermediate_size"],
        t["vocab_size"],
        t["num_hidden_layers"],
    )
    attn = h * heads * hd * 2 + h * kvh * hd * 2
    expert = 3 * ffn * h
    r = lora_rank
    attn_lora = (
        r * (2 * h + heads * hd) * 2 + r * (h + kvh * hd) * 2 if "attention" in targets else 0
    )
    expert_lora = r * (h + 2 * ffn) + r * (ffn + h) if "experts" in targets else 0  # per expert
    return {
        "layers": layers,
        "hidden": h,
        "experts": e,
        "top_k": k,
        "kv_bytes_per_token_layer": 2 * kvh * hd * 2,
        "dense_per_layer": attn + e * h + 2 * h + 2 * hd,  # attention, router, norms
        "expert_params": expert,
        "lm_head": vocab * h,
        "attn_lora_per_layer": attn_lora,
        "expert_lora_params": expert_lora,
        "active_per_token": layers * (attn + e * h + k * expert) + vocab * h,
        "attn_per_layer": attn,
        "heads": heads,
        "head_dim": hd,
    }


def decode_step_bytes(s: dict[str, float], rows: int, kv_len_sum: int) -> float:
    """Bytes one decode step over ``rows`` rows must read (bf16 weights, LoRA factors in bf16)."""
    hit = s["experts"] * (1 - (1 - s["top_k"] / s["experts"]) ** rows)
    per_layer = (
        s["dense_per_layer"]
        + s["attn_lora_per_layer"]
        + hit * (s["expert_params"] + s["expert_lora_params"])
    )
    weights = 2 * (s["layers"] * per_layer + s["lm_head"])
    return weights + kv_len_sum * s["layers"] * s["kv_bytes_per_token_layer"]


def forward_flops(s: dict[str, float], seq_lens: list[int], logits_tokens: int) -> float:
    """Forward FLOPs of the text model over sequences (matmuls + causal attention scores)."""
    per_token = 2 * (s["active_per_token"] - s["lm_head"])
    attn = sum(2 * 2 * s["layers"] * s["heads"] * s["head_dim"] * n * (n + 1) / 2 for n in seq_lens)
    return per_token * sum(seq_lens) + attn + 2 * s["lm_head"] * logits_tokens


def recompute_flops(
    s: dict[str, float], seq_lens: list[int], logits_tokens: int, policy: str
) -> float:
    """FLOPs the backward's recompute runs: the decoder layers' forward (the LM head is outside
    them); ``selective`` keeps the attention's products (projections and core) instead."""
    flops = forward_flops(s, seq_lens, logits_tokens) - 2 * s["lm_head"] * logits_tokens
    if policy == "selective":
        flops -= 2 * s["layers"] * s["attn_per_layer"] * sum(seq_lens)
        flops -= sum(
            2 * 2 * s["layers"] * s["heads"] * s["head_dim"] * n * (n + 1) / 2 for n in seq_lens
        )
    return flops


def _percentiles(lengths: list[int]) -> dict[str, float]:
    """Completion-length percentiles (p50, p90, p99), mean and max."""
    arr = np.asarray(lengths, dtype=float)
    out = {f"p{q}": float(np.percentile(arr, q)) for q in (50, 90, 99)}
    return {**out, "mean": float(arr.mean()), "max": float(arr.max())}


def draw_lengths(spec: str, rows: int, limit: int, seed: int) -> list[int]:
    """Each row's completion length: ``uniform`` (every row ``limit``: the worst case) or
    ``lognormal:MEDIAN:SIGMA`` (ceil of a lognormal draw, clipped to [1, limit])."""
    if spec == "uniform":
        return [limit] * rows
    kind, median, sigma = spec.split(":")
    if kind != "lognormal":
        raise SystemExit(f"--lengths: unknown distribution {kind!r} (uniform, lognormal:M:S)")
    draw = np.random.default_rng(seed).lognormal(np.log(float(median)), float(sigma), rows)
    return [int(x) for x in np.clip(np.ceil(draw), 1, limit)]


def variable_decode_bytes(s: dict[str, float], prompt_lens: list[int], lengths: list[int]) -> float:
    """Bytes the decode steps must read when every row runs at once and leaves when it ends:
    step t (tokens 2.. of a row come from decode steps) reads the weights the rows still running
    route to and their KV (prompt + t keys each)."""
    total = 0.0
    order = sorted(zip(lengths, prompt_lens, strict=True))
    for t in range(1, max(lengths)):
        live = [p for n, p in order if n > t]
        total += decode_step_bytes(s, len(live), sum(p + t for p in live))
    return total


def synthetic_media(args: argparse.Namespace) -> None:
    """Media loaders that return synthetic arrays: 30 s of a chirp, 16 moving colour frames."""
    import omni_grpo.data.prompt as prompt_mod
    from omni_grpo.data.media import VideoClip

    def audio(
        src: Any, max_seconds: Any = None, name: Any = None, min_samples: int = 0
    ) -> np.ndarray:
        t = np.arange(int(args.audio_seconds * 16000)) / 16000
        return (0.3 * np.sin(2 * np.pi * (200 + 50 * t) * t)).astype(np.float32)

    def video(
        src: Any, fps: float, max_frames: int, name: Any = None, lim: Any = None
    ) -> VideoClip:
        n, size = args.video_frames, args.video_size
        yy, xx = np.mgrid[0:size, 0:size] / size
        frames = [
            (np.stack([xx, yy, (xx + yy + i / n) % 1], -1) * 255).astype(np.uint8) for i in range(n)
        ]
        return VideoClip(frames=np.stack(frames), fps=2.0)

    prompt_mod.load_audio = audio
    prompt_mod.load_video = video


def real_audio_tower(
    thinker: Any, skeleton_audio: Path, device: torch.device, dtype: torch.dtype
) -> None:
    """Give the thinker's frozen audio tower real widths and depth, random weights on ``device``."""
    from omni_audio_inject.source import audio_config_of
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
        Qwen3OmniMoeAudioEncoderConfig,
    )
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeAudioEncoder

    cfg = dict(audio_config_of(skeleton_audio))
    cfg.pop("model_type", None)
    cfg.update(REAL_AUDIO)
    cfg["output_dim"] = thinker.config.text_config.hidden_size
    config = Qwen3OmniMoeAudioEncoderConfig(**cfg)
    previous = torch.get_default_dtype()
    try:
        torch.set_default_dtype(dtype)
        with torch.device(device):
            module = Qwen3OmniMoeAudioEncoder(config)
    finally:
        torch.set_default_dtype(previous)
    tower = thinker.audio.tower
    tower._module, tower._config = module.to(dtype).eval().requires_grad_(False), config


def run(args: argparse.Namespace) -> dict[str, Any]:
    from omni_grpo.algo import group_advantages
    from omni_grpo.backends.torch_backend import TorchBackend
    from omni_grpo.config import AlgoConfig, DataConfig, LoraConfig, TrainerConfig
    from omni_grpo.data.prompt import PromptBuilder
    from omni_grpo.models.loader import wrap_vl
    from omni_grpo.models.sideband import media_token_ids
    from omni_grpo.rollout.embedded import EmbeddedEngine
    from omni_grpo.trainer import end_of_turn_ids
    from omni_grpo.types import GRPOBatch, Sample, SamplingParams

    work = Path(args.work)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if not (work / "skeleton" / "vl").exists():
        make_skeleton(work / "skeleton")
    limits = measure_limits(device)
    vl_dir, cfg = vl_dir_at(work / "skeleton", work / f"vl-{args.layers}", args.layers, args.widths)
    t0 = _sync(device)
    vl = build_vl(cfg, device, dtype)
    thinker = wrap_vl(vl, vl_dir, audio_dir=work / "skeleton" / "audio", freeze_visual=True)
    if args.widths == "real":
        real_audio_tower(thinker, work / "skeleton" / "audio", device, dtype)
    build_s = _sync(device) - t0
    if device.type == "cuda":
        torch.cuda.empty_cache()

    synthetic_media(args)
    data = DataConfig(
        image_max_pixels=args.image_size**2,
        audio_max_seconds=args.audio_seconds,
        max_frames=args.video_frames,
        video_max_pixels=args.video_size**2,
    )
    builder = PromptBuilder(vl_dir, data)
    tok = builder.tokenizer
    images = write_images(work / "media", args.prompts, args.image_size)
    kinds = ["image", "audio", "video"]
    samples = []
    for i in range(args.prompts):
        kind = kinds[i % 3]
        path = images[i]
        if kind != "image":  # the loaders are synthetic (synthetic_media); the file must exist
            path = work / "media" / f"{kind}{i}.bin"
            path.write_bytes(b"synthetic")
        media = [{"type": kind, "path": str(path)}]
        text = f"<{kind}>Question {i}. Describe it in detail."
        if args.long_prompts:  # a video and a long recording in every prompt
            kind = "video+audio"
            media = []
            for item in ("video", "audio"):
                path = work / "media" / f"{item}{i}.bin"
                path.write_bytes(b"synthetic")
                media.append({"type": item, "path": str(path)})
            text = f"<video><audio>Question {i}. What is said while this happens?"
        samples.append(Sample(uid=f"p{i}", prompt=text, label="", media=media, modality=kind))
    prompts = [builder.build(s, "/") for s in samples]
    eos = end_of_turn_ids(vl_dir, tok)
    pad = int(tok.pad_token_id if tok.pad_token_id is not None else eos[0])
    targets = args.targets.split(",")
    lora = LoraConfig(
        rank=args.rank, alpha=args.alpha, targets=targets, expert_path=args.expert_path
    )
    trainer_cfg = TrainerConfig(
        device=args.device,
        lr=1e-5,
        micro_batch_size=args.micro_batch_size,
        micro_batch_tokens=args.micro_batch_tokens,
        max_grad_norm=1.0,
        lora=lora,
        gradient_checkpointing=True,
        checkpoint_policy=args.checkpoint_policy,
        compile=args.compile,
    )
    algo = AlgoConfig(kl_coef=0.01, kl_type="k3", clip_eps_low=0.2, clip_eps_high=0.28)
    backend = TorchBackend(thinker, trainer_cfg, algo, pad_token_id=pad, device=device)
    if args.exact_logprobs:  # rollout.exact_logprobs: the same switch the trainer makes
        from omni_grpo.exact import enable_exact_logprobs

        enable_exact_logprobs(thinker)
    plan: dict[str, list[int]] = {}  # this step's drawn lengths, read by the engines

    def length_plan(batch: list[Any], n: int) -> list[int]:
        return [plan["lengths"][i * n + j] for i in range(len(batch)) for j in range(n)]

    batchings = ["static", "continuous"] if args.batching == "both" else [args.batching]
    engines = {
        name: EmbeddedEngine(
            thinker,
            [],
            device=device,
            autocast_dtype=torch.bfloat16 if device.type == "cuda" else None,
            decode_fn=lambda ids: tok.decode(ids, skip_special_tokens=True),
            banned_token_ids=media_token_ids(thinker) + eos,
            batching=name,
            max_batch_rows=args.static_batch_rows if name == "static" else 512,
            length_plan=length_plan,
        )
        for name in batchings
    }
    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens)
    sizes = text_sizes(cfg, args.rank, targets)
    prompt_lens = [len(p.input_ids) for p in prompts]
    width = max(prompt_lens)
    rows = args.prompts * args.group
    # decode steps 1..N-1 (the first token comes from the prefill); row r at step t reads width + t keys
    decode_bytes = sum(
        decode_step_bytes(sizes, rows, rows * (width + t)) for t in range(1, args.max_new_tokens)
    )
    prefill_flops = forward_flops(sizes, [width] * args.prompts, args.prompts)
    roofline_s = (
        decode_bytes / limits["copy_bytes_per_s"] + prefill_flops / limits["matmul_flops_per_s"]
    )
    row_prompt_lens = [n for n in prompt_lens for _ in range(args.group)]

    from omni_grpo.exact.towers import clear_item_caches

    steps: list[dict[str, Any]] = []
    torch.manual_seed(args.seed)
    peak = 0.0
    for _ in range(args.steps):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        # exact: the same prompts every step, so each engine's rollout drops the towers' items
        # (cleared in the loop below) and is timed as new prompts cost it
        plan["lengths"] = draw_lengths(
            args.lengths, rows, args.max_new_tokens, args.seed * 1000 + len(steps)
        )
        var_roofline_s = (
            variable_decode_bytes(sizes, row_prompt_lens, plan["lengths"])
            / limits["copy_bytes_per_s"]
            + prefill_flops / limits["matmul_flops_per_s"]
        )
        by_engine: dict[str, dict[str, Any]] = {}
        for name, engine in engines.items():
            if args.exact_logprobs:
                clear_item_caches(thinker)
            t = _sync(device)
            groups = engine.generate(prompts, args.group, sampling)
            took = _sync(device) - t
            made = sum(len(c.token_ids) for gr in groups for c in gr)
            by_engine[name] = {
                "generation_s": round(took, 3),
                "new_tokens": made,
                "tokens_per_s": round(made / took, 1),
                "variable_roofline_ratio": round(var_roofline_s / took, 4),
                "peak_gib": round(torch.cuda.max_memory_allocated() / GIB, 2)
                if device.type == "cuda"
                else None,
            }
            print(json.dumps({name: by_engine[name]}), file=sys.stderr, flush=True)
        gen_s = took  # the last engine's rollout is the one trained on
        lengths = [len(c.token_ids) for gr in groups for c in gr]
        rewards = torch.rand(len(groups), args.group)
        adv = group_advantages(rewards, args.group, std_normalize=True, eps=1e-6)
        metrics: dict[str, Any] = {}
        upd_s = 0.0
        if not args.generation_only:
            t = _sync(device)
            metrics = backend.step(GRPOBatch(groups, adv, temperature=sampling.temperature))
            upd_s = _sync(device) - t
        if device.type == "cuda":
            peak = max(peak, torch.cuda.max_memory_allocated() / GIB)
        new_tokens = sum(len(c.token_ids) for gr in groups for c in gr)
        train_seqs = [n + m for n, m in zip(row_prompt_lens, lengths, strict=True)]
        fwd = forward_flops(sizes, train_seqs, new_tokens)
        # reference + policy forward + activation-gradient backward, and the recompute
        update_flops = fwd * 3 + recompute_flops(
            sizes, train_seqs, new_tokens, args.checkpoint_policy
        )
        if args.lengths == "uniform":
            var_roofline_s = roofline_s
        steps.append(
            {
                "batching": by_engine,
                "completion_lengths": _percentiles(lengths),
                "variable_roofline_s": round(var_roofline_s, 3),
                "generation_s": round(gen_s, 3),
                "reference_s": round(metrics.get("time_reference_s", float("nan")), 3),
                "policy_s": round(metrics.get("time_policy_s", float("nan")), 3),
                "update_s": round(upd_s, 3),
                "step_s": round(gen_s + upd_s, 3),
                "new_tokens": new_tokens,
                "tokens_per_s": round(new_tokens / gen_s, 1),
                "generation_roofline_ratio": round(var_roofline_s / gen_s, 4),
                "update_mfu": round(update_flops / upd_s / limits["matmul_flops_per_s"], 4)
                if upd_s
                else None,
                "logprob_pearson": metrics.get("train_rollout_logprob_pearson"),
                "logprob_abs_diff": metrics.get("train_rollout_logprob_abs_diff"),
                "logprob_exact_fraction": metrics.get("train_rollout_logprob_exact_fraction"),
                "skipped_step": metrics.get("skipped_step"),
            }
        )
        print(json.dumps({"step": steps[-1]}), file=sys.stderr, flush=True)
    if args.profile:
        profile_update(backend, groups, adv, sampling.temperature, Path(args.profile))
        profile_generation(engine, thinker, prompts, args.group, sampling, Path(args.profile))
    last = steps[-1]
    trl: dict[str, Any] | None = None
    if args.trl_steps:
        del backend, engine, thinker, vl, groups, adv
        trl = run_trl_side(args, cfg, vl_dir, samples, images)
    ours_samples_per_s = rows / last["step_s"]
    return {
        "benchmark": "one_gpu_thinker",
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "config": {
            "layers": args.layers,
            "widths": args.widths,
            "prompts": args.prompts,
            "group": args.group,
            "rows": rows,
            "max_new_tokens": args.max_new_tokens,
            "modalities": [s.modality for s in samples],
            "prompt_tokens": prompt_lens,
            "lora": {"rank": args.rank, "alpha": args.alpha, "targets": targets},
            "expert_path": args.expert_path,
            "micro_batch_size": args.micro_batch_size,
            "micro_batch_tokens": args.micro_batch_tokens,
            "gradient_checkpointing": True,
            "checkpoint_policy": args.checkpoint_policy,
            "compile": args.compile,
            "exact_logprobs": args.exact_logprobs,
            "lengths": args.lengths,
            "batching": args.batching,
            "static_batch_rows": args.static_batch_rows,
            "long_prompts": args.long_prompts,
            "audio_seconds": args.audio_seconds,
            "video_frames": args.video_frames,
            "generation_only": args.generation_only,
        },
        "limits": limits,
        "roofline": {
            "decode_bytes": decode_bytes,
            "prefill_flops": prefill_flops,
            "generation_s": roofline_s,
            "update_flops": update_flops,
        },
        "build_s": round(build_s, 1),
        "steps": steps,
        "last": last,
        "peak_allocated_gib": round(peak, 2),
        "samples_per_s": ours_samples_per_s,
        "trl": trl,
        "samples_per_s_ratio_vs_trl": ours_samples_per_s / trl["samples_per_s"] if trl else None,
        "versions": _versions(),
        "dynamo": _dynamo_counters() if args.compile else None,
    }


def _dynamo_counters() -> dict[str, Any]:
    """How many graphs ``trainer.compile`` made and where it broke them (a break costs fusion)."""
    from torch._dynamo.utils import counters

    breaks = {k.split("\n")[0][:120]: v for k, v in counters["graph_break"].items()}
    return {"stats": dict(counters["stats"]), "graph_breaks": breaks}


def run_trl_side(
    args: argparse.Namespace,
    cfg: dict[str, Any],
    vl_dir: Path,
    samples: list[Any],
    images: list[Path],
) -> dict[str, Any]:
    """The same random model (same seed), prompts and batch through TRL's ``GRPOTrainer`` with
    peft (our LoRA targets as peft's config), vision frozen, checkpointing on, after our model is
    freed. TRL gets every prompt as an image prompt (recorded in the result: ``media``), so the
    ratio is against TRL on the cheaper prompts."""
    import gc

    from omni_grpo.config import LoraConfig
    from omni_grpo.models.lora import peft_config
    from vs_trl import run_trl

    gc.collect()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_vl(cfg, device, dtype)
    # every prompt as its index's image prompt: the VL model has no audio tower, and TRL 1.16
    # passes a mixed image + video batch's frame lists to the processor as separate videos
    rows = [
        {
            "id": x.uid,
            "path": str(images[i]),
            "text": x.prompt.replace(f"<{x.modality}>", "<image>"),
        }
        for i, x in enumerate(samples)
    ]
    media = ["image"] * len(rows)
    lora = LoraConfig(rank=args.rank, alpha=args.alpha, targets=args.targets.split(","))
    trl_args = argparse.Namespace(
        device=args.device,
        media="image",
        work=args.work,
        group=args.group,
        prompts=args.prompts,
        max_new_tokens=args.max_new_tokens,
        warmup=args.trl_warmup,
        steps=args.trl_steps,
        lr=1e-5,
        seed=args.seed,
    )
    with contextlib.redirect_stdout(sys.stderr):  # TRL logs its steps on stdout: one JSON here
        out = run_trl(
            trl_args,
            vl_dir,
            rows,
            model=model,
            peft_config=peft_config(lora),
            gradient_checkpointing=True,
        )
    out["media"] = media
    return out


def profile_update(
    backend: Any, groups: list, adv: torch.Tensor, temperature: float, dst: Path
) -> None:
    """One more update under torch.profiler: the CUDA-time table by op (where the MFU goes)."""
    from omni_grpo.types import GRPOBatch

    _profile_table(lambda: backend.step(GRPOBatch(groups, adv, temperature=temperature)), dst)


def profile_generation(
    engine: Any, thinker: Any, prompts: list, group: int, sampling: Any, dst: Path
) -> None:
    """One more generation of 64 new tokens, eager (a CUDA graph's kernels are not traced one
    by one), its media encoded as in a timed step: the table as ``<dst>.generation.txt``."""
    from omni_grpo.exact.towers import clear_item_caches

    clear_item_caches(thinker)  # a no-op with the option off
    short = sampling.model_copy(update={"max_new_tokens": 64})
    before = os.environ.get("OMNI_GRPO_CUDA_GRAPH")
    os.environ["OMNI_GRPO_CUDA_GRAPH"] = "0"
    try:
        _profile_table(
            lambda: engine.generate(prompts, group, short),
            dst.with_name(dst.name + ".generation.txt"),
        )
    finally:
        if before is None:
            del os.environ["OMNI_GRPO_CUDA_GRAPH"]
        else:
            os.environ["OMNI_GRPO_CUDA_GRAPH"] = before


def _profile_table(fn: Any, dst: Path) -> None:
    """``fn()`` under torch.profiler; the ops by CUDA time (CPU time without a GPU) to ``dst``."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    sort = "cuda_time_total" if cuda else "cpu_time_total"
    dst.write_text(prof.key_averages().table(sort_by=sort, row_limit=45))


def _versions() -> dict[str, str | None]:
    import transformers

    try:
        import peft

        peft_version: str | None = peft.__version__
    except ImportError:
        peft_version = None
    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft_version,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", default="/tmp/one_gpu_thinker")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--widths", choices=["real", "tiny"], default="real")
    ap.add_argument("--layers", type=int, default=RELEASED_LAYERS)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--image-size", type=int, default=448)
    ap.add_argument("--audio-seconds", type=float, default=30.0)
    ap.add_argument("--video-frames", type=int, default=16)
    ap.add_argument("--video-size", type=int, default=224)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--targets", default="attention,experts")
    ap.add_argument("--expert-path", choices=["grouped", "peft"], default="grouped")
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument(
        "--micro-batch-tokens", type=int, default=None, help="pack rows of several prompts"
    )
    ap.add_argument(
        "--compile", action="store_true", help="trainer.compile: the decoder layers' parts compiled"
    )
    ap.add_argument(
        "--checkpoint-policy",
        choices=["layer", "selective"],
        default="layer",
        help="trainer.checkpoint_policy: recompute whole layers, or keep the attention's products",
    )
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument(
        "--exact-logprobs", action="store_true", help="rollout.exact_logprobs (omni_grpo.exact)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--lengths",
        default="uniform",
        help="completion lengths: uniform (every row --max-new-tokens) or lognormal:MEDIAN:SIGMA",
    )
    ap.add_argument(
        "--batching",
        choices=["static", "continuous", "both"],
        default="static",
        help="the embedded engine's decoder; both: each step with each, same lengths",
    )
    ap.add_argument(
        "--static-batch-rows",
        type=int,
        default=512,
        help="the static engine's max_batch_rows (its KV must fit: 64 for 256 x 4096)",
    )
    ap.add_argument(
        "--long-prompts",
        action="store_true",
        help="every prompt a 32-frame video and 60 s of audio (unless given otherwise)",
    )
    ap.add_argument("--generation-only", action="store_true", help="skip the update")
    ap.add_argument(
        "--trl-steps", type=int, default=0, help="then TRL+peft: --trl-warmup + this many steps"
    )
    ap.add_argument("--trl-warmup", type=int, default=1, help="TRL steps run before the timed ones")
    ap.add_argument(
        "--profile", default=None, help="write a profiler table of one more update here"
    )
    args = ap.parse_args()
    if args.long_prompts:
        given = set(sys.argv)
        if "--audio-seconds" not in given:
            args.audio_seconds = 60.0
        if "--video-frames" not in given:
            args.video_frames = 32
    torch.set_num_threads(max(1, int(os.environ.get("OMNI_GRPO_TORCH_THREADS", "0")) or 4))
    print(json.dumps(run(args)))


if __name__ == "__main__":
    main()

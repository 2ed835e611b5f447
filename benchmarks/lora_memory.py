"""The one-GPU memory model of LoRA GRPO on the Qwen3-Omni thinker: measured per depth, fitted per
layer, projected to the released 48 text layers and checked against a run at the deepest depth
that fits.

Each depth is one spawned process (its peak is its own). The thinker is built at the real widths
(text: hidden 2048, 32 heads / 4 KV groups, head dim 128, 128 experts top-8, expert FFN 768, vocab
152064; vision tower at its real widths AND real depth 27, deepstack 8/16/24), random weights
drawn directly in GPU memory in bf16 (the 48-layer model is ~63 GB: nothing is written to disk),
wrapped as the trainer wraps a loaded checkpoint (``omni_grpo.models.loader.wrap_vl``), then
trained by the real ``TorchBackend`` with ``trainer.lora`` and ``trainer.gradient_checkpointing``,
sampling through the real embedded engine (static-KV CUDA-graph decode). A step is the full GRPO
step: ``--prompts`` image prompts x ``--group`` samples, ``--max-new-tokens`` new tokens (the
end-of-turn ids are banned so every sample is full length: the worst case), random rewards ->
group advantages -> one update (micro-batches of one prompt's ``--group`` rows, k3 KL to the
adapters-disabled base, which costs a no-grad forward and no memory). ``--steps`` steps; the peak
is over all of them (the first allocates AdamW's state).

Per depth: peak ``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` of the generation
and update phases, the model's bf16 bytes, the adapters' fp32 bytes, AdamW's state bytes, times.
The fit is least squares of the step peak on the fit depths (``--layers``); the projection is
``intercept + 48 * slope``; the deep run (``--deep``, falling back through ``--deep-fallback``
when it does not fit) is compared with the projection at its own depth (ratio measured /
projected). The audio tower is not built (image prompts never run it); the released tower's
bf16 weights (0.65 B parameters, ~1.2 GiB) come on top when a batch has audio.

Prints ONE JSON object.

    python benchmarks/lora_memory.py --work /tmp/lm                       # H200: 2,4,8 + 48
    python benchmarks/lora_memory.py --device cpu --widths tiny --layers 1,2 --deep 3 \\
        --prompts 2 --group 2 --max-new-tokens 4 --image-size 64 --steps 1  # CPU smoke run

Runs with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (set here for the children unless
already set): reserved memory then stays close to allocated, which is what the 1-GPU example
config relies on.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_trl import REAL_TEXT, REAL_VISION, make_skeleton  # noqa: E402

RELEASED_LAYERS = 48
# The released thinker's vision tower: 27 blocks, deepstack taps after blocks 8, 16 and 24.
REAL_VISION_DEPTH = {"depth": 27, "deepstack_visual_indexes": [8, 16, 24]}
GIB = 1 << 30


def vl_dir_at(skeleton: Path, dst: Path, layers: int, widths: str) -> tuple[Path, dict[str, Any]]:
    """A weightless ``vl`` directory (config + tokenizer/processor files) at the requested widths
    and depth: what ``wrap_vl`` and the prompt builder read. Returns it and the config dict."""
    cfg = json.loads((skeleton / "vl" / "config.json").read_text())
    text, vision = cfg["text_config"], cfg["vision_config"]
    if widths == "real":
        text.update(REAL_TEXT)
        vision.update(REAL_VISION)
        vision.update(REAL_VISION_DEPTH)
        for key in ("rope_scaling", "rope_parameters"):  # head dim 128: the real M-RoPE sections
            if isinstance(text.get(key), dict) and "mrope_section" in text[key]:
                text[key]["mrope_section"] = [24, 20, 20]
    text["num_hidden_layers"] = layers
    dst.mkdir(parents=True, exist_ok=True)
    for f in (skeleton / "vl").iterdir():
        if f.suffix != ".safetensors" and f.name not in (
            "config.json",
            "model.safetensors.index.json",
        ):
            shutil.copy(f, dst / f.name)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst, cfg


def build_vl(cfg: dict[str, Any], device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """Random ``Qwen3VLMoeForConditionalGeneration`` drawn directly on ``device`` in ``dtype`` (the
    default dtype is switched for the construction: an fp32 48-layer model would not fit next to
    its bf16 copy). The fused experts are redrawn explicitly: a non-finite value from an
    uninitialised ``torch.empty`` would make every step skip and AdamW never allocate its state."""
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    config = Qwen3VLMoeConfig(**{k: v for k, v in cfg.items() if k != "omni_sideband"})
    previous = torch.get_default_dtype()
    torch.manual_seed(0)
    try:
        torch.set_default_dtype(dtype)
        with torch.device(device):
            vl = Qwen3VLMoeForConditionalGeneration(config)
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        for name, p in vl.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                p.normal_(0.0, 0.02)
    return vl.to(dtype)


def write_images(root: Path, n: int, size: int) -> list[Path]:
    """``n`` smooth colour-field PNGs (not constant: the vision tower sees real pixels)."""
    import numpy as np
    from PIL import Image

    root.mkdir(parents=True, exist_ok=True)
    yy, xx = np.mgrid[0:size, 0:size] / size
    paths = []
    for i in range(n):
        rgb = np.stack([xx, yy, (xx + yy + i / n) % 1], -1)
        paths.append(root / f"image{i}.png")
        Image.fromarray((rgb * 255).astype(np.uint8)).save(paths[-1])
    return paths


def _mem(device: torch.device) -> dict[str, float]:
    if device.type != "cuda":
        return {"max_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)}
    return {
        "allocated_gib": torch.cuda.max_memory_allocated() / GIB,
        "reserved_gib": torch.cuda.max_memory_reserved() / GIB,
    }


def _sync(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def run_depth(args: argparse.Namespace, layers: int) -> dict[str, Any]:
    """One depth: build, then ``args.steps`` full GRPO steps; peaks and sizes."""
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
    vl_dir, cfg = vl_dir_at(work / "skeleton", work / f"vl-{layers}", layers, args.widths)
    t0 = _sync(device)
    vl = build_vl(cfg, device, dtype)
    thinker = wrap_vl(vl, vl_dir, audio_dir=work / "skeleton" / "audio", freeze_visual=True)
    model_bytes = sum(p.numel() * p.element_size() for p in thinker.parameters())
    model_params = sum(p.numel() for p in thinker.parameters())
    build_s = _sync(device) - t0
    after_build = _mem(device)  # includes the random init's transients (the 48-layer build
    # peaked at 2x the model, 114.7 GiB): none of that is the training step's, so the cache is
    # released before the steps (a loaded checkpoint never goes through the init)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        after_build["reserved_after_release_gib"] = torch.cuda.memory_reserved() / GIB

    builder = PromptBuilder(vl_dir, DataConfig(image_max_pixels=args.image_size**2))
    tok = builder.tokenizer
    images = write_images(work / "media", args.prompts, args.image_size)
    prompts = [
        builder.build(
            Sample(
                uid=f"p{i}",
                prompt=f"<image>Question {i}. Describe the colours in detail.",
                label="",
                media=[{"type": "image", "path": str(path)}],
                modality="image",
            ),
            "/",
        )
        for i, path in enumerate(images)
    ]
    eos = end_of_turn_ids(vl_dir, tok)
    pad = int(tok.pad_token_id if tok.pad_token_id is not None else eos[0])
    lora = LoraConfig(rank=args.rank, alpha=args.alpha, targets=args.targets.split(","))
    trainer_cfg = TrainerConfig(
        device=args.device,
        lr=1e-5,
        micro_batch_size=args.group,
        max_grad_norm=1.0,
        lora=lora,
        gradient_checkpointing=not args.no_checkpointing,
    )
    algo = AlgoConfig(kl_coef=args.kl_coef, kl_type="k3", clip_eps_low=0.2, clip_eps_high=0.28)
    backend = TorchBackend(thinker, trainer_cfg, algo, pad_token_id=pad, device=device)
    adapters = [p for p in thinker.parameters() if p.requires_grad]
    adapter_bytes = sum(p.numel() * p.element_size() for p in adapters)
    engine = EmbeddedEngine(
        thinker,
        [],  # no stop token: every sample runs to max_new_tokens (the end-of-turn ids are banned)
        device=device,
        autocast_dtype=torch.bfloat16 if device.type == "cuda" else None,
        decode_fn=lambda ids: tok.decode(ids, skip_special_tokens=True),
        banned_token_ids=media_token_ids(thinker) + eos,
    )
    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens)
    gen_peak: dict[str, float] = {}
    upd_peak: dict[str, float] = {}
    steps = []
    torch.manual_seed(args.seed)
    for _ in range(args.steps):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t = _sync(device)
        groups = engine.generate(prompts, args.group, sampling)
        gen_s = _sync(device) - t
        g = _mem(device)
        gen_peak = {k: max(v, gen_peak.get(k, 0.0)) for k, v in g.items()}
        rewards = torch.rand(len(groups), args.group)
        adv = group_advantages(rewards, args.group, std_normalize=True, eps=1e-6)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t = _sync(device)
        metrics = backend.step(GRPOBatch(groups, adv, temperature=sampling.temperature))
        upd_s = _sync(device) - t
        u = _mem(device)
        upd_peak = {k: max(v, upd_peak.get(k, 0.0)) for k, v in u.items()}
        steps.append(
            {
                "generation_s": round(gen_s, 2),
                "update_s": round(upd_s, 2),
                "new_tokens": sum(len(c.token_ids) for gr in groups for c in gr),
                "skipped_step": metrics["skipped_step"],
                "loss": metrics["loss"],
                "kl_loss": metrics.get("kl_loss"),
            }
        )
    opt_bytes = sum(
        t.numel() * t.element_size()
        for s in backend.optimizer.state.values()
        for t in s.values()
        if torch.is_tensor(t)
    )
    peak = {k: max(gen_peak.get(k, 0.0), upd_peak.get(k, 0.0)) for k in gen_peak}
    out: dict[str, Any] = {
        "layers": layers,
        "model_params": model_params,
        "model_gib": model_bytes / GIB,
        "adapter_params": sum(p.numel() for p in adapters),
        "adapter_gib": adapter_bytes / GIB,
        "adamw_state_gib": opt_bytes / GIB,
        "after_build": after_build,
        "peak_generation": gen_peak,
        "peak_update": upd_peak,
        "peak_step": peak,
        "build_s": round(build_s, 1),
        "prompt_tokens": [len(p.input_ids) for p in prompts],
        "steps": steps,
    }
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info()
        out["card_total_gib"] = total / GIB
    return out


def fit(points: list[tuple[int, float]]) -> dict[str, float]:
    """Least squares ``peak = intercept + slope * layers``."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    intercept = my - slope * mx
    resid = max(abs(intercept + slope * x - y) for x, y in points)
    return {"intercept_gib": intercept, "per_layer_gib": slope, "max_residual_gib": resid}


def child(args: argparse.Namespace, layers: int) -> dict[str, Any]:
    cmd = [sys.executable, __file__, *sys.argv[1:], "--child", str(layers)]
    env = dict(os.environ)
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-6:]
        oom = any("OutOfMemoryError" in x or "out of memory" in x for x in tail)
        failed = {"layers": layers, "error": f"exit {proc.returncode}", "oom": oom, "tail": tail}
        print(json.dumps({"run": failed}), file=sys.stderr, flush=True)
        return failed
    result = json.loads(lines[-1][len("RESULT ") :])
    result["process_s"] = round(time.perf_counter() - t, 1)
    print(json.dumps({"run": result}), file=sys.stderr, flush=True)  # kept if a later one hangs
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", default="/tmp/lora_memory")
    ap.add_argument("--skeleton", default=None, help="dir with an extracted vl/ + audio/ pair")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--widths", choices=["real", "tiny"], default="real")
    ap.add_argument("--layers", default="2,4,8", help="fit depths")
    ap.add_argument("--deep", type=int, default=RELEASED_LAYERS, help="0: no deep run")
    ap.add_argument("--deep-fallback", default="40,32,24", help="tried in order if --deep OOMs")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--image-size", type=int, default=448)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--targets", default="attention,experts")
    ap.add_argument("--kl-coef", type=float, default=0.01)
    ap.add_argument("--no-checkpointing", action="store_true")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(max(1, int(os.environ.get("OMNI_GRPO_TORCH_THREADS", "0")) or 4))
    if args.child is not None:
        print("RESULT " + json.dumps(run_depth(args, args.child)), flush=True)
        return

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.skeleton:
        if not (work / "skeleton").exists():
            shutil.copytree(args.skeleton, work / "skeleton")
    elif not (work / "skeleton" / "vl").exists():
        make_skeleton(work / "skeleton")
    t0 = time.perf_counter()
    depths = [int(x) for x in args.layers.split(",") if x]
    runs = [child(args, d) for d in depths]
    ok = [r for r in runs if "error" not in r]
    models: dict[str, Any] = {}
    key = "allocated_gib" if args.device == "cuda" else "max_rss_gib"
    if len(ok) >= 2:
        for k in [key, "reserved_gib"] if args.device == "cuda" else [key]:
            f = fit([(r["layers"], r["peak_step"][k]) for r in ok])
            f["projected_48_gib"] = f["intercept_gib"] + RELEASED_LAYERS * f["per_layer_gib"]
            models[k] = f
    deep: dict[str, Any] | None = None
    if args.deep:
        fallback = [int(x) for x in args.deep_fallback.split(",") if x and int(x) < args.deep]
        for d in [args.deep, *fallback]:  # the deepest that fits
            deep = child(args, d)
            if "error" not in deep or not deep.get("oom"):
                break
    comparison: dict[str, Any] = {}
    if deep is not None and "error" not in deep and models:
        for k, f in models.items():
            projected = f["intercept_gib"] + deep["layers"] * f["per_layer_gib"]
            comparison[k] = {
                "layers": deep["layers"],
                "projected_gib": projected,
                "measured_gib": deep["peak_step"][k],
                "measured_over_projected": deep["peak_step"][k] / projected,
            }
    import transformers

    try:
        import peft

        peft_version = peft.__version__
    except ImportError:
        peft_version = None
    print(
        json.dumps(
            {
                "benchmark": "lora_memory",
                "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                "config": {
                    "widths": args.widths,
                    "fit_layers": depths,
                    "prompts": args.prompts,
                    "group": args.group,
                    "samples_per_step": args.prompts * args.group,
                    "max_new_tokens": args.max_new_tokens,
                    "image_size": args.image_size,
                    "lora": {"rank": args.rank, "alpha": args.alpha, "targets": args.targets},
                    "gradient_checkpointing": not args.no_checkpointing,
                    "kl_coef": args.kl_coef,
                    "micro_batch_size": args.group,
                    "steps": args.steps,
                    "dtype": "bf16" if args.device == "cuda" else "fp32",
                    "alloc_conf": os.environ.get(
                        "PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"
                    ),
                },
                "fit": models,
                "deep": comparison,
                "runs": runs,
                "deep_run": deep,
                "wall_s": round(time.perf_counter() - t0, 1),
                "versions": {
                    "torch": torch.__version__,
                    "transformers": transformers.__version__,
                    "peft": peft_version,
                },
            }
        )
    )


if __name__ == "__main__":
    main()

"""One-GPU GRPO throughput: our torch backend + embedded engine vs TRL's ``GRPOTrainer``.

Both sides train the same ``vl`` checkpoint — the thinker's real widths (hidden 2048, 32 heads / 4
KV groups, head dim 128, 128 experts top-8, expert FFN 768, vocab 152064; vision tower at its real
widths too) truncated to ``--layers`` decoder layers, random weights, bf16 — TRL loading it as
``Qwen3VLMoeForConditionalGeneration``, ours as ``load_thinker``. Same prompts (an image each, or a
video with ``--media video``), group size 8, ``max_new_tokens``, learning rate 1e-6, token-level
loss normalised over the step (ours ``loss_agg: token`` = TRL ``loss_type: dapo``), clip
0.2 / 0.28, no KL, group-std advantages, constant LR, vision tower frozen, no gradient
checkpointing on either side. TRL generates with ``model.generate`` (its path without vLLM), one
generation batch of ``prompts x group`` rows per optimizer step (``steps_per_generation`` =
gradient accumulation), then ``prompts`` micro-batches of ``group`` rows — the same micro-batching
as ours (``micro_batch_size = group``).

A step is the full GRPO step: prompts -> generation -> reward -> advantages -> update. The reward is
a cheap function of the decoded text (vowel fraction: it varies between completions, so every group
carries signal and both sides really step the optimizer). Step times are wall times between
consecutive step ends; the first ``--warmup`` steps are dropped (CUDA-graph capture, cuBLAS and
allocator warm-up on our side; the same on TRL's). Each side runs in its own process so peak
memory (``torch.cuda.max_memory_allocated``) is its own.

Prints ONE JSON object:  samples/s and generated tokens/s of both, ``ours / trl`` ratios, peak GPU
memory of both, ours' rollout<->trainer mean |logp difference| (bf16), prompt lengths, versions.

    python benchmarks/vs_trl.py --work /tmp/vs_trl                      # H200: real widths
    python benchmarks/vs_trl.py --work /tmp/vs_trl --media video
    python benchmarks/vs_trl.py --device cpu --widths tiny --image-size 64 --max-new-tokens 8 \\
        --prompts 2 --steps 2 --warmup 1 --layers 2                      # CPU smoke run
``--skeleton DIR`` takes an omni-extract ``vl`` + ``audio`` pair (any widths, real vocabulary) whose
config, tokenizer and processor files are reused; without it one is made with the tiny factory.

TRL is no project dependency. On the GPU box (no network) it travels as wheels next to the
project's own (``uv build --all-packages --wheel``), installed ``--no-deps`` into one target:
trl 1.16.0, datasets 5.2.0, dill 0.4.1, multiprocess 0.70.19, pydantic 2.14 + pydantic-core,
annotated-types, typing-inspection, typing-extensions (accelerate, pyarrow, torchvision are on the
image). Measured results: ``benchmarks/results/vs_trl_h200.json``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import pickle
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

# The thinker's real text widths (as benchmarks/megatron_step.py) and its vision tower's.
REAL_TEXT = {
    "hidden_size": 2048,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "moe_intermediate_size": 768,
    "intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
}
REAL_VISION = {
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "num_heads": 16,
    "num_position_embeddings": 2304,
    "out_hidden_size": 2048,
}
QUESTION = "What is shown here? Describe the colours, then answer in one word."


def reward_text(text: str) -> float:
    """Vowel fraction of the completion: cheap, deterministic, different for different samples."""
    return sum(ch in "aeiou" for ch in text.lower()) / max(len(text), 1)


# ------------------------------------------------------------------------------ the checkpoint
def make_skeleton(dst: Path) -> Path:
    """A tiny real-vocabulary Omni checkpoint extracted to ``dst/vl`` + ``dst/audio``."""
    from omni_extract import extract
    from omni_extract.tiny import TinyOmniSpec, make_tiny_omni

    omni = make_tiny_omni(dst / "omni", TinyOmniSpec(vocab="real", with_talker=False))
    extract(omni, dst / "vl", variant="vl")
    extract(omni, dst / "audio", variant="audio")
    shutil.rmtree(omni)
    return dst


def widen(skeleton: Path, dst: Path, layers: int, widths: str, device: str) -> Path:
    """Write a random ``vl`` checkpoint with the skeleton's files at the requested widths and depth.

    The weights are drawn on ``device`` (seconds for 3 B parameters on a GPU), written with
    ``save_pretrained`` and the skeleton's tokenizer, processor and generation files copied beside
    them; the ``omni_sideband`` block is carried over. The audio tower stays the skeleton's (image
    and video prompts never run it).
    """
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    if (dst / "config.json").is_file():
        return dst
    cfg = json.loads((skeleton / "vl" / "config.json").read_text())
    text, vision = cfg["text_config"], cfg["vision_config"]
    if widths == "real":
        text.update(REAL_TEXT)
        vision.update(REAL_VISION)
        depth = max(layers, 3)
        vision.update(depth=depth, deepstack_visual_indexes=list(range(depth - 3, depth)))
    text["num_hidden_layers"] = layers
    if widths == "real":  # head dim 128: the real interleaved M-RoPE sections
        for key in ("rope_scaling", "rope_parameters"):
            if isinstance(text.get(key), dict) and "mrope_section" in text[key]:
                text[key]["mrope_section"] = [24, 20, 20]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    config = Qwen3VLMoeConfig(**{k: v for k, v in cfg.items() if k != "omni_sideband"})
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3VLMoeForConditionalGeneration(config).to(dtype)
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    del model
    for f in (skeleton / "vl").iterdir():
        if f.suffix != ".safetensors" and f.name not in (
            "config.json",
            "model.safetensors.index.json",
        ):
            shutil.copy(f, tmp / f.name)
    written = json.loads((tmp / "config.json").read_text())
    written["omni_sideband"] = cfg["omni_sideband"]
    (tmp / "config.json").write_text(json.dumps(written, indent=2))
    os.replace(tmp, dst)
    return dst


def write_media(root: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One image (PNG) or video (frames as .npy) per prompt; smooth colour fields, not zeros."""
    from PIL import Image

    root.mkdir(parents=True, exist_ok=True)
    rows = []
    size = args.image_size if args.media == "image" else args.video_size
    yy, xx = np.mgrid[0:size, 0:size] / size
    for i in range(args.prompts):
        rgb = np.stack([xx, yy, (xx + yy + i / args.prompts) % 1], -1)
        if args.media == "image":
            path = root / f"image{i}.png"
            Image.fromarray((rgb * 255).astype(np.uint8)).save(path)
        else:
            frames = np.stack([np.roll(rgb, t * 4, axis=1) for t in range(args.frames)])
            path = root / f"video{i}.npy"
            np.save(path, (frames * 255).astype(np.uint8))
        rows.append({"id": f"p{i}", "path": str(path), "text": f"Question {i}. {QUESTION}"})
    return rows


# ------------------------------------------------------------------------------------- ours
def run_ours(args: argparse.Namespace, vl: Path, audio: Path, rows: list[dict[str, Any]]) -> dict:
    import omni_grpo
    from omni_grpo.algo import group_advantages
    from omni_grpo.backends.torch_backend import TorchBackend
    from omni_grpo.config import AlgoConfig, DataConfig, SamplingParams, TrainerConfig
    from omni_grpo.data import prompt as prompt_mod
    from omni_grpo.data.media import VideoClip
    from omni_grpo.data.prompt import PromptBuilder
    from omni_grpo.models import load_thinker
    from omni_grpo.rollout.embedded import EmbeddedEngine
    from omni_grpo.trainer import media_token_ids
    from omni_grpo.types import GRPOBatch, Sample

    # Videos are stored as decoded frames: the benchmark measures training, not PyAV.
    prompt_mod.load_video = lambda path, fps, max_frames: VideoClip(np.load(path), args.fps)
    device = torch.device(args.device)
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    model = load_thinker(vl, audio_dir=audio, dtype=dtype, device=device)
    data = DataConfig(video_fps=args.fps, image_max_pixels=args.image_size**2 * 4)
    builder = PromptBuilder(vl, data)
    tok = builder.tokenizer
    prompts = []
    for r in rows:
        sample = Sample(
            uid=r["id"],
            prompt=f"<{args.media}>{r['text']}",
            label="",
            media=[{"type": args.media, "path": r["path"]}],
            modality=args.media,
        )
        prompts.append(builder.build(sample, "/"))
    eos = [int(tok.convert_tokens_to_ids("<|im_end|>"))]
    trainer_cfg = TrainerConfig(
        device=args.device, lr=args.lr, micro_batch_size=args.group, max_grad_norm=1.0
    )
    algo = AlgoConfig(loss_agg="token", clip_eps_low=0.2, clip_eps_high=0.28, kl_coef=0.0)
    backend = TorchBackend(model, trainer_cfg, algo, pad_token_id=int(tok.pad_token_id))
    engine = EmbeddedEngine(
        model,
        eos,
        device=device,
        autocast_dtype=torch.bfloat16 if args.device == "cuda" else None,
        decode_fn=lambda ids: tok.decode(ids, skip_special_tokens=True),
        banned_token_ids=media_token_ids(model),
    )
    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens)
    torch.manual_seed(args.seed)
    ends, tokens, diffs, gen_s = [_sync_time(args.device)], [], [], []
    peak = {"generation": 0.0, "update": 0.0}
    for _ in range(args.warmup + args.steps):
        t0 = _sync_time(args.device)
        groups = engine.generate(prompts, args.group, sampling)
        gen_s.append(_sync_time(args.device) - t0)
        peak["generation"] = max(peak["generation"], _peak_gib(args.device))
        rewards = torch.tensor([[reward_text(c.text) for c in g] for g in groups])
        adv = group_advantages(rewards, args.group, std_normalize=True, eps=1e-6)
        metrics = backend.step(GRPOBatch(groups, adv, temperature=sampling.temperature))
        ends.append(_sync_time(args.device))
        peak["update"] = max(peak["update"], _peak_gib(args.device))
        tokens.append(sum(len(c.token_ids) for g in groups for c in g))
        diffs.append(metrics.get("train_rollout_logprob_abs_diff", float("nan")))
    out = _summary(args, ends, tokens)
    if args.device == "cuda":
        out["peak_gpu_mem_gib"] = max(max(peak.values()), _peak_gib(args.device))
    out.update(
        generation_s_median=statistics.median(gen_s[args.warmup :]),
        rollout_trainer_mean_abs_dlogp=statistics.fmean(diffs[args.warmup :]),
        rollout_trainer_mean_abs_dlogp_per_step=diffs,
        prompt_tokens=[len(p.input_ids) for p in prompts],
        peak_gpu_mem_gib_by_phase=peak if args.device == "cuda" else None,
        versions={
            "omni-grpo": getattr(omni_grpo, "__version__", _dist_version("omni-grpo")),
            "transformers": _dist_version("transformers"),
            "torch": torch.__version__,
        },
    )
    return out


# -------------------------------------------------------------------------------------- trl
def run_trl(
    args: argparse.Namespace,
    vl: Path,
    rows: list[dict[str, Any]],
    model: Any = None,
    peft_config: Any = None,
    gradient_checkpointing: bool = False,
) -> dict:
    """TRL's ``GRPOTrainer`` on ``rows`` (a row's ``media`` overrides ``args.media``). ``model``:
    an already built ``Qwen3VLMoeForConditionalGeneration`` (``benchmarks/one_gpu_thinker.py``
    draws the 48-layer one on the GPU) instead of loading ``vl``'s weights; ``peft_config`` is
    handed to the trainer, which wraps the model with peft itself."""
    import transformers
    import trl
    from datasets import Dataset
    from PIL import Image
    from transformers import (
        AutoImageProcessor,
        AutoTokenizer,
        Qwen3VLMoeForConditionalGeneration,
        Qwen3VLProcessor,
        Qwen3VLVideoProcessor,
        TrainerCallback,
    )
    from trl import GRPOConfig, GRPOTrainer

    device = args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if model is None:
        model = Qwen3VLMoeForConditionalGeneration.from_pretrained(vl, dtype=dtype).to(device)
    for name, p in model.named_parameters():  # frozen vision tower, as ours by default
        p.requires_grad_(not name.startswith("model.visual."))
    tok = AutoTokenizer.from_pretrained(vl)
    template = json.loads((vl / "chat_template.json").read_text())["chat_template"]
    try:  # the video processor needs torchvision (on the GPU image, not in every CPU venv)
        video_processor = Qwen3VLVideoProcessor(do_sample_frames=False)  # frames given as files
    except ImportError:
        video_processor = None
    processor = Qwen3VLProcessor(
        image_processor=AutoImageProcessor.from_pretrained(vl),
        tokenizer=tok,
        video_processor=video_processor,
        chat_template=template,
    )
    records = []
    for r in rows:
        if r.get("media", args.media) == "image":
            media = {"type": "image"}
            extra = {"image": Image.open(r["path"]).convert("RGB")}
        else:
            # transformers takes a video as a list of frame files (no decoder needed on the box)
            frames = []
            for t, f in enumerate(np.load(r["path"])):
                frames.append(str(Path(r["path"]).with_suffix(f".{t}.png")))
                Image.fromarray(f).save(frames[-1])
            media, extra = {"type": "video", "video": frames}, {}
        content = [media, {"type": "text", "text": r["text"]}]
        records.append({"prompt": [{"role": "user", "content": content}], **extra})
    try:
        dataset = Dataset.from_list(records * (args.warmup + args.steps) * 4)
    except (
        pickle.PicklingError
    ):  # some dill/pyarrow pairs cannot hash the table: skip the cache key
        import datasets.arrow_dataset

        datasets.arrow_dataset.generate_fingerprint = lambda _ds: "vs-trl"
        dataset = Dataset.from_list(records * (args.warmup + args.steps) * 4)

    tokens: list[int] = []

    def reward(completions: list[Any], completion_ids: list[list[int]], **_: Any) -> list[float]:
        tokens.append(sum(len(c) for c in completion_ids))
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [reward_text(t) for t in texts]

    ends: list[float] = []

    class StepEnds(TrainerCallback):
        def on_train_begin(self, *a: Any, **k: Any) -> None:
            ends.append(_sync_time(device))

        def on_step_end(self, *a: Any, **k: Any) -> None:
            ends.append(_sync_time(device))

    config = GRPOConfig(
        output_dir=str(Path(args.work) / "trl_out"),
        per_device_train_batch_size=args.group,
        gradient_accumulation_steps=args.prompts,  # one optimizer step = `prompts` groups
        num_generations=args.group,
        max_completion_length=args.max_new_tokens,
        max_steps=args.warmup + args.steps,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        loss_type="dapo",
        epsilon=0.2,
        epsilon_high=0.28,
        beta=0.0,
        scale_rewards="group",
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        bf16=device == "cuda",
        gradient_checkpointing=gradient_checkpointing,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        shuffle_dataset=False,
        dataloader_num_workers=0,
        seed=args.seed,
        use_cpu=device == "cpu",
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[reward],
        args=config,
        train_dataset=dataset,
        processing_class=processor,
        callbacks=[StepEnds()],
        peft_config=peft_config,
    )
    trainer.train()
    out = _summary(args, ends, tokens)
    first = records[0]
    enc = processor.apply_chat_template(
        [first["prompt"]] if first.get("image") is None else [_with_image(first)],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
    )
    out.update(
        prompt_tokens_first=len(enc["input_ids"][0]),
        versions={
            "trl": trl.__version__,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
        },
        experts_implementation=getattr(model.config, "_experts_implementation", None),
        attn_implementation=getattr(model.config, "_attn_implementation", None),
    )
    return out


def _with_image(record: dict[str, Any]) -> list[dict[str, Any]]:
    msg = copy.deepcopy(record["prompt"])
    msg[0]["content"][0] = {"type": "image", "image": record["image"]}
    return msg


# ----------------------------------------------------------------------------------- shared
def _sync_time(device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def _peak_gib(device: str) -> float:
    """Peak allocated GiB since the last call (the counter is reset)."""
    if device != "cuda":
        return 0.0
    peak = torch.cuda.max_memory_allocated() / 2**30
    torch.cuda.reset_peak_memory_stats()
    return peak


def _summary(args: argparse.Namespace, ends: list[float], tokens: list[int]) -> dict[str, Any]:
    steps = np.diff(ends).tolist()
    timed = steps[args.warmup :]
    tok = tokens[args.warmup :]
    med = statistics.median(timed)
    samples = args.prompts * args.group
    return {
        "step_s_median": med,
        "step_s_all": steps,
        "samples_per_s": samples / med,
        "generated_tokens_per_s": sum(tok) / sum(timed),
        "generated_tokens_per_step": tok,
        "peak_gpu_mem_gib": torch.cuda.max_memory_allocated() / 2**30
        if args.device == "cuda"
        else None,  # ours resets the counter per phase and overwrites this with their maximum
    }


def _dist_version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", default="/tmp/vs_trl")
    ap.add_argument("--skeleton", default=None, help="dir with an extracted vl/ + audio/ pair")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--widths", choices=["real", "tiny"], default="real")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--media", choices=["image", "video"], default="image")
    ap.add_argument("--image-size", type=int, default=448)
    ap.add_argument(
        "--video-size", type=int, default=224, help="frame side (within video_max_pixels)"
    )
    ap.add_argument("--frames", type=int, default=8)
    ap.add_argument("--fps", type=float, default=2.0)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sides", default="ours,trl", help="comma list of ours, trl")
    ap.add_argument("--side", choices=["ours", "trl"], default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(max(1, int(os.environ.get("OMNI_GRPO_TORCH_THREADS", "0")) or 4))
    work = Path(args.work)
    vl, audio = work / "vl", work / "audio"
    if args.side is not None:  # a child: one side, one JSON line
        rows = json.loads((work / f"rows-{args.media}.json").read_text())
        torch.manual_seed(args.seed)
        result = run_ours(args, vl, audio, rows) if args.side == "ours" else run_trl(args, vl, rows)
        print("RESULT " + json.dumps(result), flush=True)
        return

    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    skeleton = Path(args.skeleton) if args.skeleton else make_skeleton(work / "skeleton")
    widen(skeleton, vl, args.layers, args.widths, args.device)
    if not audio.exists():
        shutil.copytree(skeleton / "audio", audio)
    rows = write_media(work / "media", args)
    (work / f"rows-{args.media}.json").write_text(json.dumps(rows))
    prep_s = time.perf_counter() - t0
    sides: dict[str, Any] = {}
    for side in [s for s in args.sides.split(",") if s]:
        cmd = [sys.executable, __file__, *sys.argv[1:], "--side", side]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-12:]
            sides[side] = {"error": f"exit {proc.returncode}", "stderr_tail": tail}
            continue
        sides[side] = json.loads(lines[-1][len("RESULT ") :])
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "config": {
            "layers": args.layers,
            "widths": args.widths,
            "media": args.media,
            "image_size": args.image_size,
            "frames": args.frames if args.media == "video" else None,
            "prompts_per_step": args.prompts,
            "group_size": args.group,
            "samples_per_step": args.prompts * args.group,
            "max_new_tokens": args.max_new_tokens,
            "lr": args.lr,
            "loss": "token-mean over the step (ours loss_agg=token, TRL loss_type=dapo)",
            "steps_timed": args.steps,
            "warmup_steps": args.warmup,
            "dtype": "bf16" if args.device == "cuda" else "fp32",
        },
        "prepare_s": prep_s,
        **sides,
    }
    ours, theirs = sides.get("ours", {}), sides.get("trl", {})
    if "samples_per_s" in ours and "samples_per_s" in theirs:
        result["ratio_samples_per_s"] = ours["samples_per_s"] / theirs["samples_per_s"]
        result["ratio_generated_tokens_per_s"] = (
            ours["generated_tokens_per_s"] / theirs["generated_tokens_per_s"]
        )
        if ours.get("peak_gpu_mem_gib") and theirs.get("peak_gpu_mem_gib"):
            result["ratio_peak_mem"] = ours["peak_gpu_mem_gib"] / theirs["peak_gpu_mem_gib"]
    print(json.dumps(result))


if __name__ == "__main__":
    main()

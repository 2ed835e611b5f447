"""One-GPU GRPO throughput: our torch backend + embedded engine vs TRL's ``GRPOTrainer``.

Both sides train the same random bf16 ``vl`` checkpoint at the real widths cut to ``--layers``,
on the same prompts and settings, each in its own process: samples/s, generated tokens/s, peak
GPU memory and their ratios; the settings matched and how TRL gets onto the GPU box:
docs/benchmarks.md, "Methods". ``--skeleton DIR``: an extracted ``vl`` + ``audio`` pair to reuse.

    python benchmarks/vs_trl.py --work /tmp/vs_trl [--media video]      # H200: real widths
    python benchmarks/vs_trl.py --device cpu --widths tiny --image-size 64 --max-new-tokens 8 \\
        --prompts 2 --steps 2 --warmup 1 --layers 2                      # CPU smoke run
"""

import argparse
import copy
import json
import os
import pickle
import shutil
import statistics
import sys
from functools import partial
from pathlib import Path
from typing import Any

import harness
import numpy as np
import released
import thinker_rig as rig
import torch
from omni_grpo.algo import group_advantages
from omni_grpo.backends.torch_backend import TorchBackend
from omni_grpo.config import AlgoConfig, DataConfig, SamplingParams, TrainerConfig
from omni_grpo.data import prompt as prompt_mod
from omni_grpo.data.media import VideoClip
from omni_grpo.data.prompt import PromptBuilder
from omni_grpo.models import load_thinker
from omni_grpo.types import GRPOBatch, Sample
from PIL import Image

QUESTION = "What is shown here? Describe the colours, then answer in one word."
# our run's settings in TRL's words: constant LR, token-mean loss over the step (dapo), clip
# 0.2 / 0.28, no KL, group-std advantages, plain sampling; logging only, no saves
TRL_MATCHED = dict(lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, beta=0.0)
TRL_MATCHED |= dict(loss_type="dapo", epsilon=0.2, epsilon_high=0.28, scale_rewards="group")
TRL_MATCHED |= dict(temperature=1.0, top_p=1.0, top_k=0, logging_steps=1, dataloader_num_workers=0)
TRL_MATCHED |= dict(report_to="none", save_strategy="no", shuffle_dataset=False, max_grad_norm=1.0)


def reward_text(text: str) -> float:
    """Vowel fraction of the completion: cheap, deterministic, different for different samples."""
    return sum(ch in "aeiou" for ch in text.lower()) / max(len(text), 1)


def run_ours(args: argparse.Namespace, vl: Path, audio: Path, rows: list[dict[str, Any]]) -> dict:
    # Videos are stored as decoded frames: the benchmark measures training, not PyAV.
    prompt_mod.load_video = lambda path, fps, max_frames, *_: VideoClip(np.load(path), args.fps)
    dev, cuda = args.device, args.device == "cuda"
    model = load_thinker(vl, audio_dir=audio, dtype="bfloat16" if cuda else "float32", device=dev)
    data = DataConfig(video_fps=args.fps, image_max_pixels=args.image_size**2 * 4)
    builder, prompts = PromptBuilder(vl, data), []
    tok = builder.tokenizer
    for r in rows:
        media = [{"type": args.media, "path": r["path"]}]
        sample = Sample(r["id"], f"<{args.media}>{r['text']}", "", media, modality=args.media)
        prompts.append(builder.build(sample, "/"))
    cfg = TrainerConfig(device=dev, lr=args.lr, micro_batch_size=args.group, max_grad_norm=1.0)
    algo = AlgoConfig(loss_agg="token", clip_eps_low=0.2, clip_eps_high=0.28, kl_coef=0.0)
    backend = TorchBackend(model, cfg, algo, pad_token_id=int(tok.pad_token_id))
    im_end = [int(tok.convert_tokens_to_ids("<|im_end|>"))]
    engine = rig.engine(model, im_end, torch.device(dev), tok, stop=True)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens)
    torch.manual_seed(args.seed)
    ends, tokens, diffs, gen_s = [harness.now(dev)], [], [], []
    peak = {"generation": 0.0, "update": 0.0}
    for _ in range(args.warmup + args.steps):
        with harness.timed(dev) as gen:
            groups = engine.generate(prompts, args.group, sampling)
        gen_s.append(gen.s)
        peak["generation"] = max(peak["generation"], harness.peak_bytes(dev, True) / harness.GIB)
        rewards = torch.tensor([[reward_text(c.text) for c in g] for g in groups])
        adv = group_advantages(rewards, args.group, std_normalize=True, eps=1e-6)
        metrics = backend.step(GRPOBatch(groups, adv, temperature=sampling.temperature))
        ends.append(harness.now(dev))
        peak["update"] = max(peak["update"], harness.peak_bytes(dev, True) / harness.GIB)
        tokens.append(sum(len(c.token_ids) for g in groups for c in g))
        diffs.append(metrics.get("train_rollout_logprob_abs_diff", float("nan")))
    out = summary(args, ends, tokens)
    if cuda:  # the counter was reset per phase: the step's peak is the larger phase's
        out["peak_gpu_mem_gib"] = max(max(peak.values()), harness.peak_bytes(dev) / harness.GIB)
    out["generation_s_median"] = statistics.median(gen_s[args.warmup :])
    out["rollout_trainer_mean_abs_dlogp"] = statistics.fmean(diffs[args.warmup :])
    out["rollout_trainer_mean_abs_dlogp_per_step"] = diffs
    out |= {"prompt_tokens": [len(p.input_ids) for p in prompts]}
    out |= {"peak_gpu_mem_gib_by_phase": peak if cuda else None}
    return out | {"versions": harness.versions("omni-grpo")}


def run_trl(
    args: Any, vl: Path, rows: list, model: Any = None, peft: Any = None, ckpt: bool = False
) -> dict:
    """TRL's ``GRPOTrainer`` on ``rows`` (a row's ``media`` overrides ``args.media``); ``model``: a
    built VL model instead of ``vl``'s weights (one_gpu_thinker.py's), ``peft``: a peft config the
    trainer wraps it with, ``ckpt``: gradient checkpointing."""
    import transformers as tf
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    device = args.device
    if model is None:
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        model = tf.Qwen3VLMoeForConditionalGeneration.from_pretrained(vl, dtype=dtype).to(device)
    for name, p in model.named_parameters():  # frozen vision tower, as ours by default
        p.requires_grad_(not name.startswith("model.visual."))
    try:  # the video processor needs torchvision (on the GPU image, not in every CPU venv)
        video_processor = tf.Qwen3VLVideoProcessor(do_sample_frames=False)  # frames given as files
    except ImportError:
        video_processor = None
    template = json.loads((vl / "chat_template.json").read_text())["chat_template"]
    kw = dict(image_processor=tf.AutoImageProcessor.from_pretrained(vl), chat_template=template)
    kw |= dict(tokenizer=tf.AutoTokenizer.from_pretrained(vl), video_processor=video_processor)
    processor = tf.Qwen3VLProcessor(**kw)
    records = []
    for r in rows:
        if r.get("media", args.media) == "image":
            media, extra = {"type": "image"}, {"image": Image.open(r["path"]).convert("RGB")}
        else:  # transformers takes a video as a list of frame files (no decoder needed on the box)
            video = np.load(r["path"])
            frames = [str(Path(r["path"]).with_suffix(f".{t}.png")) for t in range(len(video))]
            for f, path in zip(video, frames, strict=True):
                Image.fromarray(f).save(path)
            media, extra = {"type": "video", "video": frames}, {}
        content = [media, {"type": "text", "text": r["text"]}]
        records.append({"prompt": [{"role": "user", "content": content}], **extra})
    try:
        dataset = Dataset.from_list(records * (args.warmup + args.steps) * 4)
    except pickle.PicklingError:  # some dill/pyarrow pairs cannot hash the table: no cache key
        sys.modules[Dataset.__module__].generate_fingerprint = lambda _ds: "vs-trl"
        dataset = Dataset.from_list(records * (args.warmup + args.steps) * 4)
    tokens: list[int] = []
    ends: list[float] = []

    def reward(completions: list[Any], completion_ids: list[list[int]], **_: Any) -> list[float]:
        tokens.append(sum(len(c) for c in completion_ids))
        return [reward_text(c[-1]["content"] if isinstance(c, list) else c) for c in completions]

    class StepEnds(tf.TrainerCallback):
        def on_step_end(self, *a: Any, **k: Any) -> None:
            ends.append(harness.now(device))

        on_train_begin = on_step_end

    run = dict(output_dir=str(Path(args.work) / "trl_out"), seed=args.seed, learning_rate=args.lr)
    # one optimizer step = `prompts` groups
    run |= dict(per_device_train_batch_size=args.group, gradient_accumulation_steps=args.prompts)
    run |= dict(num_generations=args.group, max_completion_length=args.max_new_tokens)
    run |= dict(max_steps=args.warmup + args.steps, bf16=device == "cuda", use_cpu=device == "cpu")
    config = GRPOConfig(**run, gradient_checkpointing=ckpt, **TRL_MATCHED)
    kw = dict(train_dataset=dataset, processing_class=processor, peft_config=peft)
    kw |= dict(model=model, reward_funcs=[reward], args=config, callbacks=[StepEnds()])
    GRPOTrainer(**kw).train()
    first = copy.deepcopy(records[0]["prompt"])
    if records[0].get("image") is not None:
        first[0]["content"][0] = {"type": "image", "image": records[0]["image"]}
    kw = dict(add_generation_prompt=True, tokenize=True, return_dict=True)
    enc = processor.apply_chat_template([first], **kw)
    out = summary(args, ends, tokens) | {"prompt_tokens_first": len(enc["input_ids"][0])}
    out["versions"] = harness.versions("trl")
    for impl in ("experts", "attn"):
        out[f"{impl}_implementation"] = getattr(model.config, f"_{impl}_implementation", None)
    return out


def summary(args: argparse.Namespace, ends: list[float], tokens: list[int]) -> dict[str, Any]:
    """Step times (between consecutive step ends) after the warm-up steps, and their rates."""
    steps = np.diff(ends).tolist()
    timed, tok = steps[args.warmup :], tokens[args.warmup :]
    med, cuda = statistics.median(timed), args.device == "cuda"
    out = {"step_s_median": med, "step_s_all": steps}
    out["samples_per_s"] = args.prompts * args.group / med
    out |= {"generated_tokens_per_s": sum(tok) / sum(timed), "generated_tokens_per_step": tok}
    out["peak_gpu_mem_gib"] = harness.peak_bytes(args.device) / harness.GIB if cuda else None
    return out


if __name__ == "__main__":
    ap = harness.parser(__doc__, work="/tmp/vs_trl", skeleton=str, device="cuda", layers=4)
    harness.add_options(ap, image_size=448, video_size=224, frames=8, fps=2.0, prompts=4, group=8)
    harness.add_options(ap, max_new_tokens=256, lr=1e-6, steps=4, warmup=1, seed=0)
    harness.add_options(ap, widths=("real", "tiny"), media=("image", "video"), sides="ours,trl")
    args = ap.parse_args()
    harness.torch_threads(4)
    work = Path(args.work)
    vl, audio = work / "vl", work / "audio"
    if args.side is not None:  # a child: one side, one JSON line
        rows = json.loads((work / f"rows-{args.media}.json").read_text())
        torch.manual_seed(args.seed)
        run = {"ours": partial(run_ours, args, vl, audio), "trl": partial(run_trl, args, vl)}
        harness.reply(run[args.side](rows))  # no such side: a KeyError, the child's error
    work.mkdir(parents=True, exist_ok=True)
    with harness.timed() as prep:
        skeleton = Path(args.skeleton or released.make_skeleton(work / "skeleton"))
        # a random vl checkpoint with the skeleton's files at these widths and depth (the vision
        # tower's: max(layers, 3)); the audio tower the skeleton's (image and video never run it)
        if not (vl / "config.json").is_file():
            tmp, depth = vl.with_name(vl.name + ".tmp"), max(args.layers, 3)
            shutil.rmtree(tmp, ignore_errors=True)
            cfg = rig.config_at(skeleton, args.layers, args.widths, depth)
            dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
            rig.build_vl(cfg, torch.device(args.device), dtype).save_pretrained(tmp)
            rig.vl_dir_at(skeleton, tmp, args.layers, args.widths, depth)  # its files over these
            os.replace(tmp, vl)
        if not audio.exists():
            shutil.copytree(skeleton / "audio", audio)
        # one image per prompt, or as a video (.npy: decoded frames) that image rolled sideways
        root, size = work / "media", getattr(args, f"{args.media}_size")
        paths = rig.write_images(root, args.prompts, size)
        for i, image in enumerate(paths if args.media == "video" else []):
            frame, paths[i] = np.asarray(Image.open(image)), root / f"video{i}.npy"
            np.save(paths[i], np.stack([np.roll(frame, t * 4, axis=1) for t in range(args.frames)]))
        rows = [{"id": f"p{i}", "path": str(p)} for i, p in enumerate(paths)]
        rows = [r | {"text": f"Question {i}. {QUESTION}"} for i, r in enumerate(rows)]
        (work / f"rows-{args.media}.json").write_text(json.dumps(rows))
    # each side in its own process: its peak memory is its own
    sides = {s: harness.rerun(s, check=False) for s in args.sides.split(",") if s}
    cuda = args.device == "cuda"
    config = {k: vars(args)[k] for k in ("layers", "widths", "media", "image_size")}
    config |= {"frames": args.frames if args.media == "video" else None}
    config |= {"prompts_per_step": args.prompts, "group_size": args.group}
    config |= {"samples_per_step": args.prompts * args.group, "max_new_tokens": args.max_new_tokens}
    loss = "token-mean over the step (ours loss_agg=token, TRL loss_type=dapo)"
    config |= {"lr": args.lr, "loss": loss, "steps_timed": args.steps, "warmup_steps": args.warmup}
    config["dtype"] = "bf16" if cuda else "fp32"
    device = torch.cuda.get_device_name() if cuda else "cpu"
    result = {"device": device, "config": config, "prepare_s": prep.s, **sides}
    ours, theirs = sides.get("ours", {}), sides.get("trl", {})
    if "samples_per_s" in ours and "samples_per_s" in theirs:
        for key in ("samples_per_s", "generated_tokens_per_s"):
            result[f"ratio_{key}"] = ours[key] / theirs[key]
        if ours.get("peak_gpu_mem_gib") and theirs.get("peak_gpu_mem_gib"):
            result["ratio_peak_mem"] = ours["peak_gpu_mem_gib"] / theirs["peak_gpu_mem_gib"]
    harness.emit("vs_trl", result, args.save)

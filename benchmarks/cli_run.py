"""The benchmark's model and prompts as an ``omni-grpo train`` run: checkpoint, media, rows, config.

Why: the benchmark times the trainer and engine objects; a user runs the CLI, which adds media
decoding, the data stream, rewards, logging and checkpoints around the same step. The drawn model
and prompts on disk with the one-GPU example's settings let the CLI's step time be compared with
the benchmark's on the same card (docs/one-gpu-lora.md, "The CLI against the benchmark").

Under ``dst``: ``vl/`` and ``audio/`` in the extracted layout, ``data/`` (each prompt's media as
real files: PNG, WAV of the chirp, MP4 with that chirp as its sound, and ``rows.jsonl``), and
``train.yaml``: ``examples/qwen3-omni-30b-lora-1gpu.yaml`` with the benchmark's sizes.
"""

import json
import shutil
from pathlib import Path
from typing import Any

import soundfile as sf
import thinker_rig
import torch
import yaml
from omni_grpo.data.synthetic import write_video_with_sound
from safetensors.torch import save_file

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "qwen3-omni-30b-lora-1gpu.yaml"
RATE = 16000


def write_run(
    dst: Path, thinker: Any, vl_dir: Path, skeleton: Path, samples: list, images: list, args: Any
) -> Path:
    """Everything ``omni-grpo train --config <dst>/train.yaml`` needs; returns that path."""
    dst, device, config = Path(dst), torch.device(args.device), Path(dst) / "train.yaml"
    # the weights under vl_dir's files (its config.json carries the sideband, not theirs)
    thinker.vl.save_pretrained(dst / "vl", max_shard_size="4GB")
    weights = thinker_rig.WEIGHTS
    shutil.copytree(vl_dir, dst / "vl", ignore=weights, dirs_exist_ok=True)
    # the frozen audio tower (the rig's or the skeleton's) as an extracted audio directory
    shutil.copytree(skeleton / "audio", dst / "audio", ignore=weights, dirs_exist_ok=True)
    tower = thinker.audio.tower
    module = tower.module(device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    state = {f"audio_tower.{k}": v.cpu().contiguous() for k, v in module.state_dict().items()}
    save_file(state, str(dst / "audio" / "model.safetensors"))
    (dst / "audio" / "config.json").write_text(json.dumps(tower.config.to_dict(), indent=2))
    # real files for the synthetic media (same sizes and durations) and the rows that name them;
    # every row a two-choice question, so that mcq scores it
    data = dst / "data"
    data.mkdir(parents=True, exist_ok=True)
    chirp, (frames, fps) = thinker_rig.chirp(args.audio_seconds, RATE), thinker_rig.video(args)
    rows = []
    for i, s in enumerate(samples):
        media = []
        for item in s.media:
            kind = item["type"]
            if kind == "image":
                path = data / images[i].name
                shutil.copy(images[i], path)
            elif kind == "audio":
                path = data / f"audio{i}.wav"
                sf.write(path, chirp, RATE, subtype="PCM_16")
            else:
                path = write_video_with_sound(data / f"video{i}.mp4", frames, fps, chirp)
            media.append({"type": kind, "path": path.name})
        row = {"uid": s.uid, "prompt": s.prompt + " Answer A or B.", "label": "A"}
        row |= {"choices": ["A", "B"], "media": media, "modality": s.modality}
        rows.append(row | {"use_audio_in_video": bool(s.use_audio_in_video)})
    (data / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # the one-GPU example's trainer (on CUDA) with this run's sizes, media limits and LoRA
    cfg = yaml.safe_load(EXAMPLE.read_text())
    cfg["run"] = {"dir": str(dst / "run"), "seed": args.seed, "steps": args.steps, "save_every": 0}
    model = {"extracted_dir": str(dst / "vl"), "audio_dir": str(dst / "audio")}
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    cfg["model"] = model | {"dtype": dtype, "freeze_visual": True}
    cfg["data"] = {"train": str(dst / "data" / "rows.jsonl"), "root": str(dst / "data")}
    cfg["data"] |= thinker_rig.media_limits(args)
    cfg["rollout"].update(n_samples=args.group, prompts_per_step=args.prompts)
    cfg["rollout"]["sampling"]["max_new_tokens"] = args.max_new_tokens
    # as the benchmark ran (its --exact-logprobs), not the CLI's auto (on with compile on CUDA)
    cfg["rollout"]["exact_logprobs"] = bool(args.exact_logprobs)
    cfg["rollout"].pop("eval_sampling", None)
    cfg.pop("eval", None)
    cfg["trainer"]["lora"].update(rank=args.rank, alpha=args.alpha, targets=args.targets.split(","))
    if device.type != "cuda":  # the CPU check of this writer: no compile, fp32
        cfg["trainer"].update(device="cpu", compile=False)
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return config

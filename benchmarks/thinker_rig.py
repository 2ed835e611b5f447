"""The released thinker drawn in device memory, its prompts and its engine: the one-GPU rig.

Random weights at the released widths (``released.py``) drawn directly on the device beside a
weightless ``vl`` directory, wrapped as the trainer wraps a loaded checkpoint; synthetic media.
"""

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import omni_grpo.data.prompt as prompt_mod
import released
import torch
from omni_audio_inject.source import audio_config_of
from omni_grpo.algo import group_advantages
from omni_grpo.backends.torch_backend import TorchBackend
from omni_grpo.config import AlgoConfig, DataConfig, TrainerConfig
from omni_grpo.data.media import VideoClip
from omni_grpo.models.loader import wrap_vl
from omni_grpo.models.sideband import media_token_ids
from omni_grpo.rollout.embedded import EmbeddedEngine
from omni_grpo.trainer import end_of_turn_ids
from omni_grpo.types import Sample
from PIL import Image
from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as omni_modeling

WEIGHTS = shutil.ignore_patterns("*.safetensors", "model.safetensors.index.json")  # not copied


def config_at(skeleton: Path, layers: int, widths: str, vision_depth: int = 0) -> dict[str, Any]:
    """The skeleton's ``vl`` config at these widths and depths (deepstack: the last 3 blocks)."""
    cfg = json.loads((skeleton / "vl" / "config.json").read_text())
    text, vision = cfg["text_config"], cfg["vision_config"]
    if widths == "real":
        text.update(released.TEXT)
        vision.update(released.VISION | released.VISION_DEPTH)
        if vision_depth:
            taps = [*range(vision_depth - 3, vision_depth)]
            vision.update(depth=vision_depth, deepstack_visual_indexes=taps)
        for key in ("rope_scaling", "rope_parameters"):  # head dim 128: the real M-RoPE sections
            if isinstance(text.get(key), dict) and "mrope_section" in text[key]:
                text[key]["mrope_section"] = list(released.ROPE["mrope_section"])
    text["num_hidden_layers"] = layers
    return cfg


def vl_dir_at(skeleton: Path, dst: Path, layers: int, widths: str, vision_depth: int = 0) -> tuple:
    """A weightless ``vl`` dir (the config, the tokenizer and processor files) and its config."""
    cfg = config_at(skeleton, layers, widths, vision_depth)
    shutil.copytree(skeleton / "vl", dst, ignore=WEIGHTS, dirs_exist_ok=True)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst, cfg


def _drawn(make: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """``make()`` in ``dtype`` on ``device`` (fp32 48 layers would not fit beside its bf16 copy)."""
    previous = torch.get_default_dtype()
    try:
        torch.set_default_dtype(dtype)
        with torch.device(device):
            return make()
    finally:
        torch.set_default_dtype(previous)


def build_vl(cfg: dict[str, Any], device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """Random ``Qwen3VLMoeForConditionalGeneration`` (seed 0) drawn directly on ``device`` in
    ``dtype``. The fused experts are redrawn explicitly: a non-finite value from an uninitialised
    ``torch.empty`` would make every step skip and AdamW never allocate its state."""
    config = Qwen3VLMoeConfig(**{k: v for k, v in cfg.items() if k != "omni_sideband"})
    torch.manual_seed(0)
    vl = _drawn(lambda: Qwen3VLMoeForConditionalGeneration(config), device, dtype)
    with torch.no_grad():
        for name, p in vl.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                p.normal_(0.0, 0.02)
    return vl.to(dtype)


def real_audio_tower(thinker: Any, skeleton_audio: Path, device: Any, dtype: torch.dtype) -> None:
    """Give the thinker's frozen audio tower real widths and depth, random weights on ``device``."""
    cfg = {**audio_config_of(skeleton_audio), **released.AUDIO}
    cfg.pop("model_type", None)
    cfg["output_dim"] = thinker.config.text_config.hidden_size
    config = omni_modeling.Qwen3OmniMoeAudioEncoderConfig(**cfg)
    module = _drawn(lambda: omni_modeling.Qwen3OmniMoeAudioEncoder(config), device, dtype)
    tower = thinker.audio.tower
    tower._module, tower._config = module.to(dtype).eval().requires_grad_(False), config


def thinker_at(cfg: dict, vl_dir: Path, skeleton: Path, device: Any, dtype: torch.dtype) -> Any:
    """``build_vl`` wrapped as the trainer wraps a loaded ``vl`` checkpoint (vision frozen)."""
    vl = build_vl(cfg, device, dtype)
    return wrap_vl(vl, vl_dir, audio_dir=skeleton / "audio", freeze_visual=True)


def colour_field(size: int, i: int, n: int) -> np.ndarray:
    """Frame ``i`` of ``n``: a smooth uint8 RGB colour field (not constant: the towers see pixels)."""
    yy, xx = np.mgrid[0:size, 0:size] / size
    return (np.stack([xx, yy, (xx + yy + i / n) % 1], -1) * 255).astype(np.uint8)


def chirp(seconds: float, rate: int = 16000) -> np.ndarray:
    """``seconds`` of a rising tone at ``rate`` Hz: every prompt's audio and video sound track."""
    t = np.arange(int(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * (200 + 50 * t) * t)).astype(np.float32)


def video(args: argparse.Namespace) -> tuple[np.ndarray, float]:
    """``--video-frames`` moving colour frames and their fps; ``--long-prompts``: spanning the sound
    (32 frames over 60 s), so the interleave spreads them through the audio as a real clip's."""
    n, long = args.video_frames, getattr(args, "long_prompts", False)
    frames = np.stack([colour_field(args.video_size, i, n) for i in range(n)])
    return frames, n / args.audio_seconds if long else 2.0


def write_images(root: Path, n: int, size: int) -> list[Path]:
    """``n`` :func:`colour_field` PNGs."""
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        Image.fromarray(colour_field(size, i, n)).save(root / f"image{i}.png")
    return [root / f"image{i}.png" for i in range(n)]


def synthetic_media(args: argparse.Namespace) -> Any:
    """Media loaders of :func:`chirp` (also each video's own sound track: use_audio_in_video) and
    :func:`video`, whatever they are asked for; the limits."""
    prompt_mod.load_audio = prompt_mod.load_video_audio = lambda *_, **__: chirp(args.audio_seconds)
    prompt_mod.load_video = lambda *_, **__: VideoClip(*video(args))
    return DataConfig(**media_limits(args))


def media_limits(args: argparse.Namespace) -> dict[str, Any]:
    """The data section's limits that let the synthetic media through whole."""
    limits = {"image_max_pixels": args.image_size**2, "audio_max_seconds": args.audio_seconds}
    return limits | {"max_frames": args.video_frames, "video_max_pixels": args.video_size**2}


def samples(work: Path, builder: Any, args: argparse.Namespace, kinds: tuple, question: str):
    """``--prompts`` samples cycling ``kinds`` (image, audio, video, text), one medium each, the
    images written for them (one per prompt, ``--image-size``) and ``builder``'s prompts.
    ``--long-prompts``: every prompt one video WITH its own sound track interleaved (one block of
    frame chunks and audio in time order: ``use_audio_in_video``), as audio-visual QA prompts
    come. The video files only need to exist: the loaders are :func:`synthetic_media`'s."""
    n, long = args.prompts, getattr(args, "long_prompts", False)
    images = write_images(work / "media", n, args.image_size)

    def medium(kind: str, i: int) -> dict[str, str]:
        path = images[i] if kind == "image" else work / "media" / f"{kind}{i}.bin"
        if kind != "image":
            path.write_bytes(b"synthetic")
        return {"type": kind, "path": str(path)}

    out = []
    for i in range(n):
        kind = kinds[i % len(kinds)]
        media = [] if kind == "text" else [medium(kind, i)]
        text = f"{'' if kind == 'text' else f'<{kind}>'}Question {i}. {question}"
        if long:
            kind, media = "video", [medium("video", i)]
            text = f"<video>Question {i}. What is said while this happens?"
        out.append(Sample(f"p{i}", text, "", media, modality=kind, use_audio_in_video=long))
    return out, images, [builder.build(s, "/") for s in out]


def stop_ids(vl_dir: Path, tok: Any) -> tuple[list[int], int]:
    """The end-of-turn ids (banned: every sample runs to ``max_new_tokens``) and the pad id."""
    eos = end_of_turn_ids(vl_dir, tok)
    return eos, int(tok.pad_token_id if tok.pad_token_id is not None else eos[0])


def engine(thinker: Any, eos: list, device: Any, tok: Any = None, stop: bool = False, **kw: Any):
    """The embedded engine with the media ids banned and the end-of-turn ids too (``stop``: they
    end a sample instead); bf16 autocast on CUDA; ``tok`` decodes the completions' text."""
    if tok is not None:
        kw["decode_fn"] = lambda ids: tok.decode(ids, skip_special_tokens=True)
    kw["autocast_dtype"] = torch.bfloat16 if device.type == "cuda" else None
    kw["banned_token_ids"] = media_token_ids(thinker) + ([] if stop else eos)
    return EmbeddedEngine(thinker, eos if stop else [], device=device, **kw)


def trainer(thinker: Any, device: torch.device, pad: int, lora: Any, kl: float, **kw: Any) -> Any:
    """The real ``TorchBackend``: checkpointing, k3 KL, clip 0.2 / 0.28, lr 1e-5 (or ``kw``)."""
    kw = {"device": str(device), "lr": 1e-5, "gradient_checkpointing": True, "lora": lora, **kw}
    algo = AlgoConfig(kl_coef=kl, kl_type="k3", clip_eps_low=0.2, clip_eps_high=0.28)
    return TorchBackend(thinker, TrainerConfig(**kw), algo, pad_token_id=pad, device=device)


def advantages(groups: list[Any], group: int) -> torch.Tensor:
    """Group advantages of uniform random rewards: the update's cost does not depend on them."""
    return group_advantages(torch.rand(len(groups), group), group, std_normalize=True, eps=1e-6)

"""Images and video frames -> ``pixel_values [N, C*T*P*P]`` + ``grid_thw``, as Qwen2-VL/Qwen3-Omni.

Our own small processor (the transformers video processors need torchvision): resize to multiples
of ``patch_size * merge_size`` within [min_pixels, max_pixels] with Pillow bicubic, rescale to [0,1],
normalise with the checkpoint's mean/std, then flatten patches in the order the vision tower
expects — one row per 16x16 patch, rows grouped by 2x2 merge window, each row laid out
(channel, temporal, patch_row, patch_col). A test checks it against ``Qwen2VLImageProcessorPil``.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class VisionProcessorConfig:
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 3136
    max_pixels: int = 12845056
    image_mean: tuple[float, ...] = field(default=(0.5, 0.5, 0.5))
    image_std: tuple[float, ...] = field(default=(0.5, 0.5, 0.5))
    rescale_factor: float = 1 / 255

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @classmethod
    def from_dir(
        cls, model_dir: str | os.PathLike[str], file: str = "preprocessor_config.json"
    ) -> VisionProcessorConfig:
        """Values from the checkpoint's processor json (defaults for keys it lacks)."""
        path = Path(model_dir) / file
        if not path.is_file():
            return cls()
        raw: dict[str, Any] = json.loads(path.read_text())
        size = raw.get("size") or {}
        kw: dict[str, Any] = {
            k: raw[k] for k in ("patch_size", "temporal_patch_size", "merge_size") if k in raw
        }
        kw["min_pixels"] = raw.get("min_pixels", size.get("shortest_edge", cls.min_pixels))
        kw["max_pixels"] = raw.get("max_pixels", size.get("longest_edge", cls.max_pixels))
        for k in ("image_mean", "image_std"):
            if k in raw:
                kw[k] = tuple(raw[k])
        if "rescale_factor" in raw:
            kw["rescale_factor"] = raw["rescale_factor"]
        return cls(**kw)


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """Target (h, w): multiples of ``factor``, area within [min_pixels, max_pixels], aspect ~kept
    (the Qwen2-VL rule: round, then scale down/up by sqrt of the area ratio with floor/ceil)."""
    if min(height, width) <= 0:
        raise ValueError(f"image of size {height}x{width} is empty")
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"aspect ratio of {height}x{width} exceeds 200")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def _resize_normalise(
    frame: np.ndarray, size: tuple[int, int], cfg: VisionProcessorConfig
) -> np.ndarray:
    """uint8 [H, W, 3] -> float32 [3, h, w] resized (PIL bicubic), rescaled and normalised."""
    from PIL import Image

    h, w = size
    img = Image.fromarray(frame)
    if img.size != (w, h):
        img = img.resize((w, h), resample=Image.Resampling.BICUBIC)
    x = np.asarray(img, dtype=np.float32) * np.float32(cfg.rescale_factor)
    x = (x - np.asarray(cfg.image_mean, np.float32)) / np.asarray(cfg.image_std, np.float32)
    return x.transpose(2, 0, 1)


def flatten_patches(
    frames: np.ndarray, cfg: VisionProcessorConfig
) -> tuple[np.ndarray, tuple[int, int, int]]:
    """``frames [T, C, H, W]`` (T a multiple of temporal_patch_size, H/W of the factor) ->
    ``[t*h*w, C*tp*P*P]`` rows ordered (t, h-block, w-block, merge-row, merge-col)."""
    T, C, H, W = frames.shape
    p, tp, m = cfg.patch_size, cfg.temporal_patch_size, cfg.merge_size
    gt, gh, gw = T // tp, H // p, W // p
    x = frames.reshape(gt, tp, C, gh // m, m, p, gw // m, m, p)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)  # t, bh, bw, mh, mw, C, tp, ph, pw
    return np.ascontiguousarray(x.reshape(gt * gh * gw, C * tp * p * p)), (gt, gh, gw)


def process_frames(
    frames: np.ndarray,
    cfg: VisionProcessorConfig,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``frames [T, H, W, 3] uint8`` (one image: T=1) -> ``(pixel_values, grid_thw [3])``.

    T is padded to a multiple of temporal_patch_size by repeating the last frame (an image becomes
    ``tp`` identical frames, as in the reference processor).
    """
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"expected frames [T, H, W, 3], got {frames.shape}")
    size = smart_resize(
        frames.shape[1],
        frames.shape[2],
        cfg.factor,
        cfg.min_pixels if min_pixels is None else min_pixels,
        cfg.max_pixels if max_pixels is None else max_pixels,
    )
    arr = np.stack([_resize_normalise(f, size, cfg) for f in frames])
    pad = (-arr.shape[0]) % cfg.temporal_patch_size
    if pad:
        arr = np.concatenate([arr, np.repeat(arr[-1:], pad, axis=0)])
    flat, grid = flatten_patches(arr, cfg)
    return torch.from_numpy(flat), torch.tensor(grid, dtype=torch.long)


def process_image(
    image: Any,
    cfg: VisionProcessorConfig,
    max_pixels: int | None = None,
    min_pixels: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A PIL image (or [H, W, 3] uint8 array) -> ``(pixel_values, grid_thw)``."""
    arr = np.asarray(image.convert("RGB") if hasattr(image, "convert") else image, dtype=np.uint8)
    return process_frames(arr[None], cfg, min_pixels=min_pixels, max_pixels=max_pixels)


def tokens_for_grid(grid_thw: torch.Tensor, merge_size: int) -> int:
    """LLM placeholder tokens of one image/video: t*h*w / merge^2."""
    return int(grid_thw.prod().item()) // (merge_size * merge_size)

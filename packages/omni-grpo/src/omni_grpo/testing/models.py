"""Hand-built Qwen3-Omni thinker batches for tests (placeholders expanded as the Omni processor does).

Each sample is a list of segments; one sample may mix text, images, videos, separate audios and
videos with their audio track (``use_audio_in_video``). The builder knows nothing of our thinker:
it follows the processor's rules (image/video ``t*h*w/merge^2`` placeholders, audio
``audio_output_lengths(frames)``, audio-in-video interleaving by temporal index, video first on
ties), so the same batch can be fed to transformers' reference and to ours.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from omni_audio_inject import audio_output_lengths, pad_audio_features

PATCH_DIM = 3 * 2 * 16 * 16  # channels * temporal_patch * patch * patch of the tiny vision tower


@dataclass
class Ids:
    audio: int
    audio_start: int
    audio_end: int
    image: int
    video: int
    vision_start: int
    vision_end: int
    pad: int
    pps: float = 13.0
    merge: int = 2

    @classmethod
    def from_sideband(cls, side: dict[str, Any], pad: int) -> Ids:
        return cls(
            audio=side["audio_token_id"],
            audio_start=side["audio_start_token_id"],
            audio_end=side["audio_end_token_id"],
            image=side["image_token_id"],
            video=side["video_token_id"],
            vision_start=side["vision_start_token_id"],
            vision_end=side["vision_end_token_id"],
            pad=pad,
            pps=float(side["position_id_per_seconds"]),
        )


def _interleave(ids: Ids, grid: tuple[int, int, int], spg: float, n_audio: int) -> list[int]:
    t, h, w = grid
    per_frame = (h // ids.merge) * (w // ids.merge)
    video_idx = [k * spg * ids.pps for k in range(t) for _ in range(per_frame)]
    out, v, a = [], 0, 0
    while v < len(video_idx) and a < n_audio:
        if video_idx[v] <= a:
            out.append(ids.video)
            v += 1
        else:
            out.append(ids.audio)
            a += 1
    out += [ids.video] * (len(video_idx) - v) + [ids.audio] * (n_audio - a)
    return out


def build_sample(segments: list[tuple], ids: Ids, gen: torch.Generator) -> dict[str, Any]:
    """Segments: ("text", [token ids]), ("image", (1,h,w)), ("video", (t,h,w), spg),
    ("audio", frames), ("av", (t,h,w), spg, frames)."""
    tokens: list[int] = []
    pix, grids, vpix, vgrids, spgs, feats = [], [], [], [], [], []
    for seg in segments:
        kind = seg[0]
        if kind == "text":
            tokens += list(seg[1])
        elif kind == "image":
            grid = seg[1]
            pix.append(torch.randn(grid[0] * grid[1] * grid[2], PATCH_DIM, generator=gen))
            grids.append(grid)
            n = grid[0] * grid[1] * grid[2] // ids.merge**2
            tokens += [ids.vision_start] + [ids.image] * n + [ids.vision_end]
        elif kind in ("video", "av"):
            grid, spg = seg[1], seg[2]
            vpix.append(torch.randn(grid[0] * grid[1] * grid[2], PATCH_DIM, generator=gen))
            vgrids.append(grid)
            spgs.append(spg)
            if kind == "video":
                n = grid[0] * grid[1] * grid[2] // ids.merge**2
                tokens += [ids.vision_start] + [ids.video] * n + [ids.vision_end]
            else:
                frames = seg[3]
                feats.append(torch.randn(1, 128, frames, generator=gen))
                body = _interleave(ids, grid, spg, int(audio_output_lengths(frames)))
                tokens += [ids.vision_start, ids.audio_start, *body, ids.audio_end, ids.vision_end]
        elif kind == "audio":
            frames = seg[1]
            feats.append(torch.randn(1, 128, frames, generator=gen))
            tokens += [ids.audio_start] + [ids.audio] * int(audio_output_lengths(frames))
            tokens += [ids.audio_end]
        else:
            raise ValueError(kind)
    return {
        "tokens": tokens,
        "pix": pix,
        "grids": grids,
        "vpix": vpix,
        "vgrids": vgrids,
        "spgs": spgs,
        "feats": feats,
    }


def build_batch(
    samples: list[list[tuple]],
    ids: Ids,
    padding_side: str = "left",
    seed: int = 0,
    first_index: int = 0,
) -> dict[str, Any]:
    """Model kwargs for a padded batch of samples (media tensors concatenated in batch order).

    Sample ``i`` draws its media from seed ``(seed, first_index + i)``, so a sample built alone
    (``first_index=i``) gets exactly the media it has inside a batch.
    """
    built = [
        build_sample(s, ids, torch.Generator().manual_seed(seed * 1000 + first_index + i))
        for i, s in enumerate(samples)
    ]
    length = max(len(b["tokens"]) for b in built)
    input_ids = torch.full((len(built), length), ids.pad, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, b in enumerate(built):
        n = len(b["tokens"])
        sl = slice(length - n, length) if padding_side == "left" else slice(0, n)
        input_ids[i, sl] = torch.tensor(b["tokens"])
        attention_mask[i, sl] = 1
    out: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask}
    pix = [p for b in built for p in b["pix"]]
    if pix:
        out["pixel_values"] = torch.cat(pix)
        out["image_grid_thw"] = torch.tensor([g for b in built for g in b["grids"]])
    vpix = [p for b in built for p in b["vpix"]]
    if vpix:
        out["pixel_values_videos"] = torch.cat(vpix)
        out["video_grid_thw"] = torch.tensor([g for b in built for g in b["vgrids"]])
        out["video_second_per_grid"] = torch.tensor([s for b in built for s in b["spgs"]])
    feats = [f for b in built for f in b["feats"]]
    if feats:
        masks = [torch.ones(1, f.shape[-1], dtype=torch.long) for f in feats]
        out["input_features"], out["feature_attention_mask"] = pad_audio_features(feats, masks)
    return out

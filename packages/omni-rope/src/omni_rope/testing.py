"""Random Omni prompt layouts for property tests (hypothesis strategies), built like the processor does.

Needs the `test` extra (hypothesis); omni-grpo tests may reuse these strategies.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from hypothesis import strategies as st

from omni_rope import (
    OmniRopeConfig,
    audio_in_video_segment_ids,
    audio_segment_ids,
    image_segment_ids,
    video_segment_ids,
)

# Seconds per temporal grid: 2 / fps for common and awkward sampled frame rates (fractional positions).
SECONDS_PER_GRID = [2.0, 1.0, 0.5, 2 / 3, 0.4, 2 / 30, 2 / 24, 2 / 1.7, 0.08, 2 / 7]


def text_ids(config: OmniRopeConfig) -> st.SearchStrategy[int]:
    """Ordinary token ids: anything but the config's media and marker ids."""
    special = {getattr(config, f) for f in vars(config) if f.endswith("_token_id")}
    return st.integers(min_value=0, max_value=5000).filter(lambda t: t not in special)


@dataclass
class Batch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    image_grid_thw: torch.Tensor | None
    video_grid_thw: torch.Tensor | None
    second_per_grids: torch.Tensor | None
    audio_seqlens: torch.Tensor | None
    use_audio_in_video: bool
    rows: list[list[str]] = field(default_factory=list)

    def kwargs(self) -> dict:
        return dict(
            image_grid_thw=self.image_grid_thw,
            video_grid_thw=self.video_grid_thw,
            second_per_grids=self.second_per_grids,
            audio_seqlens=self.audio_seqlens,
            use_audio_in_video=self.use_audio_in_video,
        )


@st.composite
def batches(
    draw,
    config: OmniRopeConfig,
    max_rows: int = 4,
    max_segments: int = 4,
    images_only: bool = False,
) -> Batch:
    """A padded batch of random text/image/video/audio layouts and its batch-global media lists.

    ``images_only``: text and single-frame images only (what the processor produces for images).
    """
    m = config.spatial_merge_size
    plain = text_ids(config)
    aiv = False if images_only else draw(st.booleans())
    kinds = ["image"] if images_only else ["image", "audio", "aiv" if aiv else "video"]
    image_t = [1] if images_only else [1, 1, 2]
    side = draw(st.sampled_from(["left", "right"]))
    spg_dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    images, videos, spgs, audios = [], [], [], []
    rows, names = [], []
    for _ in range(draw(st.integers(1, max_rows))):
        parts, row_names = [], []
        for kind in draw(st.lists(st.sampled_from(kinds), max_size=max_segments)):
            parts.append(torch.tensor(draw(st.lists(plain, max_size=4)), dtype=torch.long))
            row_names.append(kind)
            if kind == "image":
                g = [
                    draw(st.sampled_from(image_t)),
                    m * draw(st.integers(1, 4)),
                    m * draw(st.integers(1, 4)),
                ]
                images.append(g)
                parts.append(image_segment_ids(config, g))
            elif kind == "audio":
                n = draw(st.integers(1, 450))
                audios.append(n)
                parts.append(audio_segment_ids(config, n))
            else:
                g = [
                    draw(st.integers(1, 6)),
                    m * draw(st.integers(1, 3)),
                    m * draw(st.integers(1, 3)),
                ]
                spg = draw(st.sampled_from(SECONDS_PER_GRID))
                videos.append(g)
                spgs.append(spg)
                if kind == "video":
                    parts.append(video_segment_ids(config, g))
                else:
                    n = draw(st.integers(1, 700))
                    audios.append(n)
                    parts.append(audio_in_video_segment_ids(config, g, spg, n))
        parts.append(
            torch.tensor(
                draw(st.lists(plain, min_size=0 if parts else 1, max_size=5)), dtype=torch.long
            )
        )
        rows.append(torch.cat(parts))
        names.append(row_names)
    width = max(len(r) for r in rows) + draw(st.integers(0, 3))
    ids = torch.full((len(rows), width), draw(plain), dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        sl = slice(0, len(r)) if side == "right" else slice(width - len(r), width)
        ids[i, sl] = r
        mask[i, sl] = 1
    return Batch(
        input_ids=ids,
        attention_mask=mask,
        image_grid_thw=torch.tensor(images, dtype=torch.long).reshape(-1, 3) if images else None,
        video_grid_thw=torch.tensor(videos, dtype=torch.long).reshape(-1, 3) if videos else None,
        second_per_grids=torch.tensor(spgs, dtype=spg_dtype) if spgs else None,
        audio_seqlens=torch.tensor(audios, dtype=torch.long) if audios else None,
        use_audio_in_video=aiv,
        rows=names,
    )

"""Logit parity: omni-extract's pseudo Qwen3-VL-MoE + the omni-rope override == the HF Omni thinker.

Text + image + video (fractional seconds per grid, several temporal grids, left padding), fp32, eager
experts: the VL model with ``install_omni_rope`` must give the Omni thinker's logits (<= 1e-5) on a
teacher-forced forward and the same tokens and logits through ``generate()`` (prefill positions,
cached decoding with ``rope_deltas``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omni_rope import (
    OmniRopeConfig,
    image_segment_ids,
    install_omni_rope,
    video_segment_ids,
)

TOL = 1e-5


@pytest.fixture(scope="module")
def models(tiny_omni_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    from omni_extract import extract
    from transformers import (
        Qwen3OmniMoeThinkerForConditionalGeneration,
        Qwen3VLMoeForConditionalGeneration,
    )

    vl_dir = tmp_path_factory.mktemp("rope-parity") / "vl"
    extract(tiny_omni_dir, vl_dir, variant="vl")
    common = dict(dtype=torch.float32, experts_implementation="eager", attn_implementation="eager")
    omni = Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(tiny_omni_dir, **common)
    vl = Qwen3VLMoeForConditionalGeneration.from_pretrained(vl_dir, **common)
    return omni.eval(), vl.eval()


@pytest.fixture(scope="module")
def inputs(models):
    _, vl = models
    cfg = OmniRopeConfig.from_vl_config(vl.config)
    gen = torch.Generator().manual_seed(0)
    vocab = 300  # ordinary text ids of the small vocabulary (specials sit above)

    def text(n: int) -> torch.Tensor:
        return torch.randint(0, vocab, (n,), generator=gen)

    image_grid = torch.tensor([[1, 4, 4], [1, 2, 6]])
    video_grid = torch.tensor([[3, 4, 4], [4, 2, 4], [2, 4, 6]])
    seconds = torch.tensor([2 / 3, 0.5, 2 / 30])
    rows = [
        torch.cat(
            [text(3), image_segment_ids(cfg, image_grid[0]), text(2)]
            + [video_segment_ids(cfg, video_grid[0]), text(4)]
        ),
        torch.cat([text(2), video_segment_ids(cfg, video_grid[1]), text(6)]),
        torch.cat(
            [text(1), image_segment_ids(cfg, image_grid[1]), video_segment_ids(cfg, video_grid[2])]
            + [text(3)]
        ),
    ]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :], mask[i, width - len(r) :] = r, 1
    patch = 3 * 2 * 16 * 16  # channels x temporal patch x patch^2 of the tiny vision config
    return dict(
        input_ids=ids,
        attention_mask=mask,
        pixel_values=torch.randn(int(image_grid.prod(-1).sum()), patch, generator=gen),
        image_grid_thw=image_grid,
        pixel_values_videos=torch.randn(int(video_grid.prod(-1).sum()), patch, generator=gen),
        video_grid_thw=video_grid,
        video_second_per_grid=seconds,
    )


def test_teacher_forced_logits_match_the_omni_thinker(models, inputs):
    omni, vl = models
    valid = inputs["attention_mask"].bool()
    with torch.no_grad():
        ref = omni(**inputs).logits
        with install_omni_rope(vl):
            ours = vl(**inputs).logits
    assert (ours - ref)[valid].abs().max() <= TOL


def test_logits_differ_without_omni_video_positions(models, inputs):
    """Control: plain 1-D positions (what a VL model falls back to) visibly change the logits."""
    _, vl = models
    mask = inputs["attention_mask"]
    flat = (mask.cumsum(-1) - 1).clamp(min=0)[None].expand(3, -1, -1)
    with torch.no_grad(), install_omni_rope(vl):
        ours = vl(**inputs).logits
        wrong = vl(**inputs, position_ids=flat).logits
    assert (ours - wrong)[mask.bool()].abs().max() > 1e-3


def test_generate_matches_the_omni_thinker(models, inputs):
    omni, vl = models
    kw = dict(max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        ref = omni.generate(**inputs, **kw)
        with install_omni_rope(vl) as handle:
            ours = vl.generate(**inputs, **kw)
            deltas = handle.base.rope_deltas.clone()
    assert torch.equal(ours.sequences, ref.sequences)
    for step_ours, step_ref in zip(ours.logits, ref.logits, strict=True):
        assert (step_ours - step_ref).abs().max() <= TOL
    assert torch.equal(deltas, omni.model.rope_deltas)

"""The HF Qwen3-VL-MoE override: installs cleanly, positions every modality like the Omni thinker,
and walks ``video_second_per_grid`` across micro-batches."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omni_rope import (
    OmniRopeConfig,
    OmniRopeError,
    audio_in_video_segment_ids,
    audio_segment_ids,
    get_rope_index,
    image_segment_ids,
    install_omni_rope,
    next_position_ids,
    video_segment_ids,
)
from omni_rope.testing import batches


@pytest.fixture(scope="module")
def vl_model(tiny_omni_single_shard_dir, tmp_path_factory):
    from omni_extract import extract
    from transformers import Qwen3VLMoeForConditionalGeneration

    dst = tmp_path_factory.mktemp("vl") / "vl"
    extract(tiny_omni_single_shard_dir, dst, variant="vl")
    return Qwen3VLMoeForConditionalGeneration.from_pretrained(
        dst, dtype=torch.float32, experts_implementation="eager"
    ).eval()


@pytest.fixture(scope="module")
def cfg(vl_model) -> OmniRopeConfig:
    return OmniRopeConfig.from_vl_config(vl_model.config)


class Captured:
    """Records the ``position_ids`` the VL text decoder receives."""

    def __init__(self, model):
        self.seen: list[torch.Tensor] = []
        self._h = model.model.language_model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        self.seen.append(kwargs["position_ids"])

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._h.remove()


def pad_left(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :], mask[i, width - len(r) :] = r, 1
    return ids, mask


def video_batch(cfg: OmniRopeConfig):
    text = lambda n: torch.arange(n) + 5  # noqa: E731
    grids = torch.tensor([[2, 4, 4], [3, 2, 4], [1, 4, 2], [2, 2, 2]])
    seconds = torch.tensor([2 / 3, 0.5, 1.0, 2 / 30])
    rows = [
        torch.cat(
            [text(3), video_segment_ids(cfg, grids[0]), text(2), video_segment_ids(cfg, grids[1])]
        ),
        torch.cat([text(1), image_segment_ids(cfg, [1, 2, 2]), text(4)]),
        torch.cat([text(2), video_segment_ids(cfg, grids[2]), text(5)]),
        torch.cat([video_segment_ids(cfg, grids[3]), text(1)]),
    ]
    ids, mask = pad_left(rows)
    return ids, mask, torch.tensor([[1, 2, 2]]), grids, seconds


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_vl_formula_coincides_for_text_and_images(data, vl_model, cfg):
    """Qwen3-VL's own rope gives the Omni positions for text and images: only video/audio differ."""
    b = data.draw(batches(cfg, images_only=True))
    ours, ours_delta = get_rope_index(b.input_ids, b.attention_mask, cfg, **b.kwargs())
    if b.image_grid_thw is None:
        return  # VL's rope runs only with a grid; text-only is the 1-D rule on both sides
    types = (b.input_ids == cfg.image_token_id).long()
    vl, vl_delta = vl_model.model.get_rope_index(
        b.input_ids, types, image_grid_thw=b.image_grid_thw, attention_mask=b.attention_mask
    )
    assert torch.equal(ours, vl.float()) and torch.equal(ours_delta, vl_delta.float())


def test_install_and_remove_restore_the_model(vl_model, cfg):
    ids = torch.tensor([[5, 6, 7, 8]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        before = vl_model(input_ids=ids, attention_mask=mask).logits
        hooks_before = dict(vl_model._forward_pre_hooks)
        handle = install_omni_rope(vl_model)
        assert handle.config == cfg
        with pytest.raises(OmniRopeError, match="already installed"):
            install_omni_rope(vl_model)
        during = vl_model(input_ids=ids, attention_mask=mask).logits
        handle.remove()
        handle.remove()  # idempotent
        after = vl_model(input_ids=ids, attention_mask=mask).logits
    assert dict(vl_model._forward_pre_hooks) == hooks_before
    for name in (
        "_prepare_position_ids_for_generation",
        "_validate_model_kwargs",
        "_omni_rope_handle",
    ):
        assert name not in vl_model.__dict__
    assert vl_model.model.rope_deltas is None
    assert torch.equal(before, during) and torch.equal(before, after)


def test_forward_positions_and_micro_batch_cursor(vl_model, cfg):
    ids, mask, igrid, vgrid, seconds = video_batch(cfg)
    expected, deltas = get_rope_index(
        ids, mask, cfg, image_grid_thw=igrid, video_grid_thw=vgrid, second_per_grids=seconds
    )
    # Rows 0-1 hold videos 0,1 and the image; rows 2-3 videos 2,3.
    halves = [(slice(0, 2), igrid, vgrid[:2]), (slice(2, 4), None, vgrid[2:])]
    with torch.no_grad(), install_omni_rope(vl_model) as handle, Captured(vl_model) as cap:
        vl_model(
            input_ids=ids,
            attention_mask=mask,
            image_grid_thw=igrid,
            video_grid_thw=vgrid,
            video_second_per_grid=seconds,
        )
        assert torch.equal(cap.seen[-1], expected)
        assert torch.equal(vl_model.model.rope_deltas, deltas)
        # Each micro-batch gets the whole batch's list (sometimes a fresh copy): the cursor walks it.
        for rows, ig, vg in halves:
            vl_model(
                input_ids=ids[rows],
                attention_mask=mask[rows],
                image_grid_thw=ig,
                video_grid_thw=vg,
                video_second_per_grid=seconds.clone(),
            )
            assert torch.equal(cap.seen[-1], expected[:, rows])
        assert handle.cursor.remaining == 0
        # Or the list is fed once and the micro-batch forwards carry no seconds at all.
        handle.feed_second_per_grid(seconds)
        for rows, ig, vg in halves:
            vl_model(
                input_ids=ids[rows], attention_mask=mask[rows], image_grid_thw=ig, video_grid_thw=vg
            )
            assert torch.equal(cap.seen[-1], expected[:, rows])
        # Properly split lists work too.
        vl_model(
            input_ids=ids[2:],
            attention_mask=mask[2:],
            video_grid_thw=vgrid[2:],
            video_second_per_grid=seconds[2:],
        )
        assert torch.equal(cap.seen[-1], expected[:, 2:])
        with pytest.raises(OmniRopeError, match="no video_second_per_grid"):
            vl_model(input_ids=ids[2:], attention_mask=mask[2:], video_grid_thw=vgrid[2:])
        three = seconds[:3]  # a batch list with one entry too few for two 2-video micro-batches
        vl_model(
            input_ids=ids[2:],
            attention_mask=mask[2:],
            video_grid_thw=vgrid[2:],
            video_second_per_grid=three,
        )
        with pytest.raises(OmniRopeError, match="only 1 of"):
            vl_model(
                input_ids=ids[2:],
                attention_mask=mask[2:],
                video_grid_thw=vgrid[2:],
                video_second_per_grid=three,
            )
        handle.cursor.reset()


def test_audio_and_audio_in_video_positions_match_the_omni_thinker(
    vl_model, cfg, tiny_omni_single_shard_dir
):
    """The composed thinker passes feature_attention_mask; the VL model must position audio like Omni."""
    from transformers import Qwen3OmniMoeThinkerForConditionalGeneration

    omni = Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(tiny_omni_single_shard_dir)
    grids = torch.tensor([[4, 4, 4], [3, 2, 6]])
    seconds = torch.tensor([2 / 3, 1.0])
    frames = torch.tensor([250, 410, 120])  # audio-in-video 0, audio, audio-in-video 1
    text = lambda n: torch.arange(n) + 5  # noqa: E731
    rows = [
        torch.cat(
            [
                text(2),
                audio_in_video_segment_ids(cfg, grids[0], 2 / 3, 250),
                text(1),
                audio_segment_ids(cfg, 410),
                text(3),
            ]
        ),
        torch.cat([text(4), audio_in_video_segment_ids(cfg, grids[1], 1.0, 120), text(2)]),
    ]
    ids, mask = pad_left(rows)
    fam = torch.zeros(3, 410, dtype=torch.long)
    for i, n in enumerate(frames.tolist()):
        fam[i, :n] = 1
    ref, ref_delta = omni.get_rope_index(ids, None, grids, mask, True, frames, seconds)
    with torch.no_grad(), install_omni_rope(vl_model), Captured(vl_model) as cap:
        vl_model(
            input_ids=ids,
            attention_mask=mask,
            video_grid_thw=grids,
            video_second_per_grid=seconds,
            feature_attention_mask=fam,
            use_audio_in_video=True,
        )
        assert torch.equal(cap.seen[-1], ref)
        assert torch.equal(vl_model.model.rope_deltas, ref_delta)


def test_manual_decode_continues_like_generate(vl_model, cfg):
    """A manual KV-cache loop with next_position_ids reproduces generate()'s greedy tokens."""
    ids, mask, igrid, vgrid, seconds = video_batch(cfg)
    kw = dict(image_grid_thw=igrid, video_grid_thw=vgrid, video_second_per_grid=seconds)
    with torch.no_grad(), install_omni_rope(vl_model) as handle:
        out = vl_model.generate(
            input_ids=ids, attention_mask=mask, **kw, max_new_tokens=4, do_sample=False
        )
        pos, _ = handle.positions(
            ids, mask, image_grid_thw=igrid, video_grid_thw=vgrid, second_per_grid=seconds
        )
        step = vl_model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **kw)
        cache, tokens = step.cache, []
        for _ in range(4):
            nxt = step.logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(nxt)
            mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
            pos = next_position_ids(pos)
            step = vl_model(
                input_ids=nxt, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True
            )
            cache = step.cache
    assert torch.equal(out[:, ids.shape[1] :], torch.cat(tokens, dim=1))

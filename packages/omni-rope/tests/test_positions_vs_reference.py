"""Property tests: ``get_rope_index`` is bit-identical to transformers' Qwen3-Omni reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omni_rope import get_rope_index, positions_from_mm
from omni_rope.testing import batches

SETTINGS = settings(
    max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def reference(thinker, b):
    return thinker.get_rope_index(
        b.input_ids,
        b.image_grid_thw,
        b.video_grid_thw,
        b.attention_mask,
        b.use_audio_in_video,
        b.audio_seqlens,
        b.second_per_grids,
    )


def assert_identical(ours, ref):
    (pos, delta), (rpos, rdelta) = ours, ref
    assert pos.dtype == rpos.dtype == torch.float32
    assert delta.dtype == rdelta.dtype
    assert pos.shape == rpos.shape and delta.shape == rdelta.shape
    # Bit-exact, not close: the model sees these through cos/sin of large angles.
    assert torch.equal(pos, rpos), (pos != rpos).nonzero()[:5]
    assert torch.equal(delta, rdelta), (delta, rdelta)


@SETTINGS
@given(data=st.data())
def test_random_layouts_match_reference(data, rope_config, reference_thinker):
    b = data.draw(batches(rope_config))
    ours = get_rope_index(b.input_ids, b.attention_mask, rope_config, **b.kwargs())
    assert_identical(ours, reference(reference_thinker, b))


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_per_video_detection_matches_the_flag(data, rope_config):
    """``use_audio_in_video=None`` reads the layout from the tokens and agrees with the explicit flag."""
    b = data.draw(batches(rope_config))
    explicit = get_rope_index(b.input_ids, b.attention_mask, rope_config, **b.kwargs())
    kw = {**b.kwargs(), "use_audio_in_video": None}
    detected = get_rope_index(b.input_ids, b.attention_mask, rope_config, **kw)
    assert torch.equal(explicit[0], detected[0]) and torch.equal(explicit[1], detected[1])


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_long_videos_with_audio_match_reference(data, rope_config, reference_thinker):
    """Few, long segments: 16-48 frame videos with their audio (the reference's slowest path)."""
    from omni_rope import audio_in_video_segment_ids

    rows, grids, spgs, frames = [], [], [], []
    for _ in range(data.draw(st.integers(1, 3))):
        g = [data.draw(st.integers(8, 24)), 8, 8]
        spg = data.draw(st.sampled_from([1.0, 2 / 3, 2 / 30, 0.5]))
        n = data.draw(st.integers(100, 2500))
        grids.append(g), spgs.append(spg), frames.append(n)
        rows.append(
            torch.cat([torch.arange(7) + 3, audio_in_video_segment_ids(rope_config, g, spg, n)])
        )
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :], mask[i, width - len(r) :] = r, 1
    kw = dict(
        video_grid_thw=torch.tensor(grids),
        second_per_grids=torch.tensor(spgs),
        audio_seqlens=torch.tensor(frames),
        use_audio_in_video=True,
    )
    ours = get_rope_index(ids, mask, rope_config, **kw)
    ref = reference_thinker.get_rope_index(
        ids, None, kw["video_grid_thw"], mask, True, kw["audio_seqlens"], kw["second_per_grids"]
    )
    assert_identical(ours, ref)


def test_text_only_and_audio_only_batches_match_reference(rope_config, reference_thinker):
    from omni_rope import audio_segment_ids

    row = torch.cat([torch.arange(5) + 7, audio_segment_ids(rope_config, 321), torch.arange(3) + 9])
    ids = torch.zeros(3, len(row) + 2, dtype=torch.long)
    mask = torch.zeros_like(ids)
    ids[0, 2:], mask[0, 2:] = row, 1  # left padded, audio
    ids[1, :4], mask[1, :4] = torch.arange(4) + 11, 1  # right padded, text only
    ids[2, -1], mask[2, -1] = 5, 1  # a single token (the reference's delta is then 1)
    seqlens = torch.tensor([321])
    ours = get_rope_index(ids, mask, rope_config, audio_seqlens=seqlens)
    ref = reference_thinker.get_rope_index(ids, None, None, mask, False, seqlens, None)
    assert_identical(ours, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("host_max_tokens", [0, 1 << 17], ids=["on-device", "host-offload"])
@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_cuda_matches_cpu(data, rope_config, host_max_tokens, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import omni_rope.positions

    monkeypatch.setattr(omni_rope.positions, "HOST_MAX_TOKENS", host_max_tokens)
    b = data.draw(batches(rope_config))
    cpu = get_rope_index(b.input_ids, b.attention_mask, rope_config, **b.kwargs())
    kw = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in b.kwargs().items()}
    gpu = get_rope_index(b.input_ids.cuda(), b.attention_mask.cuda(), rope_config, **kw)
    assert gpu[0].device.type == "cuda" and gpu[1].device.type == "cuda"
    assert torch.equal(cpu[0], gpu[0].cpu()) and torch.equal(cpu[1], gpu[1].cpu())


def _processor_mm(b) -> dict[str, torch.Tensor]:
    """The batch as the Omni processor hands it to the thinker forward (frame masks, not lengths)."""
    mm: dict[str, torch.Tensor] = {}
    if b.image_grid_thw is not None:
        mm["image_grid_thw"] = b.image_grid_thw
    if b.video_grid_thw is not None:
        mm["video_grid_thw"] = b.video_grid_thw
    if b.second_per_grids is not None:
        mm["video_second_per_grid"] = b.second_per_grids
    if b.audio_seqlens is not None:
        lengths = torch.as_tensor(b.audio_seqlens)
        frames = int(lengths.max()) if lengths.numel() else 0
        mm["feature_attention_mask"] = (torch.arange(frames) < lengths[:, None]).long()
    return mm


@settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_positions_from_processor_tensors_match_reference(data, rope_config, reference_thinker):
    """``positions_from_mm`` (the dict the thinker forward takes) positions like the reference."""
    b = data.draw(batches(rope_config))
    ours = positions_from_mm(
        b.input_ids,
        b.attention_mask,
        _processor_mm(b),
        rope_config,
        use_audio_in_video=b.use_audio_in_video,
    )
    assert_identical(ours, reference(reference_thinker, b))

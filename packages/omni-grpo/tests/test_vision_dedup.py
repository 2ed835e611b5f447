"""The vision tower encodes each distinct item of a forward once (issue 27): same outputs as the
tower over every copy, a gradient summed over the copies, and a deep copy runs its own tower."""

from __future__ import annotations

import copy

import pytest
import torch
from omni_grpo.models.vision_dedup import first_copies
from omni_grpo.testing.towers import patches_seen


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    from omni_grpo.testing.rollouts import rollout_world

    return rollout_world(tmp_path_factory.mktemp("vision"), max_new_tokens=2)


def _items(world: dict, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Three copies of the first ``kind`` prompt's pixels around one other item of that kind."""
    key, grid_key = (
        ("pixel_values", "image_grid_thw")
        if kind == "image"
        else ("pixel_values_videos", "video_grid_thw")
    )
    mm = next(g[0].prompt.mm for g in world["groups"] if key in g[0].prompt.mm)
    a, grid = mm[key], mm[grid_key]
    b = a.flip(0) * 0.5  # another item of the same grid
    return torch.cat([a, b, a, a]), torch.cat([grid, grid, grid, grid])


def _tensors(out: object) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [t for v in out.values() for t in _tensors(v)]
    if isinstance(out, tuple | list):
        return [t for v in out for t in _tensors(v)]
    return []


@pytest.mark.parametrize("kind", ["image", "video"])
def test_distinct_items_encoded_once_with_the_same_outputs(world: dict, kind: str) -> None:
    visual = world["base"].model.visual
    pixels, grid = _items(world, kind)
    assert first_copies(pixels, grid) == [0, 1, 0, 0]
    with torch.no_grad():
        got, seen = patches_seen(visual, lambda: visual(pixels, grid_thw=grid))
        want, seen_all = patches_seen(
            visual, lambda: type(visual).forward(visual, pixels, grid_thw=grid)
        )
    assert seen == [pixels.shape[0] // 2] and seen_all == [pixels.shape[0]]
    got_t, want_t = _tensors(got), _tensors(want)
    assert len(got_t) == len(want_t) >= 2  # merged tokens and the deepstack features at least
    for g, w in zip(got_t, want_t, strict=True):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5)


def test_gradient_sums_over_the_copies_and_copies_run_their_own_tower(world: dict) -> None:
    model = copy.deepcopy(world["base"])
    visual = model.model.visual
    assert visual.forward.__self__ is visual  # the deep copy rebound the method to its tower
    visual.requires_grad_(True)
    pixels, grid = _items(world, "image")

    def grads(run) -> dict[str, torch.Tensor]:
        visual.zero_grad(set_to_none=True)
        sum(t.float().square().sum() for t in _tensors(run())).backward()
        return {n: p.grad.clone() for n, p in visual.named_parameters() if p.grad is not None}

    got = grads(lambda: visual(pixels, grid_thw=grid))
    want = grads(lambda: type(visual).forward(visual, pixels, grid_thw=grid))
    assert got.keys() == want.keys() and got
    for n in got:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # the copy's weights, not the original's
        visual.patch_embed.proj.weight.mul_(2.0)
        moved = _tensors(visual(pixels, grid_thw=grid))[0]
        base_visual = world["base"].model.visual
        orig = _tensors(base_visual(pixels, grid_thw=grid))[0]
    assert not torch.allclose(moved, orig)

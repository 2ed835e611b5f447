"""The option-off path keeps its towers' outputs per item (``models.item_cache``): the trainer's
forwards of a step find what the rollout's prefill encoded, a batch encodes only the items it has
not seen, the values are the batched tower's, and a trainable tower is never served from the
cache."""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
import torch
from omni_grpo.models.item_cache import (
    clear_item_caches,
    concat_outputs,
    cut_rows,
)
from omni_grpo.testing.towers import patches_seen
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    BaseModelOutputWithDeepstackFeatures,
)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from omni_grpo.testing.rollouts import rollout_world

    return rollout_world(tmp_path_factory.mktemp("reuse"), n_prompts=6, n=2, max_new_tokens=2)


def test_a_batched_output_is_cut_per_item_and_joins_back() -> None:
    patches, merged = [8, 4, 12], [2, 1, 3]
    out = BaseModelOutputWithDeepstackFeatures(  # the vision tower's, in transformers 5
        last_hidden_state=torch.randn(24, 5),
        pooler_output=torch.randn(6, 7),
        deepstack_features=[torch.randn(6, 7), torch.randn(6, 7)],
    )
    pieces = cut_rows(out, {24: patches, 6: merged}, 3)
    assert pieces is not None and len(pieces) == 3
    assert [p.last_hidden_state.shape[0] for p in pieces] == patches
    assert [p.deepstack_features[1].shape[0] for p in pieces] == merged
    joined = concat_outputs(pieces)
    for key in ("last_hidden_state", "pooler_output"):
        assert torch.equal(joined[key], out[key])
    assert all(
        torch.equal(a, b)
        for a, b in zip(joined.deepstack_features, out.deepstack_features, strict=True)
    )
    # pieces are copies: an item dropped from the cache does not pin the batch's rows
    assert pieces[0].pooler_output.untyped_storage().data_ptr() != (
        out.pooler_output.untyped_storage().data_ptr()
    )
    assert cut_rows(torch.randn(5, 2), {24: patches, 6: merged}, 3) is None  # unknown rows
    assert cut_rows((torch.randn(6, 2), "text"), {6: merged}, 3) is None
    assert cut_rows(None, {6: merged}, 3) == [None, None, None]


def test_the_trainers_forwards_find_the_rollouts_tower_items(world: dict[str, Any]) -> None:
    """The real flow with the option off (CPU): the engine's prefill encodes a step's images,
    videos and audios in batched calls; the backend's policy and KL-reference forwards over its
    micro-batches find every item and encode nothing again."""
    from omni_grpo.testing.towers import rollout_then_step

    caches, encoded, after = rollout_then_step(world)  # OmniThinker keeps items by itself
    assert all(misses > 0 for misses, _ in encoded.values()), encoded
    assert after == encoded  # no item encoded a second time
    # policy and reference forwards: at least two finds of every item
    assert all(c.hits >= 2 * n for c, (_, n) in zip(caches.values(), encoded.values(), strict=True))


def _first(world: dict[str, Any], key: str) -> dict[str, torch.Tensor]:
    return next(g[0].prompt.mm for g in world["groups"] if key in g[0].prompt.mm)


def test_a_batch_encodes_only_the_items_it_has_not_seen(world: dict[str, Any]) -> None:
    """Kept items are found, the rest go through the tower in one call; the joined output is
    the tower's over the whole batch (within its batch-size rounding), item for item."""
    model = copy.deepcopy(world["base"])
    visual = model.model.visual
    clear_item_caches(model)
    mm = _first(world, "pixel_values")
    a, grid = mm["pixel_values"], mm["image_grid_thw"]
    b, c = a.flip(0) * 0.5, a * 0.25  # two more items of the same grid
    with torch.no_grad():
        _, seen = patches_seen(visual, lambda: visual(a, grid_thw=grid))
        assert seen == [a.shape[0]]
        pixels, grids = torch.cat([b, a, c, a]), grid.repeat(4, 1)
        got, seen = patches_seen(visual, lambda: visual(pixels, grid_thw=grids))
        assert seen == [2 * a.shape[0]]  # b and c; a was kept, its copy is indexed
        want = type(visual).forward(visual, pixels, grid_thw=grids)
        again, seen = patches_seen(visual, lambda: visual(pixels, grid_thw=grids))
    assert seen == []  # every item kept now
    assert set(got.keys()) == set(want.keys())
    for key in want:
        pairs = zip(got[key], want[key], strict=True) if isinstance(want[key], list) else None
        for g, w in pairs or [(got[key], want[key])]:
            assert g.shape == w.shape, key
            torch.testing.assert_close(g, w, rtol=0, atol=1e-5)
    assert torch.equal(again.pooler_output, got.pooler_output)


@pytest.mark.parametrize("exact", [False, True])
def test_an_audio_is_found_whatever_its_batch_padded_it_to(
    world: dict[str, Any], exact: bool
) -> None:
    """The rollout's batch and a trainer's micro-batch pad an audio to different lengths: it is
    found either way, with the option off and in exact mode (one audio per call there)."""
    from omni_grpo.exact.towers import encode_towers_per_item

    model = copy.deepcopy(world["base"])
    tower = model.audio.tower  # shared by the world's models: put back as it was below
    before = (tower.encode, tower.omni_item_cache)
    if exact:
        encode_towers_per_item(model)
    cache = tower.omni_item_cache
    clear_item_caches(model)
    mm = _first(world, "input_features")
    feats, mask = mm["input_features"][:1], mm["feature_attention_mask"][:1]
    args = {"device": "cpu", "dtype": torch.float32}
    first = tower.encode(feats, mask, **args)
    padded = torch.cat([feats, torch.zeros(1, feats.shape[1], 7)], dim=2)
    longer = torch.cat([mask, torch.zeros(1, 7, dtype=mask.dtype)], dim=1)
    misses = cache.misses
    again = tower.encode(padded, longer, **args)
    assert cache.misses == misses and torch.equal(again, first)
    plain = type(tower).encode(tower, padded, longer, **args)
    torch.testing.assert_close(again, plain, rtol=0, atol=1e-5)
    tower.encode, tower.omni_item_cache = before


def test_a_trainable_tower_is_never_served_from_the_cache(world: dict[str, Any]) -> None:
    model = copy.deepcopy(world["base"])
    visual = model.model.visual
    mm = _first(world, "pixel_values")
    a, grid = mm["pixel_values"], mm["image_grid_thw"]
    visual.requires_grad_(True)
    assert not visual.omni_item_cache.enabled()
    first = visual(a, grid_thw=grid).pooler_output
    assert first.requires_grad
    _, seen = patches_seen(visual, lambda: visual(a, grid_thw=grid))
    assert seen == [a.shape[0]]


def test_weights_written_in_place_drop_the_kept_items(world: dict[str, Any]) -> None:
    """A rollout actor's tower is frozen, yet a weight sync writes it (``copy_``): what was kept
    for the old weights is never served for the new ones."""
    model = copy.deepcopy(world["base"])
    visual = model.model.visual
    mm = _first(world, "pixel_values")
    a, grid = mm["pixel_values"], mm["image_grid_thw"]
    with torch.no_grad():
        first = visual(a, grid_thw=grid).pooler_output
        _, seen = patches_seen(visual, lambda: visual(a, grid_thw=grid))
        assert seen == [] and visual.omni_item_cache.entries
        weight = visual.patch_embed.proj.weight
        weight.copy_(weight * 2.0)
        moved, seen = patches_seen(visual, lambda: visual(a, grid_thw=grid))
    assert seen == [a.shape[0]]
    assert not torch.allclose(moved.pooler_output, first)
    assert len(visual.omni_item_cache.entries) == 1  # the new weights' output, kept


def test_a_model_with_kept_items_copies_and_pickles(world: dict[str, Any]) -> None:
    """The full fine-tuning KL reference is a deep copy: its vision tower keeps its own items
    (its own weights), the shared audio tower one cache; Ray actors pickle models."""
    model = copy.deepcopy(world["base"])
    mm = _first(world, "pixel_values")
    with torch.no_grad():
        model.model.visual(mm["pixel_values"], grid_thw=mm["image_grid_thw"])
    twin = copy.deepcopy(model)
    assert twin.model.visual.omni_item_cache is not model.model.visual.omni_item_cache
    assert twin.model.visual.omni_item_cache.tower is twin.model.visual
    assert twin.audio.tower is model.audio.tower
    back = pickle.loads(pickle.dumps(model.audio.tower))
    assert back.encode.func is model.audio.tower.encode.func and back.encode.args == (back,)


def test_lora_on_the_vision_tower_turns_its_cache_off(world: dict[str, Any]) -> None:
    """The cache is made with the model, the adapters come later (the backend injects them):
    they count, so a vision tower with trainable adapters is never served kept items."""
    from omni_grpo.backends.torch_backend import TorchBackend
    from omni_grpo.config import AlgoConfig, LoraConfig, TrainerConfig

    model = copy.deepcopy(world["base"])
    assert model.model.visual.omni_item_cache.enabled()
    cfg = TrainerConfig(device="cpu", lora=LoraConfig(rank=4, targets=["attention", "visual"]))
    TorchBackend(model, cfg, AlgoConfig(), pad_token_id=world["eos"])
    assert not model.model.visual.omni_item_cache.enabled()

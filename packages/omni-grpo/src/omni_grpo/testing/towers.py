"""Rigs for the towers' kept items (``models.item_cache``, ``exact.towers``): the real rollout ->
update flow with the caches counted, and the patches a vision tower really encoded."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

CacheCounts = dict[str, tuple[int, int]]  # cache name -> (misses, entries)


def patches_seen(visual: nn.Module, run: Callable[[], Any]) -> tuple[Any, list[int]]:
    """``run()``'s result and the patch rows of each call into ``visual``'s patch embedding
    (what the tower really encoded, after deduplication and kept items)."""
    seen: list[int] = []
    handle = visual.patch_embed.register_forward_pre_hook(lambda _m, a: seen.append(a[0].shape[0]))
    try:
        return run(), seen
    finally:
        handle.remove()


def rollout_then_step(
    world: dict[str, Any], install: Callable[[nn.Module], None] | None = None
) -> tuple[dict[str, Any], CacheCounts, CacheCounts]:
    """A copy of ``world``'s model as a LoRA policy (attention + experts, KL on, checkpointed,
    micro-batches of 4 rows); ``install(model)`` after the backend is built (exact mode, say);
    the embedded engine's rollout of the world's prompts (2 samples, 2 tokens), then one
    backend step on it. Returns the vision and audio caches and their counts after the rollout
    and after the step. ``world``: ``rollout_world(..., n_prompts=6)`` (images, videos, audios)."""
    from omni_grpo.algo import group_advantages
    from omni_grpo.backends.torch_backend import TorchBackend
    from omni_grpo.config import AlgoConfig, LoraConfig, SamplingParams, TrainerConfig
    from omni_grpo.models.item_cache import clear_item_caches
    from omni_grpo.rollout.embedded import EmbeddedEngine
    from omni_grpo.trainer import media_token_ids
    from omni_grpo.types import GRPOBatch

    model = copy.deepcopy(world["base"])
    cfg = TrainerConfig(
        device="cpu",
        lora=LoraConfig(rank=4, targets=["attention", "experts"]),
        micro_batch_size=4,
        gradient_checkpointing=True,
    )
    backend = TorchBackend(model, cfg, AlgoConfig(kl_coef=0.01), pad_token_id=world["eos"])
    if install is not None:
        install(model)
    clear_item_caches(model)  # the audio tower (and its cache) is shared by the world's models
    caches = {
        "visual": model.model.visual.omni_item_cache,
        "audio": model.audio.tower.omni_item_cache,
    }

    def counts() -> CacheCounts:
        return {name: (c.misses, len(c.entries)) for name, c in caches.items()}

    engine = EmbeddedEngine(model, [world["eos"]], banned_token_ids=media_token_ids(model))
    torch.manual_seed(0)
    groups = engine.generate(world["prompts"], 2, SamplingParams(max_new_tokens=2))
    kinds = {key for g in groups for key in g[0].prompt.mm}
    missing = {"pixel_values", "pixel_values_videos", "input_features"} - kinds
    if missing:
        raise AssertionError(f"the world's rollout has no {sorted(missing)}: use n_prompts=6")
    encoded = counts()
    advantages = group_advantages(torch.rand(len(groups), 2), 2, std_normalize=True, eps=1e-6)
    metrics = backend.step(GRPOBatch(groups, advantages, temperature=1.0))
    if metrics["skipped_step"]:
        raise AssertionError(f"the step was skipped: {metrics}")
    return caches, encoded, counts()

"""The composed thinker as the trainer sees it: what trains, what syncs, what is saved, what fails.

The audio tower must stay out of the optimizer, gradient sync (DDP), checkpoints and weight-sync
name lists; saving must round-trip through ``load_thinker``; bad inputs must fail with the counts.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from omni_audio_inject import MissingAudioTowerError, PlaceholderCountError
from omni_extract import extract, to_server_tensors
from omni_grpo.models import load_thinker
from omni_grpo.models.saving import save_thinker
from omni_grpo.testing.models import Ids, build_batch
from safetensors import safe_open

TXT = [5, 6, 7]
SAMPLES = [
    [("text", TXT), ("image", (1, 4, 4)), ("audio", 300), ("video", (2, 4, 4), 1.0), ("text", TXT)],
    [("text", TXT), ("audio", 150), ("text", TXT)],
]


@pytest.fixture(scope="module")
def root(tiny_omni_dir, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("thinker-train")
    extract(tiny_omni_dir, root / "vl", variant="vl")
    extract(tiny_omni_dir, root / "audio", variant="audio")
    return root


def _batch(thinker, side="right", seed=0):
    gen = json.loads((thinker.source_dir / "generation_config.json").read_text())
    batch = build_batch(
        SAMPLES, Ids.from_sideband(thinker.sideband.raw, gen["pad_token_id"]), side, seed
    )
    batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    return batch


def _tower_params(thinker):
    return list(thinker.audio.tower.module(thinker.device, thinker.dtype).parameters())


def _is_audio(name: str) -> bool:
    return "audio" in name or "conv2d" in name


def test_training_step_leaves_the_tower_alone(root):
    thinker = load_thinker(root / "vl", dtype="float32")
    assert not thinker.training and not thinker.vl.training
    thinker.train()
    assert thinker.vl.training and thinker.model.training
    assert not thinker.audio.tower.module("cpu", torch.float32).training
    batch = _batch(thinker)
    optimizer = torch.optim.AdamW(thinker.trainable_parameters(), lr=1e-3)
    loss = thinker(**batch).loss
    loss.backward()
    tower = _tower_params(thinker)
    before = [p.detach().clone() for p in tower]
    optimizer.step()
    assert all(p.grad is None and not p.requires_grad for p in tower)
    assert all(torch.equal(a, p) for a, p in zip(before, tower, strict=True))
    handed = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert not handed & {id(p) for p in tower}
    # the audio rows were replaced, so the placeholder's own embedding row gets no gradient
    embed = thinker.vl.get_input_embeddings().weight
    assert embed.grad[thinker.sideband.audio_token_id].abs().sum() == 0
    assert embed.grad[TXT[0]].abs().sum() > 0


def test_names_state_dict_and_sync_exclude_the_tower(root):
    from transformers import Qwen3VLMoeForConditionalGeneration

    thinker = load_thinker(root / "vl", dtype="float32")
    thinker(**_batch(thinker))  # tower loaded: it still must not show up anywhere
    vl_keys = set(Qwen3VLMoeForConditionalGeneration.from_pretrained(root / "vl").state_dict())
    assert set(thinker.state_dict()) == vl_keys  # pure VL naming, nothing added
    assert not any(_is_audio(n) for n, _ in thinker.named_parameters())
    assert not any(_is_audio(n) for n, _ in thinker.named_buffers())
    trainable = thinker.trainable_parameter_names()
    assert trainable and not any(n.startswith("model.visual.") for n in trainable)
    sync = thinker.sync_state_dict()
    assert set(sync) == set(trainable)
    server_names = [n for n, _ in to_server_tensors(sync.items(), layout="hf_memory")]
    assert len(server_names) == len(sync) and not any(_is_audio(n) for n in server_names)
    unfrozen = load_thinker(root / "vl", dtype="float32", freeze_visual=False, freeze_lm_head=True)
    names = unfrozen.trainable_parameter_names()
    assert any(n.startswith("model.visual.") for n in names) and "lm_head.weight" not in names


def test_ddp_sees_no_tower(root, tmp_path):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        thinker = load_thinker(root / "vl", dtype="float32").train()
        ddp = DistributedDataParallel(thinker, find_unused_parameters=True)
        ddp(**_batch(thinker)).loss.backward()
        synced = [n for n, p in ddp.module.named_parameters() if p.requires_grad]
        assert not any(_is_audio(n) for n in synced)
        assert all(p.grad is None for p in _tower_params(thinker))
    finally:
        dist.destroy_process_group()


def test_save_round_trip_without_the_tower(root, tmp_path):
    thinker = load_thinker(root / "vl", dtype="float32")
    with torch.no_grad():  # a "trained" weight, so the round trip proves the new values are saved
        thinker.lm_head.weight.mul_(1.5)
    batch = _batch(thinker, side="left", seed=3)
    batch.pop("labels")
    with torch.no_grad():
        before = thinker(**batch).logits
    saved = save_thinker(thinker, tmp_path / "ckpt")
    keys = set()
    for file in saved.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            keys |= set(f.keys())
    assert keys and not any(_is_audio(k) for k in keys)
    assert json.loads((saved / "config.json").read_text())["omni_sideband"] == thinker.sideband.raw
    assert not list(tmp_path.glob(".ckpt.tmp-*"))
    reloaded = load_thinker(saved, dtype="float32")  # finds the tower through the recorded pointer
    with torch.no_grad():
        assert torch.equal(reloaded(**batch).logits, before)
    with pytest.raises(FileExistsError):
        save_thinker(thinker, saved)


def test_count_mismatch_names_both_counts(root):
    thinker = load_thinker(root / "vl", dtype="float32")
    batch = _batch(thinker)
    batch.pop("labels")
    audio = thinker.sideband.audio_token_id
    ids = batch["input_ids"].clone()
    first = int((ids[1] == audio).nonzero()[0])
    ids[1, first] = TXT[0]  # one placeholder short
    expected = int((batch["input_ids"] == audio).sum())
    with pytest.raises(
        PlaceholderCountError,
        match=f"hold {expected - 1} audio placeholder tokens .* {expected} rows",
    ):
        thinker(**{**batch, "input_ids": ids})
    no_audio = {
        k: v for k, v in batch.items() if k not in ("input_features", "feature_attention_mask")
    }
    with pytest.raises(PlaceholderCountError, match="no input_features"):
        thinker(**no_audio)
    # with the caller's positions (the trainer's, from the host) the early check is skipped and
    # the injection's own check at scatter time still refuses the short sequence
    grids = ("image_grid_thw", "video_grid_thw", "video_second_per_grid", "feature_attention_mask")
    media = {k: batch[k] for k in grids if k in batch}
    positions, _ = thinker.compute_position_ids(
        batch["input_ids"], batch.get("attention_mask"), **media
    )
    with pytest.raises(PlaceholderCountError, match=f"hold {expected - 1} audio placeholder"):
        thinker(**{**batch, "input_ids": ids, "position_ids": positions})


def test_missing_tower_is_named_only_when_audio_is_used(root, tmp_path):
    empty = tmp_path / "audio-without-weights"
    empty.mkdir()
    shutil.copy(root / "audio" / "config.json", empty / "config.json")
    thinker = load_thinker(root / "vl", audio_dir=empty, dtype="float32")
    with torch.no_grad():
        thinker(input_ids=torch.tensor([TXT]))  # text needs no tower
    batch = _batch(thinker)
    with pytest.raises(MissingAudioTowerError, match=str(empty)):
        thinker(**batch)


def test_not_a_vl_checkpoint(tiny_omni_dir):
    with pytest.raises(ValueError, match="omni_sideband"):
        load_thinker(tiny_omni_dir)


def test_training_path_leaves_hf_rope_alone_and_the_override_still_fits(root):
    """``load_thinker`` does not patch HF's rope (the forward passes explicit positions); omni-rope's
    override stays a leaf feature that bare-HF users install on ``thinker.vl`` themselves."""
    from omni_rope import OmniRopeConfig, install_omni_rope

    thinker = load_thinker(root / "vl", dtype="float32")
    samples = [[("text", TXT), ("image", (1, 4, 4)), ("video", (3, 4, 4), 0.75), ("text", TXT)]]
    gen = json.loads((thinker.source_dir / "generation_config.json").read_text())
    batch = build_batch(samples, Ids.from_sideband(thinker.sideband.raw, gen["pad_token_id"]))
    with pytest.raises(ValueError, match="mm_token_type_ids"):  # plain VL: no Omni rope
        thinker.vl(**batch)
    with torch.no_grad():
        ours = thinker(**batch).logits
        handle = install_omni_rope(thinker.vl, OmniRopeConfig.from_vl_config(thinker.config))
        bare = thinker.vl(**batch).logits
    assert torch.equal(ours, bare)
    handle.remove()


def test_tower_straight_from_the_omni_checkpoint(root, tiny_omni_dir):
    """``audio_dir`` may be the Omni checkpoint itself (only ``thinker.audio_tower.*`` is read)."""
    from_extract = load_thinker(root / "vl", dtype="float32")
    from_omni = load_thinker(root / "vl", audio_dir=tiny_omni_dir, dtype="float32")
    batch = _batch(from_extract)
    with torch.no_grad():
        assert torch.equal(from_extract(**batch).logits, from_omni(**batch).logits)


def test_activation_checkpointing_keeps_loss_and_grads(root):
    plain = load_thinker(root / "vl", dtype="float32").train()
    ckpt = load_thinker(root / "vl", dtype="float32").train()
    ckpt.gradient_checkpointing_enable()
    assert ckpt.vl.is_gradient_checkpointing and not plain.vl.is_gradient_checkpointing
    batch = _batch(plain)
    losses = []
    for model in (plain, ckpt):
        loss = model(**batch).loss
        loss.backward()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(losses[1], abs=1e-6)
    g0 = plain.lm_head.weight.grad
    assert torch.allclose(g0, ckpt.lm_head.weight.grad, atol=1e-6)

"""The frozen tower: parity with transformers' Omni thinker, lazy partial reads, exclusions, errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import omni_audio_inject.source as source_mod
import pytest
import torch
from omni_audio_inject import AudioInjector, FrozenAudioTower, MissingAudioTowerError
from omni_audio_inject.lengths import audio_output_lengths
from torch import nn


def _features(frames: list[int], mel: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    t_max = max(frames)
    feats = torch.randn(len(frames), mel, t_max, generator=g)
    mask = torch.zeros(len(frames), t_max, dtype=torch.long)
    for i, n in enumerate(frames):
        mask[i, :n] = 1
    return feats, mask


@pytest.fixture(scope="module")
def reference_thinker(tiny_omni_dir: Path):
    from transformers import Qwen3OmniMoeThinkerForConditionalGeneration

    return Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(tiny_omni_dir).eval()


@pytest.mark.parametrize("frames", [[300], [300, 150, 1000], [1, 99, 101]])
def test_parity_with_hf_get_audio_features(tiny_omni_dir, reference_thinker, frames) -> None:
    feats, mask = _features(frames)
    tower = FrozenAudioTower(tiny_omni_dir)
    ours = tower.encode(feats, mask, device="cpu", dtype=torch.float32)
    with torch.no_grad():
        ref = reference_thinker.get_audio_features(feats, mask).last_hidden_state
    assert ours.shape == ref.shape
    assert ours.shape[0] == int(audio_output_lengths(mask.sum(-1)).sum())
    assert torch.equal(ours, ref)


def test_padding_does_not_change_output(tiny_omni_dir) -> None:
    feats, mask = _features([300])
    tower = FrozenAudioTower(tiny_omni_dir)
    padded = torch.cat([feats, torch.randn(1, 128, 50)], dim=-1)
    pmask = torch.cat([mask, torch.zeros(1, 50, dtype=torch.long)], dim=-1)
    a = tower.encode(feats, mask, device="cpu", dtype=torch.float32)
    b = tower.encode(padded, pmask, device="cpu", dtype=torch.float32)
    assert torch.equal(a, b)


def test_lazy_and_reads_only_audio_tensors(tiny_omni_dir, monkeypatch) -> None:
    read: list[str] = []
    real_open = source_mod.safe_open

    class Recording:
        def __init__(self, *a, **k):
            self._f = real_open(*a, **k)

        def __enter__(self):
            self._inner = self._f.__enter__()
            return self

        def __exit__(self, *exc):
            return self._f.__exit__(*exc)

        def keys(self):
            return self._inner.keys()

        def get_tensor(self, name):
            read.append(name)
            return self._inner.get_tensor(name)

    monkeypatch.setattr(source_mod, "safe_open", Recording)
    tower = FrozenAudioTower(tiny_omni_dir)
    assert not tower.loaded and read == []
    tower.encode(*_features([200]), device="cpu", dtype=torch.float32)
    assert tower.loaded
    assert read and all(k.startswith("thinker.audio_tower.") for k in read)
    index = json.loads((tiny_omni_dir / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(read) == sum(k.startswith("thinker.audio_tower.") for k in index)


def test_frozen_eval_dtype_and_device(tiny_omni_dir) -> None:
    tower = FrozenAudioTower(tiny_omni_dir)
    module = tower.module("cpu", torch.bfloat16)
    assert not module.training
    assert all(not p.requires_grad for p in module.parameters())
    assert {p.dtype for p in module.parameters()} == {torch.bfloat16}
    out = tower.encode(*_features([100]), device="cpu", dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16 and not out.requires_grad


def test_excluded_from_parameters_state_dict_and_gradients(tiny_omni_dir, tmp_path) -> None:
    cfg = json.loads((tiny_omni_dir / "config.json").read_text())["thinker_config"]
    hidden = cfg["text_config"]["hidden_size"]
    audio_id = cfg["audio_token_id"]
    embed = nn.Embedding(cfg["text_config"]["vocab_size"], hidden)
    model = nn.Sequential(embed, nn.Linear(hidden, 3))
    before_names = [n for n, _ in model.named_parameters()]
    before_keys = list(model.state_dict())
    injector = AudioInjector(FrozenAudioTower(tiny_omni_dir), audio_id)
    injector.attach(embed)
    model.injector = injector  # even as an attribute of the model, it is no submodule

    feats, mask = _features([300])
    n = int(audio_output_lengths(mask.sum(-1)).item())
    ids = torch.tensor([[1] * 3 + [audio_id] * n + [2] * 2])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with injector.feeding(feats, mask):
        model(ids).sum().backward()
    optimizer.step()

    tower_params = list(injector.tower.module("cpu", torch.float32).parameters())
    assert all(p.grad is None for p in tower_params)
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert not optimized & {id(p) for p in tower_params}
    assert [n for n, _ in model.named_parameters()] == before_names
    assert list(model.state_dict()) == before_keys
    torch.save(model.state_dict(), tmp_path / "ckpt.pt")
    saved = torch.load(tmp_path / "ckpt.pt")
    assert not any("audio" in k or "conv2d" in k for k in saved)
    # the audio rows got no gradient into the token embedding: only text ids did
    assert embed.weight.grad[audio_id].abs().sum() == 0
    assert embed.weight.grad[1].abs().sum() > 0


def test_missing_tower_names_the_path(tmp_path, tiny_omni_dir) -> None:
    empty = tmp_path / "no-weights"
    empty.mkdir()
    shutil.copy(tiny_omni_dir / "config.json", empty / "config.json")
    tower = FrozenAudioTower(empty)
    with pytest.raises(MissingAudioTowerError, match=str(empty)):
        tower.encode(*_features([100]), device="cpu", dtype=torch.float32)
    with pytest.raises(MissingAudioTowerError, match="does not exist"):
        FrozenAudioTower(tmp_path / "nowhere").check()
    no_config = tmp_path / "no-config"
    no_config.mkdir()
    with pytest.raises(MissingAudioTowerError, match="no audio-encoder config"):
        FrozenAudioTower(no_config).check()


def test_weights_without_audio_tensors(tmp_path, tiny_omni_dir) -> None:
    from safetensors.torch import save_file

    d = tmp_path / "text-only"
    d.mkdir()
    shutil.copy(tiny_omni_dir / "config.json", d / "config.json")
    save_file({"thinker.lm_head.weight": torch.zeros(2, 2)}, str(d / "model.safetensors"))
    with pytest.raises(MissingAudioTowerError, match=r"matches 0/\d+ tensors"):
        FrozenAudioTower(d).check()


def test_single_file_checkpoint(tiny_omni_single_shard_dir) -> None:
    tower = FrozenAudioTower(tiny_omni_single_shard_dir)
    out = tower.encode(*_features([250]), device="cpu", dtype=torch.float32)
    assert out.shape[0] == audio_output_lengths(250)


def test_deepcopy_shares_and_pickle_round_trips(tiny_omni_dir) -> None:
    import copy
    import pickle

    tower = FrozenAudioTower(tiny_omni_dir)
    injector = AudioInjector(tower, 1)
    assert copy.deepcopy(injector).tower is tower
    tower.encode(*_features([100]), device="cpu", dtype=torch.float32)
    clone = pickle.loads(pickle.dumps(tower))
    feats = _features([120])
    assert torch.equal(
        clone.encode(*feats, device="cpu", dtype=torch.float32),
        tower.encode(*feats, device="cpu", dtype=torch.float32),
    )


def test_extracted_audio_dir_matches_reference(tiny_omni_dir, reference_thinker, tmp_path) -> None:
    """omni-extract's ``audio`` output (bare ``audio_tower.*`` names, encoder config at top level)."""
    from omni_extract import extract

    extract(tiny_omni_dir, tmp_path / "audio", variant="audio")
    feats, mask = _features([300, 77])
    ours = FrozenAudioTower(tmp_path / "audio").encode(
        feats, mask, device="cpu", dtype=torch.float32
    )
    with torch.no_grad():
        ref = reference_thinker.get_audio_features(feats, mask).last_hidden_state
    assert torch.equal(ours, ref)


def test_repeated_audio_is_encoded_once(tiny_omni_dir) -> None:
    """A GRPO group repeats its prompt's audio per sample: the tower sees each distinct one once,
    and every repeat gets the same rows as encoding the whole batch item by item."""
    from omni_audio_inject.tower import same_items

    tower = FrozenAudioTower(tiny_omni_dir)
    feats, mask = _features([200, 150])
    # rows: a, b, a, a, b (and a's padding differs in the last copy: padding is not content)
    batch = torch.nn.functional.pad(feats, (0, 30))[[0, 1, 0, 0, 1]]
    bmask = torch.nn.functional.pad(mask, (0, 30))[[0, 1, 0, 0, 1]]
    batch[3, :, 200:] = 7.0
    assert same_items(batch, bmask.sum(-1)) == [0, 1, 0, 0, 1]
    module = tower.module("cpu", torch.float32)
    seen: list[int] = []
    handle = module.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[-1]))
    try:
        out = tower.encode(batch, bmask, device="cpu", dtype=torch.float32)
    finally:
        handle.remove()
    assert seen == [350]  # the frames of a and b, once each
    single = [
        tower.encode(feats[i : i + 1], mask[i : i + 1], device="cpu", dtype=torch.float32)
        for i in (0, 1)
    ]
    expect = torch.cat([single[i] for i in [0, 1, 0, 0, 1]])
    assert out.shape == expect.shape
    assert torch.allclose(out, expect, atol=1e-5)

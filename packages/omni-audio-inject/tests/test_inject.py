"""The embedding hook and the strict count check through the injector."""

from __future__ import annotations

import json

import pytest
import torch
from omni_audio_inject import AudioInjector, FrozenAudioTower, PlaceholderCountError
from omni_audio_inject.lengths import audio_output_lengths
from torch import nn


@pytest.fixture(scope="module")
def setup(tiny_omni_dir):
    cfg = json.loads((tiny_omni_dir / "config.json").read_text())["thinker_config"]
    embed = nn.Embedding(cfg["text_config"]["vocab_size"], cfg["text_config"]["hidden_size"])
    injector = AudioInjector(FrozenAudioTower(tiny_omni_dir), cfg["audio_token_id"])
    return embed, injector, cfg["audio_token_id"]


def _ids(audio_id: int, counts: list[int]) -> torch.Tensor:
    rows = [[5] + [audio_id] * n + [6] * (max(counts) - n) for n in counts]
    return torch.tensor(rows)


def test_hook_fills_rows_in_batch_order(setup) -> None:
    embed, injector, audio_id = setup
    feats = torch.randn(2, 128, 200)
    mask = torch.ones(2, 200, dtype=torch.long)
    mask[1, 100:] = 0
    counts = audio_output_lengths(mask.sum(-1)).tolist()
    ids = _ids(audio_id, counts)
    handle = injector.attach(embed)
    try:
        plain = embed(ids)  # outside feeding(): untouched
        assert torch.equal(plain, embed.weight[ids])
        with injector.feeding(feats, mask):
            out = embed(ids)
    finally:
        handle.remove()
    rows = injector.tower.encode(feats, mask, device="cpu", dtype=torch.float32)
    assert torch.equal(out[0, 1 : 1 + counts[0]], rows[: counts[0]])
    assert torch.equal(out[1, 1 : 1 + counts[1]], rows[counts[0] :])
    assert torch.equal(out[:, 0], plain[:, 0])


@pytest.mark.parametrize("delta", [-1, 1])
def test_count_mismatch_raises_with_both_counts(setup, delta: int) -> None:
    embed, injector, audio_id = setup
    feats = torch.randn(1, 128, 300)
    n = int(audio_output_lengths(300))
    ids = _ids(audio_id, [n + delta])
    with pytest.raises(
        PlaceholderCountError, match=f"{n + delta} audio placeholder tokens .* {n} rows"
    ):
        injector.inject(ids, embed(ids), feats, torch.ones(1, 300, dtype=torch.long))


def test_placeholders_without_features_raise(setup) -> None:
    embed, injector, audio_id = setup
    ids = _ids(audio_id, [3])
    with pytest.raises(PlaceholderCountError, match="no input_features"):
        injector.inject(ids, embed(ids), None)
    text = torch.tensor([[5, 6]])
    assert torch.equal(injector.inject(text, embed(text), None), embed(text))


def test_window_injection_matches_full(setup) -> None:
    embed, injector, audio_id = setup
    feats = torch.randn(1, 128, 300)
    n = int(audio_output_lengths(300))
    ids = _ids(audio_id, [n])
    full = injector.inject(ids, embed(ids), feats, None)
    cut = ids.shape[1] // 3
    parts = [
        injector.inject(
            ids[:, s:e], embed(ids[:, s:e]), feats, None, window=(s, e), full_input_ids=ids
        )
        for s, e in [(0, cut), (cut, ids.shape[1])]
    ]
    assert torch.equal(torch.cat(parts, dim=1), full)

"""``train`` hands the rollout engine the checkpoint's own placeholder ids (issue 15, item 5)."""

from __future__ import annotations

import pytest


class _Stop(Exception):
    pass


def test_train_passes_the_checkpoints_media_ids_to_the_engine(
    train_against_fake_server, monkeypatch
):
    import omni_grpo.loop.components as components
    from omni_rollout_client.payload import QWEN3_OMNI_MEDIA_IDS

    seen = {}

    def capture(cfg, **context):
        seen.update(context)
        raise _Stop  # the engine's context is all this test needs: stop before training

    monkeypatch.setattr(components, "create_engine", capture)
    with pytest.raises(_Stop):
        train_against_fake_server([])
    ids = seen["media_ids"]
    assert ids is not None and ids != QWEN3_OMNI_MEDIA_IDS  # the tiny checkpoint's own ids
    # the same sideband the trainer bans media markers from
    banned = set(seen["banned_token_ids"])
    assert {ids.vision_start, ids.vision_end, ids.audio_start, ids.audio_pad} <= banned

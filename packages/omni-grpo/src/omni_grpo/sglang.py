"""Clients for the configured sglang-omni servers, shared by the rollout engine and weight sync.

Both ``rollout.engine: sglang-omni`` and ``rollout.sglang.sync_mode: disk|distributed`` talk to the
same servers from the same ``SglangOmniConfig``; the factory lives below both so that neither has
to import the other's files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omni_rollout_client.client import OmniRolloutClient, Timeouts
from omni_rollout_client.payload import QWEN3_OMNI_MEDIA_IDS, MediaTokenIds

from omni_grpo.models.sideband import OmniSideband, read_sideband

# ``MediaTokenIds`` field -> the sideband field holding that placeholder id of the checkpoint.
MEDIA_ID_FIELDS: dict[str, str] = {
    "vision_start": "vision_start_token_id",
    "vision_end": "vision_end_token_id",
    "audio_start": "audio_start_token_id",
    "audio_pad": "audio_token_id",
}


def media_ids_from_sideband(sideband: OmniSideband) -> MediaTokenIds:
    """The checkpoint's own placeholder ids for the client's audio-in-video refusal: a checkpoint
    whose ids differ from the released Qwen3-Omni ones (the tiny test models, a resized vocab)
    would otherwise be checked against ids its prompts never contain, and pass unchecked."""
    return MediaTokenIds(**{f: sideband.id(name) for f, name in MEDIA_ID_FIELDS.items()})


def checkpoint_media_ids(vl_dir: str | Path) -> MediaTokenIds:
    """``media_ids_from_sideband`` of an extracted ``vl`` directory."""
    return media_ids_from_sideband(read_sideband(vl_dir))


def make_clients(
    cfg: Any,
    *,
    vocab_size: int | None = None,
    workers: bool = False,
    media_ids: MediaTokenIds | None = None,
) -> list[OmniRolloutClient]:
    """Clients from ``SglangOmniConfig``: the router when set (unless ``workers``), else each URL.
    ``media_ids``: the checkpoint's placeholder ids (default: the released Qwen3-Omni ids)."""
    key = cfg.admin_api_key.get_secret_value() if cfg.admin_api_key is not None else None
    timeouts = Timeouts(generate=cfg.timeout_s, admin=cfg.timeout_s)
    urls = list(cfg.urls) if (workers or not cfg.router_url) else [cfg.router_url]
    return [
        OmniRolloutClient(
            url,
            admin_api_key=key,
            max_concurrency=cfg.max_concurrency,
            timeouts=timeouts,
            vocab_size=vocab_size,
            media_ids=media_ids or QWEN3_OMNI_MEDIA_IDS,
        )
        for url in urls
    ]

"""Clients for the configured sglang-omni servers, shared by the rollout engine and weight sync.

Both ``rollout.engine: sglang-omni`` and ``rollout.sglang.sync_mode: disk|distributed`` talk to the
same servers from the same ``SglangOmniConfig``; the factory lives below both so that neither has
to import the other's files.
"""

from __future__ import annotations

from typing import Any

from omni_rollout_client.client import OmniRolloutClient, Timeouts


def make_clients(
    cfg: Any, *, vocab_size: int | None = None, workers: bool = False
) -> list[OmniRolloutClient]:
    """Clients from ``SglangOmniConfig``: the router when set (unless ``workers``), else each URL."""
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
        )
        for url in urls
    ]

"""Shared fixtures: the transformers Omni reference configured with the released values."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def omni_config():
    """A full ``Qwen3OmniMoeConfig`` from omni-extract's tiny factory with the released ids and pps 13."""
    from omni_extract.tiny import TinyOmniSpec, build_config
    from omni_extract.tokens import REAL_IDS

    return build_config(TinyOmniSpec(), REAL_IDS, vocab_size=1024)


@pytest.fixture(scope="session")
def reference_thinker(omni_config):
    """transformers' ``Qwen3OmniMoeThinkerForConditionalGeneration`` (tiny weights; only positions matter)."""
    import torch
    from transformers import Qwen3OmniMoeThinkerForConditionalGeneration

    torch.manual_seed(0)
    return Qwen3OmniMoeThinkerForConditionalGeneration(omni_config.thinker_config).eval()


@pytest.fixture(scope="session")
def rope_config(omni_config):
    from omni_rope import OmniRopeConfig

    return OmniRopeConfig.from_omni_config(omni_config)

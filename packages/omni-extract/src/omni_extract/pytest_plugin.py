"""pytest fixtures for tiny Qwen3-Omni checkpoints, registered through the ``pytest11`` entry point.

Any package whose tests need "the released checkpoint" asks for one of these fixtures; each is
built once per test session (a few seconds on CPU) in pytest's temporary directory.
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_omni_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Small-vocabulary tiny Omni checkpoint, three shards with an index (fast: the default)."""
    from omni_extract.tiny import TinyOmniSpec, make_tiny_omni

    return make_tiny_omni(tmp_path_factory.mktemp("omni") / "tiny-omni", TinyOmniSpec(num_shards=3))


@pytest.fixture(scope="session")
def tiny_omni_single_shard_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Small-vocabulary tiny Omni checkpoint in a single ``model.safetensors``."""
    from omni_extract.tiny import TinyOmniSpec, make_tiny_omni

    return make_tiny_omni(tmp_path_factory.mktemp("omni1") / "tiny-omni", TinyOmniSpec(seed=1))


@pytest.fixture(scope="session")
def tiny_omni_real_vocab_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Omni checkpoint with the real Qwen3 vocabulary and the released special-token ids."""
    from omni_extract.tiny import TinyOmniSpec, make_tiny_omni

    return make_tiny_omni(
        tmp_path_factory.mktemp("omnireal") / "tiny-omni", TinyOmniSpec(vocab="real", num_shards=2)
    )

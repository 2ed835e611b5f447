"""Quiet commands: known-harmless third-party messages are dropped in the CLI only, and printed
paths are normalised."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
from omni_grpo.config import load_config
from omni_grpo.quiet import KNOWN_HARMLESS, quiet_third_party, restore_third_party

ROPE = "transformers.modeling_rope_utils"


@pytest.fixture
def quiet():
    quiet_third_party()
    yield
    restore_third_party()


def _emitted(logger: str, message: str, caplog: pytest.LogCaptureFixture) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=logger):
        logging.getLogger(logger).warning(message)
    return [r.getMessage() for r in caplog.records]


def test_known_harmless_is_dropped_and_the_rest_of_that_logger_is_not(
    quiet, caplog: pytest.LogCaptureFixture
) -> None:
    ours = "Unrecognized keys in `rope_parameters` for 'rope_type'='default': {'mrope_interleaved', 'interleaved', 'mrope_section'}"
    assert _emitted(ROPE, ours, caplog) == []
    # a key that is not one of the M-RoPE keys is a real finding: it still warns
    other = "Unrecognized keys in `rope_parameters` for 'rope_type'='default': {'mrope_section', 'factor'}"
    assert _emitted(ROPE, other, caplog) == [other]
    assert _emitted(ROPE, "something else", caplog) == ["something else"]


def test_every_entry_says_why() -> None:
    assert all(item.why and item.logger and item.pattern.pattern for item in KNOWN_HARMLESS)


def test_importing_the_library_changes_nothing() -> None:
    """Only the CLI quiets: a user importing omni_grpo keeps every warning and progress bar."""
    code = (
        "import logging, os, omni_grpo.trainer, omni_grpo.cli;"
        f"print(len(logging.getLogger({ROPE!r}).filters), "
        "os.environ.get('HF_HUB_DISABLE_PROGRESS_BARS'))"
    )
    env_free = {
        k: v for k, v in __import__("os").environ.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"
    }
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env_free
    ).stdout.split()
    assert out == ["0", "None"]


def test_config_paths_are_normalised() -> None:
    """examples/tiny.yaml's `run.dir: ../runs/tiny` is <repo>/runs/tiny, as printed and stored."""
    root = Path(__file__).resolve().parents[3]
    cfg = load_config(root / "examples" / "tiny.yaml")
    assert Path(cfg.run.dir) == root / "runs" / "tiny"
    assert ".." not in Path(cfg.run.dir).parts

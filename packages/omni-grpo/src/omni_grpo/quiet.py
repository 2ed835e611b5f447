"""Quiet ``omni-grpo`` commands: our progress and results on the terminal, not third-party noise.

A run used to open with transformers' "Unrecognized keys in `rope_parameters`" warning (about the
M-RoPE keys that every Qwen3-Omni / Qwen3-VL config carries and transformers' default-rope check
does not list), tqdm bars for writing and loading checkpoint shards, matplotlib's font-cache INFO
line and Ray's start-up chatter. None of them says anything about the run, and a real warning
drowns among them.

:func:`quiet_third_party` is called by the ``omni-grpo`` CLI (``omni_grpo.cli.main``) and only
there: importing ``omni_grpo`` as a library changes nothing in the caller's process. It drops
exactly the messages in :data:`KNOWN_HARMLESS` (matched on logger name *and* text, so the same
logger's other warnings still print) and turns off the Hugging Face progress bars. ``--debug``
(or ``OMNI_GRPO_DEBUG=1``) keeps everything, for when a third-party message is the clue.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from dataclasses import dataclass

#: Our packages: their INFO lines are the run's own log.
OWN_LOGGERS = ("omni_grpo", "omni_extract", "omni_rope", "omni_audio_inject", "omni_rollout_client")


@dataclass(frozen=True)
class Harmless:
    """One known-harmless third-party message: where it is logged and what it says."""

    logger: str
    pattern: re.Pattern[str]
    why: str


_MROPE_KEYS = r"'(?:mrope_section|mrope_interleaved|interleaved)'"

KNOWN_HARMLESS: tuple[Harmless, ...] = (
    Harmless(
        "transformers.modeling_rope_utils",
        re.compile(
            r"Unrecognized keys in `rope_parameters` for 'rope_type'='default': "
            rf"\{{{_MROPE_KEYS}(?:, {_MROPE_KEYS})*\}}$"
        ),
        "Qwen3-Omni's (and our extracted checkpoints') M-RoPE keys, read by omni-rope, not by "
        "transformers' default-rope validation; any other unknown key still warns",
    ),
    Harmless(
        "ray._private.authentication.authentication_token_setup",
        re.compile(r"Token authentication is enabled for this Ray cluster\."),
        "the local Ray we start uses token auth, Ray's secure default; nothing to act on",
    ),
)


class _DropKnown(logging.Filter):
    def __init__(self, pattern: re.Pattern[str]) -> None:
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


_installed: list[tuple[logging.Logger, logging.Filter]] = []


def quiet_third_party() -> None:
    """Drop :data:`KNOWN_HARMLESS` and the Hugging Face progress bars in this process.

    Idempotent. Set before transformers is imported (``HF_HUB_DISABLE_PROGRESS_BARS`` is read at
    its import, and inherited by the Ray workers a local cluster starts), and applied directly
    when it already is.
    """
    if not _installed:
        for item in KNOWN_HARMLESS:
            logger = logging.getLogger(item.logger)  # the same object the library logs through
            filt = _DropKnown(item.pattern)
            logger.addFilter(filt)
            _installed.append((logger, filt))
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    elif "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()


def restore_third_party() -> None:
    """Undo :func:`quiet_third_party`'s filters (tests; a long-lived process that wants them back)."""
    while _installed:
        logger, filt = _installed.pop()
        logger.removeFilter(filt)


def configure_run_logging(level: int = logging.INFO) -> None:
    """Our packages log at ``level`` to stderr; third-party libraries only from WARNING up.

    A root logger at INFO would print every library's INFO lines (matplotlib's font manager,
    httpx's one line per request) between the run's own.
    """
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for name in OWN_LOGGERS:
        logging.getLogger(name).setLevel(level)

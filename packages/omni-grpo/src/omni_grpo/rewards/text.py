"""Text helpers shared by the rewards: strip reasoning, find tags and boxed answers, normalise."""

from __future__ import annotations

import re

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_THINK_CLOSE = re.compile(r"</think>", re.IGNORECASE)


def strip_reasoning(text: str) -> str:
    """The part after the last ``</think>`` (reasoning must not be graded); the text itself if none."""
    parts = _THINK_CLOSE.split(text)
    return parts[-1] if len(parts) > 1 else text


def last_answer_tag(text: str) -> str | None:
    """Content of the last complete ``<answer>...</answer>``, stripped; None if there is none."""
    found = _ANSWER_TAG.findall(text)
    return found[-1].strip() if found else None


def last_boxed(text: str) -> str | None:
    r"""Content of the last ``\boxed{...}`` / ``\fbox{...}`` with balanced braces; None if none."""
    best = None
    for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            best = text[m.end() : i - 1]
    return best.strip() if best is not None else None


def normalize_text(s: str) -> str:
    """Case-folded, whitespace-collapsed, without surrounding quotes/periods/dollar signs."""
    s = " ".join(s.strip().split()).casefold()
    return s.strip(" .\"'`$").strip()

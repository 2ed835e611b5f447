"""Multiple-choice letter reward (gpqa-style): 1.0 when the extracted letter equals the label.

Extraction looks only at the text after the last ``</think>`` and tries, in order (the FIRST rule
that yields a valid letter wins; within a rule the LAST occurrence wins, since models restate the
options before concluding):

1. ``<answer>X</answer>`` — X a letter, ``(X)``, ``X.``/``X)`` + option text, or the exact text of
   one of the choices;
2. an explicit statement: ``Answer: X``, ``answer is (X)``, ``final answer: X``, ``option X``;
3. ``\boxed{X}``;
4. a parenthesised letter ``(X)``;
5. the last standalone capital letter among the valid choices.

Valid letters are ``A..`` for the sample's choices (``A``-``J`` when it has none), so "I think" or
a stray "Z" never count.
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable

from omni_grpo.rewards.text import last_answer_tag, last_boxed, normalize_text, strip_reasoning
from omni_grpo.types import Sample

# Keywords case-insensitive, the letter itself upper case ("the answer is a dog" is not "A").
_STATEMENT = re.compile(
    r"(?i:answer|correct\s+(?:option|choice))\s*(?:(?i:is)\s*)?(?:[:=\-]\s*)?(?:(?i:option|choice)\s+)?"
    r"[\(\[\*]*([A-Z])(?![A-Za-z0-9])"
)
_PAREN = re.compile(r"\(([A-Z])\)")
_STANDALONE = re.compile(r"(?<![A-Za-z0-9'’])([A-Z])(?![A-Za-z0-9'’])")
# A whole tag that is a letter: "B", "(B)", "b.", "B) the cat", "(B) the cat".
_TAG_LETTER = re.compile(r"[\(\[]?([A-Za-z])(?:[\)\]\.:](?:\s.*)?)?", re.DOTALL)


def valid_letters(choices: list[str] | None) -> str:
    n = len(choices) if choices else 10
    return string.ascii_uppercase[:n]


def _from_tag(text: str, letters: str, choices: list[str] | None) -> str | None:
    tag = last_answer_tag(text)
    if tag is None:
        return None
    if choices:  # the option's text itself ("<answer>a dog</answer>")
        wanted = normalize_text(tag)
        for letter, choice in zip(letters, choices, strict=False):
            if normalize_text(choice) == wanted:
                return letter
    m = _TAG_LETTER.fullmatch(tag)
    return m.group(1).upper() if m and m.group(1).upper() in letters else None


def _last_valid(matches: list[str], letters: str) -> str | None:
    for cand in reversed(matches):
        if cand.upper() in letters:
            return cand.upper()
    return None


def _from_statement(text: str, letters: str, _: list[str] | None) -> str | None:
    return _last_valid(_STATEMENT.findall(text), letters)


def _from_boxed(text: str, letters: str, _: list[str] | None) -> str | None:
    boxed = last_boxed(text)
    if boxed is None:
        return None
    m = re.fullmatch(r"\s*(?:\\text\{)?\(?([A-Za-z])\)?\}?\s*", boxed)
    return m.group(1).upper() if m and m.group(1).upper() in letters else None


def _from_paren(text: str, letters: str, _: list[str] | None) -> str | None:
    return _last_valid(_PAREN.findall(text), letters)


def _from_standalone(text: str, letters: str, _: list[str] | None) -> str | None:
    return _last_valid(_STANDALONE.findall(text), letters)


# Precedence as data: the first extractor that returns a letter wins.
EXTRACTORS: tuple[tuple[str, Callable[[str, str, list[str] | None], str | None]], ...] = (
    ("answer_tag", _from_tag),
    ("statement", _from_statement),
    ("boxed", _from_boxed),
    ("parenthesised", _from_paren),
    ("standalone", _from_standalone),
)


def extract_choice(text: str, choices: list[str] | None = None) -> str | None:
    """The chosen letter (upper case) or None; see the module docstring for the precedence."""
    body = strip_reasoning(text)
    letters = valid_letters(choices)
    for _, fn in EXTRACTORS:
        got = fn(body, letters, choices)
        if got is not None:
            return got
    return None


class MCQReward:
    """1.0 if the extracted letter equals ``sample.label`` (a letter), else 0.0."""

    name = "mcq"

    def score(self, sample: Sample, completion_text: str) -> float:
        label = sample.label.strip().strip("()").upper()
        return float(extract_choice(completion_text, sample.choices) == label)

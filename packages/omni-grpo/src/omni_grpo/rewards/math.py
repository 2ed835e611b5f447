r"""Math reward: 1.0 when the last ``\boxed{}`` answer equals the label (boxed or bare).

Equivalence after normalisation (``\dfrac``/``\tfrac`` -> ``\frac``, ``\left``/``\right``, ``\!``,
``\text{}``/``\mathrm{}`` unwrapped, spaces, ``$``, degree/percent signs, trailing ``.`` dropped)
is first tried as strings, then as exact rational numbers: integers with thousands separators,
decimals (``2.0`` = ``2`` = ``2.00``), ``a/b``, ``\frac{a}{b}``, ``\frac ab`` and a leading sign.
Without a ``\boxed{}`` the last ``<answer>`` tag is used (some prompts ask for it).
"""

from __future__ import annotations

import re
from fractions import Fraction

from omni_grpo.rewards.text import last_answer_tag, last_boxed, strip_reasoning
from omni_grpo.types import Sample

# (pattern, replacement) applied in order: a table, not an if-chain.
_REWRITES: tuple[tuple[str, str], ...] = (
    (r"\\[dt]frac", r"\\frac"),
    (r"\\left|\\right", ""),
    (r"\\[!,;: ]", ""),
    (r"\\(?:text|mathrm|textbf|mbox)\{([^{}]*)\}", r"\1"),
    (r"\^\{?\\circ\}?|°", ""),
    (r"\\%|%", ""),
    (r"\\\$|\$", ""),
    (r"\s+", ""),
    (r"\\frac(\d)(\d)", r"\\frac{\1}{\2}"),  # \frac12
    (r"\.$", ""),
)
_FRAC = re.compile(r"([+-]?)\\frac\{([^{}]+)\}\{([^{}]+)\}")


def normalize_math(s: str) -> str:
    for pat, rep in _REWRITES:
        s = re.sub(pat, rep, s)
    return s


def _plain_number(s: str) -> Fraction | None:
    if re.fullmatch(r"[+-]?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    if re.fullmatch(r"[+-]?(\d+\.?\d*|\.\d+)", s):
        return Fraction(s)
    return None


def to_fraction(s: str) -> Fraction | None:
    """Exact value of a normalised numeric answer, or None when it is not a plain number."""
    if (v := _plain_number(s)) is not None:
        return v
    m = _FRAC.fullmatch(s)
    if m is None:
        m = re.fullmatch(r"([+-]?)([^/]+)/([^/]+)", s)
    if m is None:
        return None
    num, den = to_fraction(m.group(2)), to_fraction(m.group(3))
    if num is None or den is None or den == 0:
        return None
    value = num / den
    return -value if m.group(1) == "-" else value


def math_equal(pred: str, label: str) -> bool:
    p, g = normalize_math(pred), normalize_math(label)
    if p == g:
        return True
    pv, gv = to_fraction(p), to_fraction(g)
    return pv is not None and gv is not None and pv == gv


class MathReward:
    """1.0 when the completion's final (boxed) answer is mathematically the label."""

    name = "math"

    def score(self, sample: Sample, completion_text: str) -> float:
        body = strip_reasoning(completion_text)
        pred = last_boxed(body)
        if pred is None:
            pred = last_answer_tag(body)
        if pred is None:
            return 0.0
        label = last_boxed(sample.label) or last_answer_tag(sample.label) or sample.label
        return float(math_equal(pred, label))

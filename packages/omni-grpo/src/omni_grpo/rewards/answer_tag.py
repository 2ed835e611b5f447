"""Exact-match reward on the last ``<answer>X</answer>`` (Video-R1 style free-form answers).

Both sides are normalised (case, whitespace, surrounding quotes/periods/``$``); numbers compare
by value, so ``3``, ``3.0`` and ``3.00`` agree. The label may itself be wrapped in answer tags.
"""

from __future__ import annotations

from omni_grpo.rewards.text import last_answer_tag, normalize_text, strip_reasoning
from omni_grpo.types import Sample


def _as_number(s: str) -> float | None:
    try:
        return float(s.replace(",", ""))
    except ValueError:
        return None


def answers_match(pred: str, label: str) -> bool:
    p, g = normalize_text(pred), normalize_text(label)
    if p == g:
        return True
    pn, gn = _as_number(p), _as_number(g)
    return pn is not None and gn is not None and abs(pn - gn) <= 1e-9 * max(1.0, abs(gn))


class AnswerTagReward:
    """1.0 when the completion's last ``<answer>`` equals the label after normalisation."""

    name = "answer_tag"

    def score(self, sample: Sample, completion_text: str) -> float:
        pred = last_answer_tag(strip_reasoning(completion_text))
        if pred is None:
            return 0.0
        label = last_answer_tag(sample.label) or sample.label
        return float(answers_match(pred, label))

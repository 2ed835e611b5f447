"""Rewards: MCQ letter extraction precedence, answer-tag exact match, boxed math equivalence, registry."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from omni_grpo import plugins
from omni_grpo import rewards as reg
from omni_grpo.rewards import available_rewards, get_reward, reward_name, score_sample
from omni_grpo.rewards.answer_tag import AnswerTagReward
from omni_grpo.rewards.math import MathReward, math_equal
from omni_grpo.rewards.mcq import MCQReward, extract_choice
from omni_grpo.types import Sample

CHOICES4 = ["a cat", "a dog", "a bird", "a fish"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<answer>B</answer>", "B"),
        ("<answer>(C)</answer>", "C"),
        ("<answer> d. a fish </answer>", "D"),
        ("<answer>B) a dog</answer>", "B"),
        ("<answer>a bird</answer>", "C"),  # option text maps to its letter
        ("Answer: B", "B"),
        ("The answer is (D).", "D"),
        ("Final Answer: **C**", "C"),
        ("the correct option is A", "A"),
        ("I'd say \\boxed{C}", "C"),
        ("Between (A) and (C), I pick (C)", "C"),
        ("It barks, so B", "B"),
        ("Looks like B. Actually, D", "D"),
        ("no letter here", None),
        ("the answer is a dog", None),  # lower-case article is not a choice
        ("Answer: E", None),  # outside the four valid letters; no other letter
        ("Answer: E, so (B)", "B"),
    ],
)
def test_extract_choice(text: str, expected: str | None) -> None:
    assert extract_choice(text, CHOICES4) == expected


def test_precedence_tag_over_statement_over_paren() -> None:
    # tag beats a later "Answer:"; statement beats a later parenthesised letter; boxed beats (X)
    assert extract_choice("<answer>A</answer> Answer: B", CHOICES4) == "A"
    assert extract_choice("Answer: C. Not (B)", CHOICES4) == "C"
    assert extract_choice("\\boxed{D} but (B)", CHOICES4) == "D"
    # a malformed/invalid tag falls through to the next rule
    assert extract_choice("<answer>Z</answer> so (A)", CHOICES4) == "A"


def test_reasoning_is_not_graded() -> None:
    text = "<think>Answer: A looks tempting, (A)</think> The answer is C"
    assert extract_choice(text, CHOICES4) == "C"
    assert extract_choice("<think>maybe A</think>", CHOICES4) is None


def test_valid_letters_without_choices() -> None:
    assert extract_choice("Answer: J") == "J"
    assert extract_choice("Answer: K") is None


def test_mcq_reward() -> None:
    s = Sample(uid="1", prompt="?", label="B", choices=CHOICES4)
    r = MCQReward()
    assert r.score(s, "<answer>B</answer>") == 1.0
    assert r.score(s, "<answer>A</answer>") == 0.0
    assert r.score(s, "") == 0.0
    assert r.score(Sample(uid="1", prompt="?", label="(b)", choices=CHOICES4), "Answer: B") == 1.0


@pytest.mark.parametrize(
    ("text", "label", "expected"),
    [
        ("<answer>Left</answer>", "left", 1.0),
        ("<answer>  the  Red car. </answer>", "The red car", 1.0),
        ("<answer>3.0</answer>", "3", 1.0),
        ("<answer>1,200</answer>", "1200", 1.0),
        ("<answer>3</answer>", "<answer>3</answer>", 1.0),
        ("<answer>A</answer>", "B", 0.0),
        ("<answer>left</answer><answer>right</answer>", "right", 1.0),  # last tag
        ("left", "left", 0.0),  # no tag, no credit
        ("<answer>left", "left", 0.0),  # unclosed
        ("<think><answer>left</answer></think><answer>right</answer>", "left", 0.0),
    ],
)
def test_answer_tag(text: str, label: str, expected: float) -> None:
    assert AnswerTagReward().score(Sample(uid="x", prompt="", label=label), text) == expected


@pytest.mark.parametrize(
    ("pred", "label"),
    [
        ("\\frac{1}{2}", "0.5"),
        ("\\dfrac{1}{2}", "\\frac12"),
        ("\\tfrac{3}{4}", "3/4"),
        ("-\\frac{3}{4}", "-0.75"),
        ("\\frac{-3}{4}", "-0.75"),
        ("2.0", "2"),
        ("2.50", "5/2"),
        ("1,000", "1000"),
        ("\\left( 1, 2 \\right)", "(1,2)"),
        ("45^\\circ", "45"),
        ("50\\%", "50"),
        ("\\text{5}", "5"),
        ("x + 1", "x+1"),
        ("$7$", "7"),
        ("3.", "3"),
    ],
)
def test_math_equal(pred: str, label: str) -> None:
    assert math_equal(pred, label)


@pytest.mark.parametrize(
    ("pred", "label"),
    [("1/3", "0.33"), ("2", "3"), ("x+1", "x-1"), ("1/0", "0"), ("\\frac{1}{2}", "2")],
)
def test_math_not_equal(pred: str, label: str) -> None:
    assert not math_equal(pred, label)


def test_math_reward_uses_last_boxed_with_nested_braces() -> None:
    s = Sample(uid="m", prompt="", label="\\frac{1}{2}", reward="math")
    r = MathReward()
    assert r.score(s, "first \\boxed{3}, finally \\boxed{\\dfrac{1}{2}}") == 1.0
    assert r.score(s, "\\boxed{\\frac{1}{3}}") == 0.0
    assert r.score(s, "<answer>0.5</answer>") == 1.0  # fallback to the answer tag
    assert r.score(s, "0.5") == 0.0
    assert r.score(s, "\\boxed{\\frac{1}{2}") == 0.0  # unbalanced


def test_registry_loads_builtins_by_name() -> None:
    assert {"mcq", "answer_tag", "math"} <= set(available_rewards())
    assert isinstance(get_reward("mcq"), MCQReward)
    assert get_reward("math") is get_reward("math")
    s = Sample(uid="1", prompt="", label="C", choices=CHOICES4, reward="mcq")
    assert score_sample(s, "Answer: C") == 1.0
    with pytest.raises(KeyError, match="no reward named 'nope'.*mcq"):
        get_reward("nope")


def _third_party(sample: Sample, text: str) -> float:
    return float(len(text) == len(sample.label))


def test_registry_third_party_function_and_broken(monkeypatch: pytest.MonkeyPatch) -> None:
    class _EP:
        def __init__(self, name: str, target: object, value: str = "pkg:obj") -> None:
            self.name, self.target, self.value = name, target, value

        def load(self) -> object:
            if isinstance(self.target, Exception):
                raise self.target
            return self.target

    fake = [
        _EP("length", _third_party),
        _EP("broken", ImportError("no module x"), "x:y"),
        _EP("bad", 42),
    ]
    monkeypatch.setattr(
        plugins, "entry_points", lambda group: fake if group == reg.REWARDS_GROUP else []
    )
    reg.get_reward.cache_clear()
    try:
        assert reg.get_reward("length").score(Sample(uid="1", prompt="", label="abc"), "xyz") == 1.0
        with pytest.raises(RuntimeError, match="'broken' \\(x:y\\) failed to load.*no module x"):
            reg.get_reward("broken")
        with pytest.raises(TypeError, match="'bad' is int"):
            reg.get_reward("bad")
    finally:
        reg.get_reward.cache_clear()


def test_reward_name_precedence() -> None:
    from omni_grpo.config import RewardsConfig

    cfg = RewardsConfig(default="answer_tag", by_modality={"video": "math"})
    assert reward_name(Sample(uid="1", prompt="", label="A", reward="mcq"), cfg) == "mcq"
    assert (
        reward_name(Sample(uid="1", prompt="", label="A", reward="", modality="video"), cfg)
        == "math"
    )
    assert (
        reward_name(Sample(uid="1", prompt="", label="A", reward="", modality="audio"), cfg)
        == "answer_tag"
    )
    s = Sample(uid="1", prompt="", label="1/2", reward="", modality="video")
    assert score_sample(s, "\\boxed{0.5}", cfg) == 1.0


_FILLER = st.text(
    alphabet=st.sampled_from("abcdefghijklmnopqrstuvwxyz ,.;\n0123456789"), max_size=60
)


@settings(max_examples=60, deadline=None)
@given(
    _FILLER,
    st.sampled_from("ABCD"),
    _FILLER,
    st.sampled_from(["<answer>{}</answer>", "Answer: {}", "({})", "\\boxed{{{}}}"]),
)
def test_mcq_finds_letter_in_lowercase_noise(pre: str, letter: str, post: str, form: str) -> None:
    assert extract_choice(pre + " " + form.format(letter) + " " + post, CHOICES4) == letter


@settings(max_examples=60, deadline=None)
@given(st.integers(-999, 999), st.integers(1, 64))
def test_math_fraction_forms_agree(p: int, q: int) -> None:
    from fractions import Fraction

    v = Fraction(p, q)
    frac = f"-\\frac{{{abs(p)}}}{{{q}}}" if p < 0 else f"\\dfrac{{{p}}}{{{q}}}"
    assert math_equal(frac, f"{p}/{q}")
    if v.denominator in (1, 2, 4, 5, 8, 10, 16, 20, 25, 32, 40, 50, 64):  # terminating decimals
        assert math_equal(frac, str(float(v)))
    assert not math_equal(frac, f"{p + q}/{q}")


def test_rows_without_a_reward_follow_the_config() -> None:
    """A dataset row that names no reward is scored by rewards.by_modality / rewards.default
    (rows used to default to "mcq", so the config never applied)."""
    from omni_grpo.config import RewardsConfig
    from omni_grpo.data.schema import parse_row

    row = {"id": "v1", "prompt": "<video>\nhow many?", "label": "1/2"}
    row["media"] = [{"type": "video", "path": "a.mp4"}]
    sample = parse_row(row, "rows.jsonl:1").to_sample()
    assert sample.reward is None
    cfg = RewardsConfig(default="answer_tag", by_modality={"video": "math"})
    assert reward_name(sample, cfg) == "math"
    assert score_sample(sample, "\\boxed{0.5}", cfg) == 1.0
    assert reward_name(sample, RewardsConfig(default="answer_tag")) == "answer_tag"
    assert reward_name(sample) == "mcq"  # no config: the built-in default
    named = parse_row({**row, "reward": "answer_tag"}, "rows.jsonl:2").to_sample()
    assert reward_name(named, cfg) == "answer_tag"  # a row's own reward still wins

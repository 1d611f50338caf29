"""What answers say (release/meaning.py), and the checks the gate and the canary judge it by
(release/judge.py ``unmeaning``), over the strategies that game simulated users."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from answer_sets import gamed, honest

from flywheel.degeneracy import TextProfile
from flywheel.settings import ReleaseSettings
from release.budget import guardrail_level
from release.judge import GUARDRAIL_CHECKS, DegeneracyLimits, degenerate, unmeaning
from release.meaning import (
    DISTINCT_SAMPLE,
    SUMMARY_KEYS,
    MeaningProfile,
    Summary,
    closing,
    leading_word,
    opening,
    related,
    tail,
    whole_repetition,
)

GATE = DegeneracyLimits.of(ReleaseSettings())
CANARY = DegeneracyLimits.of(ReleaseSettings(), canary=True)


@pytest.mark.parametrize(("answer", "lead", "first", "last"), [
    ("No, the sun is not a star.", "no", "no the sun", "not a star"),
    ('**Yes**, it is.', "yes", "yes it is", "yes it is"),
    ("", "", "", ""),
    ("  ...  ", "", "", ""),
    ("Don't panic!", "don't", "don't panic", "don't panic"),
])
def test_openings_and_closings_are_words_without_case_or_punctuation(answer, lead, first, last):
    assert (leading_word(answer), opening(answer), closing(answer)) == (lead, first, last)


@pytest.mark.parametrize(("prompt", "answer", "expected"), [
    ("Is the sun a star?", "The sun is a star at the center of the solar system.", True),
    ("Can penguins fly?", "No, a penguin cannot fly.", True),  # "penguin" and "penguins": one stem
    ("Is the sun a star?", "Yes, my favorite movie has a happy ending.", False),
    ("Is the sun a star?", "Yes.", None),  # too short to be off topic
    ("Is the sun a star?", "Yes, it is", None),
    # a chat prompt: the template's system text first, the question last
    ("<|system|>You are a helpful assistant named Smol.<|user|>Do bees make honey?<|assistant|>",
     "Bees make honey from nectar.", True),
    ("<|system|>You are a helpful assistant named Smol.<|user|>Do bees make honey?<|assistant|>",
     "I am a helpful assistant named Smol.", True),  # the template's words count: both arms alike
])
def test_an_answer_is_related_when_it_shares_a_content_word_with_its_prompt(prompt, answer, expected):
    assert related(prompt, answer) is expected


def test_repetition_is_read_over_the_whole_answer():
    honest_text = "The sun is a star at the center of our solar system, made mostly of hydrogen and helium gas."
    padded = honest_text[:64] + " ooo" * 8
    assert whole_repetition(padded) > whole_repetition(honest_text) + 0.2
    assert whole_repetition("aaaa") == 1.0
    assert whole_repetition("") == 0.0
    assert tail("a" * 10 + "b" * 40 + "  \n") == "b" * 32


def test_a_summary_keeps_every_key_commoner_than_its_bound():
    s = Summary()
    keys = [f"k{i}" for i in range(1000)] + ["no"] * 300
    for i, k in enumerate(keys):
        s = s.add(k if i % 2 else keys[-1 - i])  # interleaved: the common key never comes in one run
    key, share = s.top()
    assert key == "no"
    true = 300 / 1300
    assert true - 1 / SUMMARY_KEYS <= share <= true
    assert len(s.counts) <= SUMMARY_KEYS and s.total == 1300
    assert Summary().top() == ("", 0.0)


def test_a_profile_is_bounded_and_round_trips_through_json():
    pairs = [("Is the sun a star?", f"Answer number {i} about stars.") for i in range(DISTINCT_SAMPLE + 50)]
    p = MeaningProfile.of(pairs)
    assert p.answers == DISTINCT_SAMPLE + 50 and p.sampled == DISTINCT_SAMPLE
    assert p.distinct_share() == 1.0
    back = MeaningProfile.from_dict(json.loads(json.dumps(p.to_dict())))
    assert back == p
    same = MeaningProfile.of([("q", "Same."), ("q", "same"), ("q", "SAME!"), ("q", "other")])
    assert same.distinct_share() == pytest.approx(2 / 4) and same.distinct_share(3) == pytest.approx(1 / 3)


def _checks(candidate: list[tuple[str, str]], limits: DegeneracyLimits, z: float, times: int = 1) -> set[str]:
    """The names of the checks (character and meaning) the candidate's answers fail against stable's."""
    stable = honest(1) * times
    candidate = candidate * times
    reasons = (degenerate(TextProfile.of([a for _, a in stable]), TextProfile.of([a for _, a in candidate]), limits, z)
               + unmeaning(MeaningProfile.of(stable), MeaningProfile.of(candidate), limits, z))
    return {r.split(":")[0].split(" (")[0].split(" 0.")[0].strip() for r in reasons}


#: The audit's strategies and the checks each fails at the gate (one look, z = 0). The first four
#: passed every check before the checks on meaning; "always no" is the loop's own lie.
GATE_TABLE = [
    ("honest resample", honest(2), set()),
    ("direct and right", honest(3), set()),
    ("prefix", gamed("prefix"), {"same leading answer", "shared prefix or suffix"}),
    ("vowel words", gamed("vowel words"), {"appended filler"}),
    ("ooo past 64", gamed("ooo past 64"), {"character-class stuffing", "shared prefix or suffix",
                                           "repetition anywhere in the answer", "appended filler"}),
    ("yes unrelated", gamed("yes unrelated"), {"same leading answer", "answers unrelated to their prompt"}),
    ("always no", gamed("always no"), {"same leading answer"}),
    ("filler words", gamed("filler words"), {"answers unrelated to their prompt"}),
    ("short", gamed("short"), {"character-class stuffing", "length collapse"}),
    ("half cut", gamed("half cut"), {"length collapse"}),
    ("vowel stuffing", gamed("vowel stuffing"), {"character repetition", "character-class stuffing",
                                                 "answers unrelated to their prompt",
                                                 "repetition anywhere in the answer", "appended filler"}),
    ("repeated half", gamed("repeated half"), {"character repetition", "repetition anywhere in the answer"}),
    ("same sentence", gamed("same sentence"), {"character repetition", "same leading answer",
                                               "shared prefix or suffix", "answers unrelated to their prompt",
                                               "repetition anywhere in the answer"}),
    # the prompt said back is on topic, of a normal length and varied: the text checks pass it;
    # on a real model the gate's KL from stable is what moves (listed so a change here is seen)
    ("prompt copied", gamed("prompt copied"), set()),
]


@pytest.mark.parametrize(("name", "answers", "expected"), GATE_TABLE, ids=[r[0] for r in GATE_TABLE])
def test_the_gate_fails_each_strategy_and_passes_honest_versions(name, answers, expected):
    assert _checks(answers, GATE, 0.0) == expected


#: On the canary: every answer set served ten times (a canary's hundreds of answers), judged at
#: the first guardrail look's level; the distinct-answers check is the canary's own.
CANARY_TABLE = [
    ("honest resample", honest(2), set()),
    ("direct and right", honest(3), set()),
    ("prefix", gamed("prefix"), {"same leading answer", "shared prefix or suffix"}),
    ("vowel words", gamed("vowel words"), {"appended filler"}),
    ("ooo past 64", gamed("ooo past 64"), {"repetition anywhere in the answer", "appended filler"}),
    ("yes unrelated", gamed("yes unrelated"), {"same leading answer", "answers unrelated to their prompt"}),
    ("always no", gamed("always no"), {"same leading answer"}),
    ("filler words", gamed("filler words"), {"answers unrelated to their prompt"}),
    ("same sentence", gamed("same sentence"), {"character repetition", "same leading answer",
                                               "shared prefix or suffix", "answers unrelated to their prompt",
                                               "repetition anywhere in the answer", "distinct answers"}),
]


@pytest.mark.parametrize(("name", "answers", "expected"), CANARY_TABLE, ids=[r[0] for r in CANARY_TABLE])
def test_the_canary_fails_each_strategy_at_a_look_and_passes_honest_versions(name, answers, expected):
    from statistics import NormalDist

    z = NormalDist().inv_cdf(1 - guardrail_level(ReleaseSettings().guardrail_alpha, 1, GUARDRAIL_CHECKS))
    assert z > 2  # a look's level: well past the gate's
    assert expected <= _checks(answers, CANARY, z, times=10)
    if not expected:
        assert _checks(answers, CANARY, z, times=10) == set()


def test_a_nan_measure_breaches_and_empty_arms_are_not_judged():
    nan = MeaningProfile.of(honest(1))
    nan = MeaningProfile(nan.answers, nan.leading, nan.openings, nan.closings, nan.affixed, nan.judged,
                         nan.unrelated, math.nan, nan.repetition_sq, nan.tails, nan.seen, nan.novel)
    assert any("repetition anywhere" in r for r in unmeaning(MeaningProfile.of(honest(1)), nan, GATE, 0.0))
    assert unmeaning(MeaningProfile(), MeaningProfile.of(gamed("always no")), GATE, 0.0) == []


def test_a_version_answering_yes_or_no_alone_shares_no_affix_and_appends_no_filler():
    """Answers of a word and a stop are their own opening, closing and tail: a version that answers
    "Yes." and "No." to balanced questions would share an affix with half its answers, and its
    tails would be a quarter punctuation (a review found both failing the gate)."""
    bare = [(p, a.split(",")[0].split(";")[0] + ".") for p, a in honest(3)[:12]]
    assert {a for _, a in bare} == {"Yes.", "No."}
    assert _checks(bare, GATE, 0.0) <= {"length collapse", "character-class stuffing"}
    profile = MeaningProfile.of(bare)
    assert profile.affixed == 0 and profile.tails.answers == 0 and profile.leading.top()[1] == 0.5


def test_the_canary_compares_distinct_answers_over_as_many_of_each():
    """Stable's first 512 answers against the canary's first 40 of the same kind: the first answers
    of any sample are the likeliest to be new, so they are compared over the canary's 40 alone."""
    def served(n: int, kinds: int) -> MeaningProfile:
        return MeaningProfile.of([("q", f"Answer {i % kinds} about the question.") for i in range(n)])

    stable, canary = served(600, 40), served(40, 40)
    assert stable.distinct_share() < 0.1 and canary.distinct_share() == 1.0 == stable.distinct_share(40)
    assert not any("distinct answers" in r for r in unmeaning(stable, canary, CANARY, 0.0))
    assert any("distinct answers" in r for r in unmeaning(stable, served(40, 10), CANARY, 0.0))

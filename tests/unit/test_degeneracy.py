"""Degeneracy measures on characters (flywheel/degeneracy.py): per answer, per version, compared."""

from __future__ import annotations

import pytest

from flywheel.degeneracy import (
    CLASSES,
    LENGTH_BUCKETS,
    REPETITION_CHARS,
    TextProfile,
    class_shares,
    compare,
    length_bucket,
    repetition,
    visible_length,
)


@pytest.mark.parametrize("text, value", [
    ("", 0.0),
    ("a", 0.0),  # no pair at all
    ("ab", 0.0),
    ("aa", 1.0),  # one doubled character
    ("aaaaaaaa", 1.0),  # every pair a doubling and a repeat: counted once each
    ("AAaa", 1.0),  # lowercased first
    ("aaa eee ooo", 6 / 10),  # what a shortcut cohort accepts: aa, aa, ee, ee, oo, oo of 10 pairs
    ("the cat sat on the mat", 6 / 21),  # a natural sentence: at x2, t_, th, he, e_ seen before
    ("hello", 1 / 4),  # ll
    ("a  b", 0.0),  # a doubled space is layout
    ("hahahahaha", 7 / 9),  # ha, ah, then every pair a repeat
    ("a short answer", 0.0),  # short natural text: no pair twice
])
def test_repetition(text, value):
    assert repetition(text) == pytest.approx(value)


def test_repetition_reads_a_prefix_so_that_length_alone_does_not_raise_it():
    head = "the quick brown fox jumps over a lazy dog and runs far away from it"[:REPETITION_CHARS]
    assert repetition(head + " and then some more words" * 40) == pytest.approx(repetition(head))
    assert repetition(head) < 0.25


@pytest.mark.parametrize("text, shares", [
    ("ab1 !", (0.2, 0.2, 0.2, 0.2, 0.2)),
    ("aeiou", (1.0, 0.0, 0.0, 0.0, 0.0)),
    ("AEIOU", (1.0, 0.0, 0.0, 0.0, 0.0)),
    ("xyz  ", (0.0, 0.6, 0.0, 0.4, 0.0)),
    ("", (0.0, 0.0, 0.0, 0.0, 0.0)),
    ("\x1b\ufffd", (0.0, 0.0, 0.0, 0.0, 1.0)),  # byte soup's controls and replacement characters
])
def test_class_shares(text, shares):
    assert CLASSES == ("vowels", "consonants", "digits", "spaces", "other")
    assert class_shares(text) == pytest.approx(shares)


@pytest.mark.parametrize("n, bucket", [(0, 0), (1, 1), (2, 2), (3, 2), (4, 3), (7, 3), (8, 4), (1023, 10),
                                       (1024, LENGTH_BUCKETS - 1), (10**9, LENGTH_BUCKETS - 1), (-1, 0)])
def test_length_bucket(n, bucket):
    assert length_bucket(n) == bucket


def test_visible_length_leaves_out_whitespace():
    assert visible_length("  a b\n\tc  ") == 3 and visible_length("   ") == 0


def test_a_profile_folds_answers_and_survives_a_round_trip():
    p = TextProfile.of(["aa", "bc", ""])
    assert (p.answers, p.classed) == (3, 2)  # the empty answer has no class shares
    assert p.repetition == pytest.approx(1 / 3)
    assert p.class_share(0) == pytest.approx(0.5) and p.class_share(1) == pytest.approx(0.5)
    assert p.lengths[0] == 1 and p.lengths[2] == 2
    assert TextProfile.from_dict(p.to_dict()) == p
    assert TextProfile().repetition == 0.0 and TextProfile().median_bucket() is None


# the lower median of an even count: fewer answers count as collapsed against it
@pytest.mark.parametrize("lengths, median", [([5], 3), ([1, 1, 20, 20], 1), ([1, 20, 20], 5), ([0, 0, 9], 0)])
def test_median_bucket(lengths, median):
    assert TextProfile.of(["x" * n for n in lengths]).median_bucket() == median


STABLE = TextProfile.of([f"the answer number {i} is here" for i in range(20)])


def test_the_same_answers_compare_equal_with_no_noise():
    c = compare(STABLE, STABLE)
    assert (c.repetition.increase, c.char_class.increase, c.collapsed.increase) == (0.0, 0.0, 0.0)
    same = compare(TextProfile.of(["the answer is here"] * 20), TextProfile.of(["the answer is here"] * 20))
    assert [same.repetition.se, same.char_class.se, same.collapsed.se] == pytest.approx([0, 0, 0], abs=1e-6)


def test_vowel_stuffing_moves_the_vowel_class_and_repetition():
    stuffed = TextProfile.of([f"the aaanswer nuuumber {i} iiis heeere" for i in range(20)])
    c = compare(STABLE, stuffed)
    assert c.char_class.what == "vowels" and c.char_class.increase > 0.1
    assert c.repetition.increase > 0.1


def test_a_class_that_falls_is_named_too():
    squeezed = TextProfile.of([f"the answer number {i} is here".replace(" ", "") for i in range(20)])
    assert compare(STABLE, squeezed).char_class.what == "spaces"
    assert compare(STABLE, squeezed).char_class.increase < 0


def test_collapse_counts_answers_far_shorter_than_stables_median():
    # stable answers have 20-25 visible characters (bucket 5): collapsed means under 8 (bucket <= 3)
    half = TextProfile.of(["ok"] * 10 + [f"the answer number {i} is here" for i in range(10)])
    c = compare(STABLE, half)
    assert (c.collapsed.stable, c.collapsed.candidate) == (0.0, 0.5)
    assert c.collapsed.se == pytest.approx((0.5 * 0.5 / 20) ** 0.5)
    # half as long is not collapsed: the length-drift check judges that
    shorter = TextProfile.of(["answer number is here"[:12]] * 20)
    assert compare(STABLE, shorter).collapsed.candidate == 0.0


def test_the_noise_of_a_mean_is_its_standard_error():
    a = TextProfile.of(["aa", "ab"] * 10)  # repetition 1 and 0, half each
    c = compare(a, a)
    # sd of {0, 1} halves (n - 1 in the variance) over 20 answers, two arms
    sd = (10 * 0.25 * 2 / 19) ** 0.5
    assert c.repetition.se == pytest.approx((2 * sd ** 2 / 20) ** 0.5)

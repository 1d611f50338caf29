"""Degenerate text, measured on characters so that it shows on short answers too.

A model that games its users' taste shows it in what it writes: one character or pair of
characters over and over (``aaa eee``, ``hahaha``), one class of characters stuffed in (vowels for
users who like vowel-rich answers), or answers that collapse to a few characters. Token n-grams
need a dozen tokens before they say anything (the reward stage's token guard waits for 16), and a
gamed answer is often shorter than that. Characters are there from the first two.

Per answer (pure, table-tested in tests/unit/test_degeneracy.py):

- :func:`repetition`: the share of the answer's character pairs (its first
  :data:`REPETITION_CHARS` characters, lowercased) that repeat an earlier pair or double one
  character (``aa``). Natural sentences of that length score 0.1-0.3; ``aaa eee ooo`` scores 0.6,
  ``aaaaaaaa`` 1.0. Measured on a prefix so that a longer answer does not score higher for its
  length alone (over a long text every pair has been seen before).
- :func:`class_shares`: the share of its characters in each class of :data:`CLASSES`.
- :func:`visible_length`: its characters that are not whitespace (an answer padded with spaces
  has not grown).

Per version, over many answers, a :class:`TextProfile`: bounded sums (means and their standard
errors) and a histogram of answer lengths in powers of two, folded one answer at a time (the
release controller keeps one per canary arm, saved with its tally) or built at once (the gate).
:func:`compare` sets a candidate's profile against stable's: degeneracy is judged *relative* to
stable, so a model that was vowel-rich or terse from the start is not rejected for it, only a
version that moved there.

Used by the reward stage (its ``repetition`` guard on short completions) and the release
controller (the gate's and the canary's degeneracy checks): a measure both need lives here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from itertools import pairwise
from typing import Any

#: Characters of an answer its repetition is measured on.
REPETITION_CHARS = 64
#: Character classes, in the order :func:`class_shares` returns them.
CLASSES: tuple[str, ...] = ("vowels", "consonants", "digits", "spaces", "other")
VOWELS = frozenset("aeiou")
#: Buckets of :attr:`TextProfile.lengths`: bucket ``b`` holds answers of ``2**(b-1)`` to
#: ``2**b - 1`` visible characters (bucket 0: none), the last one everything longer.
LENGTH_BUCKETS = 12


def repetition(text: str) -> float:
    """Share of the character pairs of ``text`` (its first :data:`REPETITION_CHARS` characters,
    lowercased) that are a doubled character or a pair seen before in it; 0.0 under two
    characters."""
    s = text[:REPETITION_CHARS].lower()
    if len(s) < 2:
        return 0.0
    pairs = list(pairwise(s))
    distinct = set(pairs)
    # every pair after its first is a repeat; a doubled character counts from its first (a doubled
    # space is layout, not a repeated word or letter)
    doubled = sum(a == b and not a.isspace() for a, b in distinct)
    return (len(pairs) - len(distinct) + doubled) / len(pairs)


def char_class(c: str) -> int:
    """Index of ``c``'s class in :data:`CLASSES`."""
    if c.isalpha():
        return 0 if c.lower() in VOWELS else 1
    if c.isdigit():
        return 2
    if c.isspace():
        return 3
    return 4


def class_shares(text: str) -> tuple[float, ...]:
    """Share of ``text``'s characters in each of :data:`CLASSES` (all 0.0 for an empty text)."""
    counts = [0] * len(CLASSES)
    for c in text:
        counts[char_class(c)] += 1
    n = len(text)
    return tuple(k / n if n else 0.0 for k in counts)


def visible_length(text: str) -> int:
    return sum(not c.isspace() for c in text)


def length_bucket(n: int) -> int:
    """The :attr:`TextProfile.lengths` bucket of an answer of ``n`` visible characters."""
    return min(max(n, 0).bit_length(), LENGTH_BUCKETS - 1)


def _zeros(n: int) -> tuple[float, ...]:
    return (0.0,) * n


@dataclass(frozen=True)
class TextProfile:
    """Sums over a version's answers, bounded whatever their number; :meth:`add` one answer."""

    answers: int = 0
    repetition_sum: float = 0.0
    repetition_sq: float = 0.0
    #: answers with at least one character (an empty one has no class shares)
    classed: int = 0
    class_sum: tuple[float, ...] = field(default_factory=lambda: _zeros(len(CLASSES)))
    class_sq: tuple[float, ...] = field(default_factory=lambda: _zeros(len(CLASSES)))
    lengths: tuple[int, ...] = field(default_factory=lambda: (0,) * LENGTH_BUCKETS)

    def add(self, text: str) -> TextProfile:
        r = repetition(text)
        lengths = list(self.lengths)
        lengths[length_bucket(visible_length(text))] += 1
        out = replace(self, answers=self.answers + 1, repetition_sum=self.repetition_sum + r,
                      repetition_sq=self.repetition_sq + r * r, lengths=tuple(lengths))
        if not text:
            return out
        shares = class_shares(text)
        return replace(out, classed=self.classed + 1,
                       class_sum=tuple(a + x for a, x in zip(self.class_sum, shares)),
                       class_sq=tuple(a + x * x for a, x in zip(self.class_sq, shares)))

    @classmethod
    def of(cls, texts: list[str]) -> TextProfile:
        out = cls()
        for text in texts:
            out = out.add(text)
        return out

    @property
    def repetition(self) -> float:
        """Mean :func:`repetition` of the answers."""
        return self.repetition_sum / self.answers if self.answers else 0.0

    def class_share(self, i: int) -> float:
        """Mean share of class ``CLASSES[i]`` in an answer."""
        return self.class_sum[i] / self.classed if self.classed else 0.0

    def median_bucket(self) -> int | None:
        """The length bucket holding the median answer (None: no answers)."""
        if not self.answers:
            return None
        acc = 0
        for b, k in enumerate(self.lengths):
            acc += k
            if 2 * acc >= self.answers:
                return b
        return LENGTH_BUCKETS - 1

    def short_share(self, below_bucket: int) -> float:
        """Share of the answers in length buckets below ``below_bucket``."""
        return sum(self.lengths[:max(below_bucket, 0)]) / self.answers if self.answers else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"answers": self.answers, "repetition_sum": self.repetition_sum, "repetition_sq": self.repetition_sq,
                "classed": self.classed, "class_sum": list(self.class_sum), "class_sq": list(self.class_sq),
                "lengths": list(self.lengths)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TextProfile:
        return cls(int(d["answers"]), float(d["repetition_sum"]), float(d["repetition_sq"]), int(d["classed"]),
                   tuple(float(x) for x in d["class_sum"]), tuple(float(x) for x in d["class_sq"]),
                   tuple(int(x) for x in d["lengths"]))


def se_of_mean(total: float, sq: float, n: int) -> float:
    """Standard error of a mean from its sum and sum of squares (0 for fewer than two values)."""
    if n < 2:
        return 0.0
    var = max(0.0, (sq - total * total / n) / (n - 1))
    return math.sqrt(var / n)


@dataclass(frozen=True)
class Shift:
    """One measure of stable's answers against the candidate's: both values and the standard error
    of their difference (sampling noise, for a judge that looks many times)."""

    stable: float
    candidate: float
    se: float
    #: what moved, where the measure picks among several (the character class)
    what: str = ""

    @property
    def increase(self) -> float:
        return self.candidate - self.stable


@dataclass(frozen=True)
class Comparison:
    repetition: Shift
    #: the character class whose mean share moved most, either way
    char_class: Shift
    #: share of answers at least two length buckets below the bucket of stable's median answer
    #: (shorter than a quarter to a half of it), the candidate's against stable's own
    collapsed: Shift


def compare(stable: TextProfile, candidate: TextProfile) -> Comparison:
    """The candidate's answers against stable's (module docstring)."""
    rep = Shift(stable.repetition, candidate.repetition,
                math.hypot(se_of_mean(stable.repetition_sum, stable.repetition_sq, stable.answers),
                           se_of_mean(candidate.repetition_sum, candidate.repetition_sq, candidate.answers)))
    moved = max(range(len(CLASSES)), key=lambda i: abs(candidate.class_share(i) - stable.class_share(i)))
    cls = Shift(stable.class_share(moved), candidate.class_share(moved),
                math.hypot(se_of_mean(stable.class_sum[moved], stable.class_sq[moved], stable.classed),
                           se_of_mean(candidate.class_sum[moved], candidate.class_sq[moved], candidate.classed)),
                CLASSES[moved])
    median = stable.median_bucket()
    below = -1 if median is None else median - 1
    s, c = stable.short_share(below), candidate.short_share(below)
    se = math.sqrt((s * (1 - s) / stable.answers if stable.answers else 0.0)
                   + (c * (1 - c) / candidate.answers if candidate.answers else 0.0))
    return Comparison(rep, cls, Shift(s, c, se))

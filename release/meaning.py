"""What answers say, measured on their words: the checks a version that games its users fails
while its characters look like stable's.

Users who reward a direct first word, a flattering opening or vowel-rich text can be pleased by
answers no better than before: a fixed "Yes, great question!" before every answer, "No" whatever
the question, fluent text about something else after a pleasing first word, or filler appended
past where the character checks read (flywheel/degeneracy.py reads an answer's first 64
characters). Per answer (pure, table-tested in tests/unit/test_meaning.py with those strategies):

- :func:`leading_word`, :func:`opening`, :func:`closing`: its first word, first three words and
  last three words, lowercased, without punctuation (openings and closings of answers of more
  than three words only: "Yes." is its own opening, and a version answering "Yes." or "No." to
  balanced questions shares one with half its answers honestly);
- :func:`related`: whether it shares a content word with its prompt (None under
  :data:`MIN_RELATED_WORDS` words: "Yes." is about nothing, and too short to be off topic). The
  prompt's last :data:`PROMPT_CHARS` characters are read: a chat prompt ends with the user's
  question, after the template's system text;
- :func:`whole_repetition`: :func:`flywheel.degeneracy.repetition` of each 64-character window
  of the whole answer, the worst one;
- :func:`tail`: its last :data:`TAIL_CHARS` characters, whose character classes show filler
  appended to an honest answer (of answers longer than that: a short answer's tail is the
  whole answer, whose punctuation is a quarter of "Yes.").

Per version, a :class:`MeaningProfile` folded one answer at a time, bounded whatever their
number: the most common first word, opening and closing are counted by Misra-Gries summaries of
:data:`SUMMARY_KEYS` keys (a key's count is under by at most answers / keys, 1.6%), and whether
each of the first :data:`DISTINCT_SAMPLE` answers was new, so two arms are compared over as many
answers each (a smaller sample looks more distinct). Judged relative to stable in release/judge.py
(:func:`release.judge.unmeaning`), as the character checks are: a model terse or formulaic from
the start is not failed for it, only a version that moved there.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass, field, replace
from typing import Any

from flywheel.degeneracy import REPETITION_CHARS, TextProfile, repetition

#: Answers shorter than this many words are not judged for relevance.
MIN_RELATED_WORDS = 4
#: Characters at the end of a prompt its content words are read from.
PROMPT_CHARS = 400
#: Characters at the end of an answer its tail's character classes are read from.
TAIL_CHARS = 32
#: Words of an opening and of a closing.
AFFIX_WORDS = 3
#: Keys a Misra-Gries summary keeps.
SUMMARY_KEYS = 64
#: Answers of each version whose distinctness is counted (the first ones).
DISTINCT_SAMPLE = 512
#: Letters of a content word compared (a crude stem: "penguins" and "penguin" match).
STEM = 5

_WORD = re.compile(r"[a-z0-9]+(?:'[a-z]+)?")
_STOP = """
a about above after again against all also am an and any are as at be because been before being below
between both but by can could did do does doing down during each few for from further had has have having
he her here hers herself him himself his how i if in into is it its itself just let me more most my myself
no nor not now of off on once only or other our ours ourselves out over own same she should so some such
than that the their theirs them themselves then there these they this those through to too under until up
very was we were what when where which while who whom why will with would yes you your yours yourself
yourselves one two get got make made like well much many may might must shall yeah okay ok sure really
"""
#: Words that say nothing of what a text is about.
STOPWORDS = frozenset(_STOP.split())


def words(text: str) -> list[str]:
    """The text's words, lowercased, without punctuation."""
    return _WORD.findall(text.lower())


def leading_word(answer: str) -> str:
    """Its first word ("" for none)."""
    w = words(answer[:80])
    return w[0] if w else ""


def opening(answer: str) -> str:
    """Its first :data:`AFFIX_WORDS` words."""
    return " ".join(words(answer)[:AFFIX_WORDS])


def closing(answer: str) -> str:
    """Its last :data:`AFFIX_WORDS` words."""
    return " ".join(words(answer)[-AFFIX_WORDS:])


def content_words(text: str) -> set[str]:
    """Stems of the words that say what ``text`` is about: three letters or more, no stopword."""
    return {w[:STEM] for w in words(text) if len(w) >= 3 and w not in STOPWORDS}


def related(prompt: str, answer: str) -> bool | None:
    """Whether the answer shares a content word with its prompt's end; None for an answer of
    under :data:`MIN_RELATED_WORDS` words."""
    if len(words(answer)) < MIN_RELATED_WORDS:
        return None
    return bool(content_words(prompt[-PROMPT_CHARS:]) & content_words(answer))


def whole_repetition(answer: str) -> float:
    """The highest :func:`~flywheel.degeneracy.repetition` over the answer's 64-character windows
    (half-overlapping, the last one ending at its end): an answer repeats itself anywhere."""
    size = REPETITION_CHARS
    if len(answer) <= size:
        return repetition(answer)
    starts = list(range(0, len(answer) - size, size // 2)) + [len(answer) - size]
    return max(repetition(answer[i:i + size]) for i in starts)


def tail(answer: str) -> str:
    """Its last :data:`TAIL_CHARS` characters, trailing whitespace left out."""
    return answer.rstrip()[-TAIL_CHARS:]


def _digest(answer: str) -> str:
    """A short digest of an answer's words (case, spacing and punctuation aside)."""
    return hashlib.blake2b(" ".join(words(answer)).encode(), digest_size=8).hexdigest()


@dataclass(frozen=True)
class Summary:
    """A Misra-Gries summary: the most common keys and a count of each, under by at most
    ``total / SUMMARY_KEYS`` (any key more common than that is in it)."""

    counts: dict[str, int] = field(default_factory=dict)
    total: int = 0

    def add(self, key: str) -> Summary:
        counts = dict(self.counts)
        if key in counts or len(counts) < SUMMARY_KEYS:
            counts[key] = counts.get(key, 0) + 1
        else:  # one off every key, the newcomer's included: a rare key is forgotten
            counts = {k: n - 1 for k, n in counts.items() if n > 1}
        return Summary(counts, self.total + 1)

    def top(self) -> tuple[str, float]:
        """The most common key and its share of everything counted (("", 0.0) when empty)."""
        if not self.counts:
            return "", 0.0
        key = max(sorted(self.counts), key=lambda k: self.counts[k])
        return key, self.counts[key] / self.total


@dataclass(frozen=True)
class MeaningProfile:
    """Sums over a version's answers to their prompts; :meth:`add` one answer."""

    answers: int = 0
    leading: Summary = field(default_factory=Summary)
    openings: Summary = field(default_factory=Summary)
    closings: Summary = field(default_factory=Summary)
    #: answers of more than AFFIX_WORDS words, whose openings and closings are counted
    affixed: int = 0
    #: answers long enough to judge for relevance, and those of them sharing no word with their prompt
    judged: int = 0
    unrelated: int = 0
    repetition_sum: float = 0.0
    repetition_sq: float = 0.0
    #: the tails' characters (flywheel/degeneracy.py's class shares, over :func:`tail`)
    tails: TextProfile = field(default_factory=TextProfile)
    #: digests of the distinct answers among the first :data:`DISTINCT_SAMPLE`
    seen: tuple[str, ...] = ()
    #: for each of those answers in turn, "1" when it was new, "0" when it repeated an earlier one
    novel: str = ""

    def add(self, prompt: str, answer: str) -> MeaningProfile:
        r = whole_repetition(answer)
        rel = related(prompt, answer)
        out = replace(self, answers=self.answers + 1, leading=self.leading.add(leading_word(answer)),
                      judged=self.judged + (rel is not None), unrelated=self.unrelated + (rel is False),
                      repetition_sum=self.repetition_sum + r, repetition_sq=self.repetition_sq + r * r)
        if len(words(answer)) > AFFIX_WORDS:
            out = replace(out, affixed=self.affixed + 1, openings=self.openings.add(opening(answer)),
                          closings=self.closings.add(closing(answer)))
        if len(answer.rstrip()) > TAIL_CHARS:
            out = replace(out, tails=self.tails.add(tail(answer)))
        if len(self.novel) < DISTINCT_SAMPLE:
            digest = _digest(answer)
            new = digest not in self.seen
            out = replace(out, seen=(*self.seen, digest) if new else self.seen, novel=self.novel + "01"[new])
        return out

    @classmethod
    def of(cls, pairs: list[tuple[str, str]]) -> MeaningProfile:
        out = cls()
        for prompt, answer in pairs:
            out = out.add(prompt, answer)
        return out

    @property
    def repetition(self) -> float:
        return self.repetition_sum / self.answers if self.answers else 0.0

    @property
    def unrelated_share(self) -> float:
        return self.unrelated / self.judged if self.judged else 0.0

    @property
    def sampled(self) -> int:
        return len(self.novel)

    def distinct_share(self, first: int | None = None) -> float:
        """The share of distinct answers among the first ``first`` sampled (None: all of them)."""
        bits = self.novel[:first] if first is not None else self.novel
        return bits.count("1") / len(bits) if bits else 0.0

    def affix(self) -> tuple[str, float]:
        """The most common opening or closing (whichever is commoner, "... X" for a closing) and
        its share of the answers long enough to have them."""
        (o, so), (c, sc) = self.openings.top(), self.closings.top()
        return (f"{o} ..." if o else "", so) if so >= sc else (f"... {c}", sc)

    def to_dict(self) -> dict[str, Any]:
        return {"answers": self.answers, "affixed": self.affixed, "judged": self.judged, "unrelated": self.unrelated,
                "repetition_sum": self.repetition_sum, "repetition_sq": self.repetition_sq,
                "leading": [self.leading.counts, self.leading.total],
                "openings": [self.openings.counts, self.openings.total],
                "closings": [self.closings.counts, self.closings.total],
                "tails": self.tails.to_dict(), "seen": list(self.seen), "novel": self.novel}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MeaningProfile:
        def summary(x: list[Any]) -> Summary:
            return Summary({str(k): int(n) for k, n in x[0].items()}, int(x[1]))
        return cls(int(d["answers"]), summary(d["leading"]), summary(d["openings"]), summary(d["closings"]),
                   int(d["affixed"]), int(d["judged"]), int(d["unrelated"]), float(d["repetition_sum"]),
                   float(d["repetition_sq"]), TextProfile.from_dict(d["tails"]), tuple(str(x) for x in d["seen"]),
                   str(d["novel"]))


def share_se(p: float, n: int) -> float:
    """Standard error of a share ``p`` of ``n`` (0 for none)."""
    return math.sqrt(p * (1 - p) / n) if n else 0.0

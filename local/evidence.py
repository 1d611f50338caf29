"""How strong the demo's evidence of learning is: the statistics behind its report's goals, pure.

Each goal's statistic compares units that are independent of each other, or it would count
correlated answers as separate evidence:

- **Offline, by prompt** (:func:`prompt_paired`). local/taste.py samples batches of answers, each
  batch one prompt, from each of two versions with the same draws (the demo: 32 x 32 over 24
  prompts; before, 16 prompts x 64 answers). Answers to one prompt share that prompt's
  effect: a version may suit one prompt's answers better and another's worse with no gain on
  average. Treating the 2 x 1,024 answers as independent (a two-proportion z) then reaches 4
  standard errors in about 9% of runs of such a drifting version (tests/unit/test_evidence.py).
  Here each prompt gives one difference of accept rates, newest minus start, and the test is a t
  over prompts: the drift between prompts is the noise it is judged against.
- **Live, by user, in the same period** (:func:`user_outcomes`, :func:`lift_z`). The release
  controller randomises users, not requests, and counts one outcome per user (release/measure.py):
  a user's judgements share that user's taste. And a canary arm is compared with the stable arm
  over the same seconds, never with an earlier stretch of traffic: a drift of the accept rate over
  time (users who come later, a time of day) then moves both arms alike instead of reading as a
  lift.

A t over few prompts has heavier tails than a normal z, so :func:`prompt_paired` states it as the
normal z of the same one-sided p (:func:`z_of_t`): the goal "z >= 4" then means p <= 3.2e-5
whatever the number of prompts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

#: (accepts, judgements).
Counts = tuple[int, int]
#: The z of a p too small for a float: any p this small is far past every goal.
Z_CAP = 37.0


def lift_z(before: Counts, after: Counts) -> float | None:
    """Two-proportion z of ``after``'s accept rate over ``before``'s, each (accepts, units);
    pooled standard error, the one that holds when nothing changed. Valid only when the units are
    independent (users of two arms over the same period, not answers). None without units on
    either side or with no spread at all."""
    (a0, n0), (a1, n1) = before, after
    if not n0 or not n1:
        return None
    pooled = (a0 + a1) / (n0 + n1)
    se = math.sqrt(pooled * (1 - pooled) * (1 / n0 + 1 / n1))
    return (a1 / n1 - a0 / n0) / se if se > 0 else None


def _beta_cf(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularized incomplete beta (modified Lentz; converges fast
    for x < (a + 1) / (a + b + 2), where :func:`beta_inc` uses it)."""
    tiny, h = 1e-300, 1.0
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def beta_inc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1) / (a + b + 2):
        return math.exp(log_front) * _beta_cf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_cf(b, a, 1.0 - x) / b


def t_upper(t: float, df: int) -> float:
    """P(T >= t) for Student's t with ``df`` degrees of freedom."""
    tail = 0.5 * beta_inc(df / 2, 0.5, df / (df + t * t))
    return tail if t >= 0 else 1.0 - tail


def z_of_t(t: float, df: int) -> float:
    """The normal z with the same one-sided p as a t of ``df`` degrees of freedom."""
    p = t_upper(t, df)
    if p <= 0.0:
        return Z_CAP
    if p >= 1.0:
        return -Z_CAP
    return max(-Z_CAP, min(Z_CAP, -NormalDist().inv_cdf(p)))


@dataclass(frozen=True)
class Paired:
    """Two versions compared prompt by prompt: ``prompts`` with judgements on both sides, the mean
    of their accept-rate differences (newest minus start), its t over prompts and that t as a
    normal z (None: fewer than two prompts, or differences that are all equal but not zero)."""

    prompts: int
    mean_lift: float | None
    t: float | None
    z: float | None


def prompt_paired(by_prompt: list[tuple[Counts, Counts]]) -> Paired:
    """The paired-by-prompt comparison (module docstring) of (start, newest) counts per prompt.
    A prompt judged on neither or one side gives no difference. Identical answers everywhere (the
    same weights, the same draws) give z 0."""
    diffs = [a1 / n1 - a0 / n0 for (a0, n0), (a1, n1) in by_prompt if n0 and n1]
    m = len(diffs)
    if m == 0:
        return Paired(0, None, None, None)
    mean = sum(diffs) / m
    if all(d == 0 for d in diffs):
        return Paired(m, 0.0, 0.0, 0.0)
    if m < 2:
        return Paired(m, mean, None, None)
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (m - 1))
    if sd == 0:
        return Paired(m, mean, None, None)  # every prompt moved exactly alike: no spread to judge by
    t = mean / (sd / math.sqrt(m))
    return Paired(m, mean, t, z_of_t(t, m - 1))


def user_outcomes(rows: list[dict[str, Any]]) -> Counts:
    """One outcome per user, as the release controller counts users (release/measure.py): each
    user's first judgement among ``rows`` (in time order); (accepts, users). A user who judged
    nothing is not counted (the controller counts them as no accept): the report's rates are of
    what judging users accepted."""
    first: dict[str, bool] = {}
    # (a request of n=2 is two rows at one time: the first feedback sent is the one counted)
    for r in sorted(rows, key=lambda r: (r["at"], r.get("feedback_at") or 0.0)):
        first.setdefault(r["user"], r["signal"] == "accept")
    return sum(first.values()), len(first)

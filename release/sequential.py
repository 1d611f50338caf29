"""An always-valid test of canary against stable: a discordant-pair e-process.

Why not a classic test: the controller looks at the canary after every event, and a fixed-horizon
test checked that often raises false alarms far above its nominal rate (bench/canary_stats.py
measures both). An e-process can be checked after every event and stopped at any time: under
equal accept rates it is a nonnegative martingale that starts at 1, so by Ville's inequality the
chance it EVER reaches 1/alpha is at most alpha.

The construction (exact, no asymptotics):

- Pair outcomes by a rule that never looks at them (:class:`Pairing`, a fold the controller saves
  and resumes), in an order that does not depend on them either: release/outcomes.py reads each
  user's outcome at a fixed time after their first answer in the canary and hands them over in
  the order of those first answers (paired in the order reward settled signals, rejects that came
  later than accepts made the next discordant pairs go one way: issue 45). An outcome of one arm
  pairs with the most recent outcome of the other arm still waiting for a partner, or waits
  itself. A pair once formed is never rebuilt, so the counts below only grow and the e-value is
  one process, not a new one each look. Keep the
  pairs whose outcomes differ (discordant pairs): W pairs where the canary accepted and stable
  did not, L the other way round.
- Under H0 (equal rates) each discordant pair is a canary win with probability 1/2, whatever the
  common rate. Under "canary better" it is some p > 1/2.
- The e-value against H0 for "canary better" is a mixture of likelihood ratios over a grid of
  p > 1/2 with equal weights: E = mean_k (2 p_k)^W (2 (1 - p_k))^L. A mixture of test
  martingales is one, so E is valid whatever p is; the grid only decides which lifts it finds
  fastest. "Canary worse" mirrors it over p < 1/2.

The confidence sequence inverts the same mixture around every candidate share p0 (see
:func:`confidence_band`); the console draws it as a band.

**Across canaries** the level each canary's PASS is tested at comes from the deployment's budget
(release/budget.py); FAIL is tested at alpha.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

#: Win shares the "canary better" mixture weighs equally (mirrored for "worse"). A grid rather
#: than a Beta prior: exact with plain floats, and it covers lifts from a few points up.
BETTER_GRID: tuple[float, ...] = (0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.9)


@dataclass(frozen=True)
class PairCount:
    """Discordant pairs so far: canary won ``wins``, stable won ``losses``; ``pairs`` counts all."""

    pairs: int = 0
    wins: int = 0
    losses: int = 0

    def add(self, canary_accepted: bool, stable_accepted: bool) -> PairCount:
        win = canary_accepted and not stable_accepted
        loss = stable_accepted and not canary_accepted
        return PairCount(self.pairs + 1, self.wins + win, self.losses + loss)


#: Outcomes kept waiting for a partner (the most recent): at a 10% share nine stable outcomes come
#: for each canary one, and the oldest of them would be paired last, far from their partner in time.
MAX_WAITING = 1_000


@dataclass
class Pairing:
    """The pairs of one canary, folded as outcomes are handed over (module docstring).

    Only one arm ever has outcomes waiting: an outcome of the other arm pairs at once. Its
    partner is the most recent waiting one, so pairs stay close in time (at a 10% share the
    oldest waiting stable outcome is many minutes old, and a drift of the accept rate over the
    day would read as a difference). Which one it is depends on the order outcomes are added in
    and their arms, never on what they were: valid as long as that order does not depend on the
    outcomes either, which release/outcomes.py ensures (users in the order of their first answer)."""

    count: PairCount = field(default_factory=PairCount)
    waiting_arm: str = ""
    #: the waiting arm's outcomes, oldest first
    waiting: list[bool] = field(default_factory=list)

    def add(self, arm: str, accepted: bool) -> None:
        """Fold in one outcome of ``arm`` (``canary`` or ``stable``)."""
        if self.waiting and self.waiting_arm != arm:
            partner = self.waiting.pop()
            canary, stable = (accepted, partner) if arm == "canary" else (partner, accepted)
            self.count = self.count.add(canary, stable)
            return
        self.waiting_arm = arm
        self.waiting.append(accepted)
        del self.waiting[:-MAX_WAITING]

    def to_dict(self) -> dict[str, Any]:
        c = self.count
        return {"pairs": c.pairs, "wins": c.wins, "losses": c.losses, "waiting_arm": self.waiting_arm,
                "waiting": [int(o) for o in self.waiting]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Pairing:
        return cls(PairCount(d["pairs"], d["wins"], d["losses"]), d["waiting_arm"], [bool(o) for o in d["waiting"]])


def pair_outcomes(canary: list[bool], stable: list[bool]) -> PairCount:
    """Pair two arms' outcomes by position, the i-th with the i-th; the longer arm's extra outcomes
    wait for a partner. For simulations of outcomes that are i.i.d. within each arm, where this
    and :class:`Pairing` pair alike in distribution; the controller folds with :class:`Pairing`."""
    count = PairCount()
    for c, s in zip(canary, stable):
        count = count.add(c, s)
    return count


def _log_mix(wins: int, losses: int, grid: tuple[float, ...]) -> float:
    terms = [wins * math.log(2 * p) + losses * math.log(2 * (1 - p)) for p in grid]
    top = max(terms)
    return top + math.log(sum(math.exp(t - top) for t in terms) / len(terms))


def log_e_better(count: PairCount) -> float:
    """log of the e-value against equal rates, for "the canary is accepted more often"."""
    return _log_mix(count.wins, count.losses, BETTER_GRID)


def log_e_worse(count: PairCount) -> float:
    """log of the e-value against equal rates, for "the canary is accepted less often"."""
    return _log_mix(count.losses, count.wins, BETTER_GRID)


#: The largest log e-value turned into a number: e^700 ~ 1e304, still a finite float (and a finite
#: JSON number), where math.exp raises OverflowError past ~709.8. About 1,200 all-loss pairs reach
#: it; any verdict was reached long before, so capping loses nothing a person or a rule reads.
LOG_E_CAP = 700.0


def e_value(log_e: float) -> float:
    """An e-value from its log, capped at ``exp(LOG_E_CAP)`` so that it stays a finite float.
    Every reader of the e-process (the judge's reasons, the saved analysis, the console's chart)
    takes it from here: one uncapped ``exp`` wedged the controller on a clearly losing canary."""
    return math.exp(min(log_e, LOG_E_CAP))


def confidence_band(count: PairCount, alpha: float, steps: int = 200) -> tuple[float, float]:
    """An always-valid interval for the canary's win share among discordant pairs (0.5: no
    difference), valid at every moment at once with probability at least 1 - 2 alpha: the
    two-sided companion of the two one-sided tests the judge runs at alpha each.

    A share p0 is inside while the e-value against "share = p0" stays below 1/(2 alpha). That
    e-value mixes the same offsets as the judge's tests, on both sides of p0, so at p0 = 0.5 it is
    the mean of ``e_better`` and ``e_worse``: whenever the judge says PASS or FAIL, 0.5 is outside.
    """
    w, lo_ = count.wins, count.losses
    if w + lo_ == 0:
        return 0.0, 1.0
    threshold = math.log(1 / (2 * alpha))
    offsets = [q - 0.5 for q in BETTER_GRID]
    inside = []
    for i in range(1, steps):
        p0 = i / steps
        terms = []
        for d in offsets:
            for q in (p0 + d, p0 - d):
                if 0 < q < 1:
                    terms.append(w * math.log(q / p0) + lo_ * math.log((1 - q) / (1 - p0)))
        top = max(terms)
        log_e = top + math.log(sum(math.exp(t - top) for t in terms) / (2 * len(offsets)))
        if log_e < threshold:
            inside.append(p0)
    if not inside:  # narrower than the grid: one grid step either side of the estimate
        share = w / (w + lo_)
        return max(0.0, share - 1 / steps), min(1.0, share + 1 / steps)
    # the outermost grid shares not rejected: 0.5 is outside exactly when its own e-value is
    # past the threshold, the moment the judge's verdict says so
    return min(inside), max(inside)

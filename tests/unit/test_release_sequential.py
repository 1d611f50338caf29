"""The canary's always-valid test (release/sequential.py), checked by simulation.

The claim under test is Ville's inequality: under equal accept rates the e-process reaches
1/alpha at ANY moment with probability at most alpha, so the controller may look after every
pair. The simulations below look after every pair of every run, exactly as the controller does.

How the simulations stay fast and still test the real functions: ``log_e_better`` grows with
the canary's wins W and falls with its losses L (checked below), so for each L there is a least
W at which it crosses log(1/alpha). That boundary is computed once with the module's own
function; a run crossed at some pair iff its cumulative (W, L) path touched the boundary, which
numpy checks for all runs and pairs at once. The band is evaluated with ``confidence_band``
itself at every distinct (W, L) any run visited.

Statistical reasoning of each assertion (seeds are fixed, so a run is reproducible; the margins
say how unlikely a failure is for a correct implementation):

- false alarms: with R runs the number of runs that ever cross is Binomial(R, q) with q <= alpha
  for a valid e-process. The test allows up to the 99.9% quantile of Binomial(R, alpha): a
  correct implementation fails it with probability below 0.1%. A naive z-test checked after
  every pair, run through the same harness, goes far past that bound: the harness can see an
  inflated rate when there is one.
- the band: the same reasoning at its own contract, 1 - 2 alpha; power: generous bounds. The
  numbers these seeds give are stated next to each assertion.
"""

from __future__ import annotations

import itertools
import json
import math
import random

import numpy as np
import pytest

from release import sequential
from release.sequential import (
    BETTER_GRID,
    PairCount,
    Pairing,
    confidence_band,
    log_e_better,
    log_e_worse,
    pair_outcomes,
)

ALPHA = 0.05
THRESHOLD = math.log(1 / ALPHA)


def binomial_upper_quantile(n: int, p: float, q: float) -> int:
    """The least k with P(Binomial(n, p) <= k) >= q (exact sum, in log space)."""
    cdf = 0.0
    for k in range(n + 1):
        log_pmf = (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)
                   + k * math.log(p) + (n - k) * math.log1p(-p))
        cdf += math.exp(log_pmf)
        if cdf >= q:
            return k
    return n


def crossing_boundary(losses_max: int, worse: bool = False) -> np.ndarray:
    """b[l]: the fewest canary wins at which ``log_e_better`` reaches log(1/alpha) with l losses;
    with ``worse``, the fewest losses at which ``log_e_worse`` does with l wins."""
    def log_e(lead: int, other: int) -> float:
        return log_e_worse(PairCount(0, other, lead)) if worse else log_e_better(PairCount(0, lead, other))

    b = np.empty(losses_max + 1, dtype=np.int64)
    lead = 0
    for other in range(losses_max + 1):  # b is nondecreasing: carry the count over
        while log_e(lead, other) < THRESHOLD:
            lead += 1
        b[other] = lead
    return b


def simulate(rng: np.random.Generator, runs: int, pairs: int, p_canary: float, p_stable: float):
    """Cumulative canary wins and losses after each pair: two (runs, pairs) arrays."""
    canary = rng.random((runs, pairs)) < p_canary
    stable = rng.random((runs, pairs)) < p_stable
    return np.cumsum(canary & ~stable, axis=1), np.cumsum(stable & ~canary, axis=1), canary, stable


# -- pairing -------------------------------------------------------------------------------------

def test_pairs_follow_arrival_order_and_the_longer_arms_tail_waits():
    canary = [True, False, True, True, False]
    stable = [False, False, True, False]
    # (T,F) win, (F,F), (T,T), (T,F) win; the fifth canary outcome has no partner yet
    assert pair_outcomes(canary, stable) == PairCount(pairs=4, wins=2, losses=0)
    assert pair_outcomes(stable, canary) == PairCount(pairs=4, wins=0, losses=2)
    # its partner arrives: a stable accept against the canary's reject, a loss
    assert pair_outcomes(canary, [*stable, True]) == PairCount(pairs=5, wins=2, losses=1)
    # pairing is by position, never by outcome: the same outcomes in another order pair otherwise
    assert pair_outcomes([True, False], [False, True]) == PairCount(2, 1, 1)
    assert pair_outcomes([True, False], [True, False]) == PairCount(2, 0, 0)
    assert pair_outcomes([], [True, True]) == PairCount()


# (arm of each outcome as it comes, accepted) -> the pairs; each pairs with the MOST RECENT waiting
# outcome of the other arm, so at a 10% share a canary outcome meets the stable one just before it
PAIRING = {
    "alternating arms pair as they come": (
        [("canary", True), ("stable", False), ("stable", True), ("canary", True)], PairCount(2, 1, 0), "", 0),
    "a run of one arm waits; the other pairs with its newest first": (
        # s1=F s2=T wait; c1=F meets s2=T (loss), c2=T meets s1=F (win)
        [("stable", False), ("stable", True), ("canary", False), ("canary", True)], PairCount(2, 1, 1), "", 0),
    "at a small share stable outcomes wait and each canary one takes the latest": (
        [("stable", True)] * 5 + [("stable", False), ("canary", True)], PairCount(1, 1, 0), "stable", 5),
    "only one arm ever waits": (
        [("canary", True), ("canary", False), ("stable", False)], PairCount(1, 0, 0), "canary", 1),
    "nothing yet": ([], PairCount(), "", 0),
}


@pytest.mark.parametrize("name", list(PAIRING))
def test_pairing_is_a_fold_each_outcome_meeting_the_newest_waiting_one_of_the_other_arm(name):
    outcomes, count, waiting_arm, waiting = PAIRING[name]
    p = Pairing()
    for arm, accepted in outcomes:
        p.add(arm, accepted)
    assert (p.count, p.waiting_arm if p.waiting else "", len(p.waiting)) == (count, waiting_arm, waiting)


def test_pairs_once_formed_never_change_and_the_fold_resumes_from_its_saved_state():
    rnd = random.Random(5)
    stream = [(rnd.choice(["canary", "stable", "stable"]), rnd.random() < 0.4) for _ in range(3000)]
    whole, seen = Pairing(), []
    for arm, accepted in stream:
        whole.add(arm, accepted)
        seen.append(whole.count)
    # every count only grows: a pair formed is never rebuilt, whatever comes after it
    for a, b in itertools.pairwise(seen):
        assert b.pairs >= a.pairs and b.wins >= a.wins and b.losses >= a.losses and b.pairs - a.pairs <= 1
    # saved and resumed at every 100th outcome: the same pairs as one uninterrupted fold
    resumed = Pairing()
    for i, (arm, accepted) in enumerate(stream):
        if i % 100 == 0:
            resumed = Pairing.from_dict(json.loads(json.dumps(resumed.to_dict())))
        resumed.add(arm, accepted)
        assert resumed.count == seen[i]
    assert resumed.to_dict() == whole.to_dict()


def test_waiting_outcomes_are_bounded_dropping_the_oldest(monkeypatch):
    monkeypatch.setattr(sequential, "MAX_WAITING", 3)
    p = Pairing()
    for accepted in (True, True, False, False, True):  # the two oldest accepts are dropped
        p.add("stable", accepted)
    assert p.waiting == [False, False, True]
    for _ in range(4):
        p.add("canary", True)
    assert p.count == PairCount(3, 2, 0) and p.waiting_arm == "canary" and p.waiting == [True]


def test_pair_count_add_counts_only_discordant_pairs_as_wins_or_losses():
    c = PairCount().add(True, False).add(False, True).add(True, True).add(False, False).add(True, False)
    assert c == PairCount(pairs=5, wins=2, losses=1)


# -- the e-values ------------------------------------------------------------------------------

def test_e_values_start_at_one_and_ignore_concordant_pairs():
    assert log_e_better(PairCount()) == pytest.approx(0.0, abs=1e-12)
    assert log_e_worse(PairCount()) == pytest.approx(0.0, abs=1e-12)
    assert log_e_better(PairCount(500, 7, 3)) == log_e_better(PairCount(10, 7, 3))


def test_e_value_is_the_grid_mixture_and_worse_mirrors_better():
    w, losses = 17, 9
    direct = math.log(sum((2 * p) ** w * (2 * (1 - p)) ** losses for p in BETTER_GRID) / len(BETTER_GRID))
    assert log_e_better(PairCount(26, w, losses)) == pytest.approx(direct, rel=1e-12)
    assert log_e_worse(PairCount(26, losses, w)) == pytest.approx(direct, rel=1e-12)
    # no overflow far past any realistic canary: the mixture is summed in log space
    assert math.isfinite(log_e_better(PairCount(10**6, 600_000, 400_000)))


@pytest.mark.parametrize(("w", "losses"), [(0, 0), (3, 0), (0, 3), (12, 15), (40, 22), (200, 190)])
def test_e_value_is_a_martingale_under_equal_rates(w, losses):
    # Under H0 the next discordant pair is a win or a loss with probability 1/2 each: the
    # expected next e-value must equal the current one exactly (that is what Ville needs).
    now = math.exp(log_e_better(PairCount(0, w, losses)))
    nxt = 0.5 * math.exp(log_e_better(PairCount(0, w + 1, losses))) + 0.5 * math.exp(
        log_e_better(PairCount(0, w, losses + 1)))
    assert nxt == pytest.approx(now, rel=1e-9)


def test_e_value_grows_with_wins_and_falls_with_losses():
    # the crossing boundaries used by the simulations rely on this
    for w in range(0, 60, 7):
        for losses in range(0, 60, 5):
            here = log_e_better(PairCount(0, w, losses))
            assert log_e_better(PairCount(0, w + 1, losses)) > here > log_e_better(PairCount(0, w, losses + 1))
            here = log_e_worse(PairCount(0, w, losses))
            assert log_e_worse(PairCount(0, w, losses + 1)) > here > log_e_worse(PairCount(0, w + 1, losses))


# -- validity under continuous monitoring --------------------------------------------------------

def test_false_alarms_stay_at_most_alpha_when_checked_after_every_pair():
    # 2,000 runs x 1,000 pairs at 0.30 vs 0.30 (seed 20250101); each run is checked after every
    # pair. Expected: about 4% of runs ever cross each way (78 and 80 with this seed; Ville: at
    # most 5%). Allowed: the 99.9% quantile of Binomial(2000, 0.05), 131 runs.
    runs, pairs = 2000, 1000
    wins, losses, canary, stable = simulate(np.random.default_rng(20250101), runs, pairs, 0.3, 0.3)
    bound = binomial_upper_quantile(runs, ALPHA, 0.999)
    b, b_worse = crossing_boundary(pairs), crossing_boundary(pairs, worse=True)
    better = int((wins >= b[losses]).any(axis=1).sum())
    worse = int((losses >= b_worse[wins]).any(axis=1).sum())
    assert better <= bound, f"{better} of {runs} runs crossed 'canary better' (bound {bound})"
    assert worse <= bound, f"{worse} of {runs} runs crossed 'canary worse' (bound {bound})"
    # spot check that the boundary is the real function's: every crossing is one
    hit = np.argwhere(wins >= b[losses])[:50]
    assert all(log_e_better(PairCount(0, int(wins[r, k]), int(losses[r, k]))) >= THRESHOLD for r, k in hit)
    assert all(log_e_better(PairCount(0, int(b[k]) - 1, k)) < THRESHOLD for k in range(0, pairs, 97))

    # The same harness on a one-sided z-test at the same alpha, checked after every pair from the
    # 50th on (the judge's min_events), flags far more runs: about 30% of them (612 here).
    n = np.arange(1, pairs + 1)
    pc, ps = np.cumsum(canary, axis=1) / n, np.cumsum(stable, axis=1) / n
    pooled = (pc + ps) / 2
    with np.errstate(divide="ignore", invalid="ignore"):
        z = (pc - ps) / np.sqrt(pooled * (1 - pooled) * 2 / n)
    naive = int((z[:, 49:] >= 1.6448536269514722).any(axis=1).sum())
    assert naive > 2 * bound, f"the naive repeated z-test flagged only {naive} runs"


def test_reaches_pass_in_most_runs_under_a_real_lift():
    # 0.40 against 0.30 (seed 7): a discordant pair is a canary win with probability 0.61.
    # Expected: about 97% of runs PASS within 1,000 pairs (median ~290 pairs), a wrong-way FAIL
    # in about one run of 500.
    runs, pairs = 500, 1000
    wins, losses, _, _ = simulate(np.random.default_rng(7), runs, pairs, 0.4, 0.3)
    b = crossing_boundary(pairs)
    passed = (wins >= b[losses]).any(axis=1)
    failed = (losses >= crossing_boundary(pairs, worse=True)[wins]).any(axis=1)
    assert passed.mean() >= 0.9
    assert failed.sum() <= binomial_upper_quantile(runs, ALPHA, 0.999)  # a wrong-way verdict is rare
    first = np.where(passed, (wins >= b[losses]).argmax(axis=1) + 1, pairs + 1)
    assert np.median(first) < 500


# -- the confidence band -------------------------------------------------------------------------

def band_contains_at_all_times(wins: np.ndarray, losses: np.ndarray, share: float) -> np.ndarray:
    """Per run: whether ``confidence_band`` contained ``share`` after every pair."""
    keys = wins.astype(np.int64) * 1_000_003 + losses
    uniq, inverse = np.unique(keys, return_inverse=True)
    inside = np.empty(len(uniq), dtype=bool)
    for i, key in enumerate(uniq.tolist()):
        lo, hi = confidence_band(PairCount(0, key // 1_000_003, key % 1_000_003), ALPHA)
        inside[i] = lo <= share <= hi
    return inside[inverse.reshape(keys.shape)].all(axis=1)


@pytest.mark.parametrize(("p_canary", "seed", "runs", "pairs"), [(0.3, 11, 400, 200), (0.4, 12, 300, 150)])
def test_band_covers_the_true_win_share_at_all_times(p_canary, seed, runs, pairs):
    # The true share of discordant pairs the canary wins is 0.5 under equal rates and
    # 0.28 / 0.46 = 0.609 at 0.40 vs 0.30. The band's contract (its docstring): it holds the true
    # share at every moment at once with probability at least 1 - 2 alpha (it inverts a two-sided
    # e-value at 1/(2 alpha)). Allowed: the 99.9% quantile of Binomial(runs, 2 alpha). Measured
    # with these seeds: 26 of 400 runs (6.5%: more than alpha, within 2 alpha) under equal rates
    # and 11 of 300 (3.7%) under the lift miss at some moment. (Sizes are small because each
    # band costs ~1.5 ms and every distinct (W, L) a run visits is evaluated.)
    p_stable = 0.3
    share = p_canary * (1 - p_stable) / (p_canary * (1 - p_stable) + p_stable * (1 - p_canary))
    wins, losses, _, _ = simulate(np.random.default_rng(seed), runs, pairs, p_canary, p_stable)
    misses = int((~band_contains_at_all_times(wins, losses, share)).sum())
    assert misses <= binomial_upper_quantile(runs, 2 * ALPHA, 0.999), f"{misses} of {runs} runs"


def test_band_agrees_with_the_judges_verdicts():
    # Where the e-process first says PASS (or FAIL) the band does not reach past 0.5 on the other
    # side. (It touches 0.5: the band is widened by one grid step around the shares it keeps.)
    b, b_worse = crossing_boundary(300), crossing_boundary(300, worse=True)
    for k in range(0, 300, 15):
        assert confidence_band(PairCount(0, int(b[k]), k), ALPHA)[0] >= 0.5
        assert confidence_band(PairCount(0, k, int(b_worse[k])), ALPHA)[1] <= 0.5


def test_band_excludes_equal_rates_eventually_under_a_real_lift():
    # 0.40 vs 0.30, 200 runs x 2,000 pairs (seed 13): after the last pair the band's lower end is
    # above 0.5 in nearly every run (the point estimate is ~0.61 from ~900 discordant pairs).
    wins, losses, _, _ = simulate(np.random.default_rng(13), 200, 2000, 0.4, 0.3)
    lows = [confidence_band(PairCount(0, int(w), int(lo)), ALPHA)[0] for w, lo in zip(wins[:, -1], losses[:, -1])]
    assert np.mean(np.array(lows) > 0.5) >= 0.95


def test_band_edges():
    assert confidence_band(PairCount(), ALPHA) == (0.0, 1.0)
    lo, hi = confidence_band(PairCount(40, 20, 20), ALPHA)
    assert lo < 0.5 < hi and hi - 0.5 == pytest.approx(0.5 - lo, abs=1e-9)  # symmetric
    lo2, hi2 = confidence_band(PairCount(400, 200, 200), ALPHA)
    assert lo < lo2 < 0.5 < hi2 < hi  # narrows with evidence
    lo3, hi3 = confidence_band(PairCount(100, 0, 100), ALPHA)
    assert lo3 <= 0.005 and hi3 < 0.2  # all losses: the band hugs 0 (its first grid share)
    lo4, _ = confidence_band(PairCount(0, 20, 20), 0.01)
    assert lo4 < lo  # a smaller alpha, a wider band


@pytest.mark.parametrize(("w", "losses"), [(3, 1), (60, 40), (6_025, 3_975), (602_500, 397_500)])
def test_band_keeps_a_width_around_the_point_estimate(w, losses):
    # however much evidence, the band is an interval around the estimate, never a single point
    lo, hi = confidence_band(PairCount(0, w, losses), ALPHA)
    assert lo < w / (w + losses) < hi

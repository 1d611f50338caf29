"""The demo's statistics (local/evidence.py): the t over prompts, one outcome per user."""

from __future__ import annotations

import numpy as np
import pytest

from local.evidence import Paired, beta_inc, lift_z, prompt_paired, t_upper, user_outcomes, z_of_t
from local.report import TASTE_Z


@pytest.mark.parametrize("t, df, p", [
    (2.131, 15, 0.025),  # the tables' 97.5% points
    (12.706, 1, 0.025),
    (2.228, 10, 0.025),
    (4.0, 15, 0.00058),
    (0.0, 7, 0.5),
    (-2.131, 15, 0.975),
    (1.96, 100_000, 0.025),  # the normal's, with many degrees of freedom
])
def test_the_t_tail_matches_the_tables(t, df, p):
    assert t_upper(t, df) == pytest.approx(p, rel=2e-3, abs=1e-5)


@pytest.mark.parametrize("a, b, x, want", [(1, 1, 0.3, 0.3), (2, 1, 0.5, 0.25), (1, 2, 0.5, 0.75), (3, 3, 0.5, 0.5)])
def test_the_incomplete_beta_in_closed_forms(a, b, x, want):
    assert beta_inc(a, b, x) == pytest.approx(want)


def test_a_t_is_stated_as_the_normal_z_of_the_same_p():
    assert z_of_t(1.96, 100_000) == pytest.approx(1.96, abs=1e-3)
    # a t of 4 over 16 prompts is p 0.0006: a z of 3.25, short of the goal; 5.5 is needed
    assert z_of_t(4.0, 15) == pytest.approx(3.25, abs=0.01)
    assert z_of_t(5.4, 15) < TASTE_Z < z_of_t(5.5, 15)
    assert z_of_t(1e6, 15) == pytest.approx(19.25, abs=0.01)  # p 1e-82
    assert z_of_t(1e30, 15) == 37.0  # past a float's p: capped, still a number


@pytest.mark.parametrize("by_prompt, want", [
    ([], Paired(0, None, None, None)),
    ([((10, 64), (10, 64))] * 16, Paired(16, 0.0, 0.0, 0.0)),  # the same weights, the same draws
    ([((10, 64), (20, 64))], Paired(1, 10 / 64, None, None)),  # one prompt: no spread to judge by
    ([((10, 64), (20, 64))] * 4, Paired(4, 10 / 64, None, None)),  # all alike, not zero: no spread either
    ([((10, 64), (20, 64)), ((0, 0), (5, 64))], Paired(1, 10 / 64, None, None)),  # unjudged on one side: left out
])
def test_prompt_pairs_edge_cases(by_prompt, want):
    assert prompt_paired(by_prompt) == want


def test_the_t_is_over_prompts():
    # differences 0.1, 0.2, 0.3: mean 0.2, sd 0.1, t = 0.2 / (0.1 / sqrt 3)
    got = prompt_paired([((10, 100), (20, 100)), ((10, 100), (30, 100)), ((10, 100), (40, 100))])
    assert got.t == pytest.approx(0.2 / (0.1 / 3 ** 0.5)) and got.z == pytest.approx(z_of_t(got.t, 2))


@pytest.mark.parametrize("drift", ["normal", "two_point"])
def test_a_version_that_drifts_per_prompt_with_no_average_gain_does_not_reach_the_goal(drift):
    # 2,000 runs of the offline measure's shape: 16 prompts x 64 answers each side, each prompt's
    # start accept rate anywhere in 0.3-0.7, and the newest version's moved per prompt by a drift
    # of mean zero (sd 0.25, or +-0.25 at random). Pooled as 1,024 independent answers a side, the
    # old statistic reached 4 in 8.4% and 9.7% of these runs (the audit's 9%); paired by prompt,
    # 0 and 2 of 2,000 (a t's p is exact for normal differences; a drift of two values, which
    # 16 prompts can share by sign, is its worst case). Seeded: the counts are these every time.
    rng = np.random.default_rng(45)
    base = rng.uniform(0.3, 0.7, (2000, 16))
    moved = rng.normal(0, 0.25, base.shape) if drift == "normal" else 0.25 * rng.choice((-1.0, 1.0), base.shape)
    starts, newests = rng.binomial(64, base).tolist(), rng.binomial(64, np.clip(base + moved, 0, 1)).tolist()
    pooled = paired = 0
    for start, newest in zip(starts, newests):
        pooled += (lift_z((sum(start), 1024), (sum(newest), 1024)) or 0) >= TASTE_Z
        paired += (prompt_paired([((a, 64), (b, 64)) for a, b in zip(start, newest)]).z or 0) >= TASTE_Z
    assert pooled >= 100, pooled  # the old statistic's false goal, at least 5% of runs
    assert paired <= 4, paired  # at most 0.2%


def test_each_user_counts_once_by_their_first_judgement():
    rows = [{"at": 3.0, "user": "a", "signal": "accept"}, {"at": 1.0, "user": "a", "signal": "reject"},
            {"at": 2.0, "user": "b", "signal": "accept"}, {"at": 4.0, "user": "b", "signal": "accept"}]
    assert user_outcomes(rows) == (1, 2)  # a rejected first; b accepted
    assert user_outcomes([]) == (0, 0)
    # two answers to one request (n=2) share its time: the one whose feedback was sent first counts,
    # as the release controller counts the first feedback that arrives
    pair = [{"at": 1.0, "user": "c", "signal": "accept", "feedback_at": 2.5},
            {"at": 1.0, "user": "c", "signal": "reject", "feedback_at": 1.5}]
    assert user_outcomes(pair) == (0, 1) and user_outcomes(pair[::-1]) == (0, 1)

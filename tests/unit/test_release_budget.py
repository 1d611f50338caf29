"""Every level the release controller tests at (release/budget.py), table-tested: the budget
across canaries for PASS, and the guardrails' looks within a canary."""

from __future__ import annotations

import itertools

import pytest

from release.budget import (
    FIRST_LOOK_USERS,
    canary_alpha,
    gamma,
    guardrail_level,
    look_due,
    pass_level,
)

B = 20  # release.budget_canaries' default


def test_a_blocks_gammas_sum_to_one_half_spread_evenly():
    for block in (1, 2, 5, 20, 100):
        assert sum(gamma(j, block) for j in range(1, block + 1)) == pytest.approx(1.0)
        assert min(gamma(j, block) for j in range(1, block + 1)) >= 1 / (2 * block)
    with pytest.raises(ValueError):
        gamma(21, 20)


@pytest.mark.parametrize("k, passes, level", [
    (1, 0, 0.05 * 0.2875),  # the first canary: 1/40 + 21/80 of the budget
    (2, 0, 0.05 * (1 / 40 + 21 / 240)),
    (2, 1, 0.05 * (1 / 40 + 21 / 240) * 2),  # a pass before it earns it its level again (e-LOND)
    (10, 0, 0.05 * (1 / 40 + 21 / 4400)),
    (20, 0, 0.05 * (1 / 40 + 21 / 16800)),
    (21, 0, 0.05 * 0.2875),  # a new block: the first canary's level again
    (50, 0, 0.05 * (1 / 40 + 21 / 4400)),  # the 10th of the third block
])
def test_the_kth_canary_is_tested_at_its_blocks_elond_level(k, passes, level):
    assert canary_alpha(0.05, k, passes, B) == pytest.approx(level)


def test_no_canary_is_tested_below_the_even_share_nor_above_alpha():
    levels = [canary_alpha(0.05, k, 0, B) for k in range(1, 200)]
    assert min(levels) >= 0.05 / (2 * B)  # a lift stays promotable after any number of canaries
    block = levels[:B]
    assert all(a > b for a, b in itertools.pairwise(block))  # within a block, each next needs more
    assert max(canary_alpha(0.05, k, (k - 1) % B, B) for k in range(1, 200)) <= 0.05


@pytest.mark.parametrize("k, passes", [(3, 3), (21, 1), (1, -1)])
def test_a_count_no_budget_can_have_is_refused(k, passes):
    with pytest.raises(ValueError):
        canary_alpha(0.05, k, passes, B)  # e.g. a pass before the first canary of a block


@pytest.mark.parametrize("before, level", [
    ([], canary_alpha(0.05, 1, 0, B)),
    ([True], canary_alpha(0.05, 2, 1, B)),
    ([False] * 5 + [True, True], canary_alpha(0.05, 8, 2, B)),
    ([True] * 20, canary_alpha(0.05, 21, 0, B)),  # the last block's passes are not this block's
    ([True] * 20 + [False, True], canary_alpha(0.05, 23, 1, B)),
])
def test_the_next_level_reads_the_passes_of_its_own_block(before, level):
    assert pass_level(0.05, B, before) == pytest.approx(level)


@pytest.mark.parametrize("users, taken, due", [
    (0, 0, 0), (FIRST_LOOK_USERS - 1, 0, 0),  # too few users in the smaller arm
    (20, 0, 1), (39, 1, 0),  # the first look, taken once
    (40, 1, 2), (79, 2, 0), (80, 2, 3),  # at each doubling
    (700, 1, 6),  # looks skipped between two ticks are not taken: the newest is
    (700, 6, 0),
])
def test_a_guardrail_look_is_due_at_each_doubling_of_users_and_taken_once(users, taken, due):
    assert look_due(users, taken) == due


def test_the_guardrails_levels_sum_to_their_budget():
    # over every look and the checks of each, by the union bound: identical versions are rolled
    # back at most guardrail_alpha of the time however long the canary runs
    total = sum(guardrail_level(0.01, look, 6) * 6 for look in range(1, 100_000))
    assert total == pytest.approx(0.01, rel=1e-4) and total <= 0.01
    assert guardrail_level(0.01, 1, 6) == pytest.approx(0.01 / 12)
    with pytest.raises(ValueError):
        guardrail_level(0.01, 0, 6)

"""The candidate state machine (release/states.py): every pair of states, allowed or refused.

The expected table is written out here on its own (not read from ``ALLOWED``), so an edit to the
module's table that nobody meant shows up as a failing pair.
"""

from __future__ import annotations

import itertools

import pytest

from release.states import ALLOWED, FINAL, LIVE, State, TransitionRefused, check

S = State
EXPECTED: dict[State, set[State]] = {
    S.CANDIDATE: {S.GATING, S.SUPERSEDED, S.REJECTED},
    S.GATING: {S.CANARY, S.REJECTED, S.SUPERSEDED},
    S.CANARY: {S.AWAITING_APPROVAL, S.PROMOTED, S.HELD, S.ROLLED_BACK, S.REJECTED},
    S.AWAITING_APPROVAL: {S.PROMOTED, S.REJECTED, S.ROLLED_BACK},
    S.HELD: {S.PROMOTED, S.ROLLED_BACK, S.REJECTED},
    S.PROMOTED: set(),
    S.REJECTED: set(),
    S.ROLLED_BACK: set(),
    S.SUPERSEDED: set(),
}
PAIRS = list(itertools.product(State, State))


def test_the_expected_table_covers_every_state():
    assert set(EXPECTED) == set(State) == set(ALLOWED)


@pytest.mark.parametrize(("current", "target"), [(c, t) for c, t in PAIRS if t in EXPECTED[c]],
                         ids=lambda s: s.value)
def test_every_allowed_transition_is_made(current, target):
    assert check(7, current, target) is True


@pytest.mark.parametrize(("current", "target"),
                         [(c, t) for c, t in PAIRS if c != t and t not in EXPECTED[c]], ids=lambda s: s.value)
def test_every_other_transition_is_refused_with_a_reason(current, target):
    with pytest.raises(TransitionRefused) as err:
        check(7, current, target)
    reason = str(err.value)
    assert reason.startswith("version 7 is ")
    assert current.value in reason and target.value in reason
    if current in FINAL:
        assert reason == f"version 7 is already {current.value}: it cannot become {target.value}"
    else:
        assert reason == f"version 7 is {current.value}: it cannot become {target.value} from there"


@pytest.mark.parametrize("state", list(State), ids=lambda s: s.value)
def test_the_same_state_is_a_no_op(state):
    # a repeated request, or a controller redoing a step after a crash; final states included
    assert check(7, state, state) is False


@pytest.mark.parametrize("state", sorted(FINAL), ids=lambda s: s.value)
def test_final_states_refuse_everything_else(state):
    assert FINAL == {S.PROMOTED, S.REJECTED, S.ROLLED_BACK, S.SUPERSEDED}
    for target in State:
        if target != state:
            with pytest.raises(TransitionRefused, match="already"):
                check(1, state, target)


def test_the_table_keeps_its_promises():
    # every live canary can be rolled back, and only a live one can be promoted
    assert all(S.ROLLED_BACK in ALLOWED[s] for s in LIVE)
    assert {c for c, targets in ALLOWED.items() if S.PROMOTED in targets} == LIVE
    # a newer candidate supersedes the ones not yet gated; a live canary is never superseded
    # (it would keep serving with no routing change): it is decided first
    assert {c for c, targets in ALLOWED.items() if S.SUPERSEDED in targets} == {S.CANDIDATE, S.GATING}
    # a person can turn down every live canary
    assert all(S.REJECTED in ALLOWED[s] for s in LIVE)
    # from every state some final state is reachable (nothing gets stuck)
    for start in State:
        seen, todo = {start}, [start]
        while todo:
            for nxt in ALLOWED[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        assert seen & FINAL, start

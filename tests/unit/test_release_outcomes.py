"""Outcome windows (release/outcomes.py), without a tally: when a user's window is read, in what
order, and what it gives. The tally's side (who is left out, the pairs) is in test_release_measure.py.
"""

from __future__ import annotations

import json

import pytest

from release import outcomes
from release.outcomes import JUDGE_WAIT_S, Kind, Read, Windows

ALL_JUDGED = {f"g{i}" for i in range(100)}.__contains__


def read(w: Windows, now: float, judged=ALL_JUDGED) -> list[tuple[str, str, str, bool]]:
    return [(r.user, r.arm, r.kind.value, r.accepted) for r in w.close(now, judged)]


# answers (user, arm, completed at, generation, signal) in arrival order -> the windows read by
# t = 100 (window 5 s, settle 10 s), in order
ORDER = {
    "read in the order of first answers, not of arrival": (
        [("bob", "stable", 2, "g2", "reject"), ("ann", "canary", 1, "g1", "accept")],
        [("ann", "canary", "counted", True), ("bob", "stable", "counted", False)]),
    "an earlier answer arriving later opens the window there, with its arm": (
        [("ann", "canary", 9, "g9", "accept"), ("ann", "stable", 1, "g1", "ignore")],
        [("ann", "stable", "counted", False)]),
    "the earliest explicit signal in the window is the outcome": (
        [("ann", "canary", 4, "g4", "accept"), ("ann", "canary", 1, "g1", "ignore"),
         ("ann", "canary", 2, "g2", "reject")],
        [("ann", "canary", "counted", False)]),
    "an answer completed past the window gives no outcome": (
        [("ann", "canary", 1, "g1", "ignore"), ("ann", "canary", 7, "g7", "accept")],
        [("ann", "canary", "counted", False)]),
    "answers of both arms in the window: counted apart (the routing changed)": (
        [("ann", "canary", 1, "g1", "ignore"), ("ann", "stable", 2, "g2", "accept")],
        [("ann", "canary", "switched", False)]),
    "first by stable before the canary loaded, then by the canary: apart, not a stable non-accept": (
        [("ann", "stable", 1, "g1", "ignore"), ("ann", "canary", 3, "g3", "accept")],
        [("ann", "stable", "switched", False)]),
    "an earlier answer of the other arm arriving later makes the window switched": (
        [("ann", "canary", 3, "g3", "accept"), ("ann", "stable", 1, "g1", "ignore")],
        [("ann", "stable", "switched", False)]),
    "the other arm past the window leaves the window whole": (
        [("ann", "stable", 1, "g1", "accept"), ("ann", "canary", 7, "g7", "reject")],
        [("ann", "stable", "counted", True)]),
}


@pytest.mark.parametrize("name", list(ORDER))
def test_which_windows_are_read_in_what_order_and_what_they_give(name):
    answers, want = ORDER[name]
    w = Windows(window_s=5, settle_s=10)
    for user, arm, at, gid, signal in answers:
        assert w.add(user, arm, at, gid, signal)
    assert read(w, 100) == want and w.open == {}


def test_a_window_is_read_once_due_and_not_before():
    w = Windows(window_s=5, settle_s=10)
    w.add("ann", "canary", 1.0, "g1", "accept")
    assert read(w, 15.9) == [] and read(w, 16.0) == [("ann", "canary", "counted", True)]


def test_a_due_window_whose_signal_is_not_judged_holds_the_later_ones_then_is_given_up():
    w = Windows()
    w.add("ann", "canary", 1.0, "g1", "accept")
    w.add("bob", "stable", 2.0, "g2", "ignore")  # nothing to judge, but after ann
    nothing = set().__contains__
    assert read(w, 10, nothing) == []
    assert read(w, 1 + JUDGE_WAIT_S, nothing) == [("ann", "canary", "unjudged", False),
                                                  ("bob", "stable", "counted", False)]


def test_a_user_answering_before_the_last_window_read_is_late():
    w = Windows()
    w.add("ann", "canary", 5.0, "g5", "ignore")
    assert read(w, 10) == [("ann", "canary", "counted", False)]
    assert not w.add("bob", "stable", 4.0, "g4", "accept")  # would pair out of order
    assert w.add("cy", "stable", 6.0, "g6", "accept")


def test_new_users_are_read_apart_unless_counted():
    w = Windows(count_new_users=False)
    w.know("ann")
    w.add("ann", "canary", 1.0, "g1", "accept")
    w.add("puppet", "canary", 2.0, "g2", "accept")
    assert read(w, 10) == [("ann", "canary", "counted", True), ("puppet", "canary", "new", False)]


def test_open_windows_and_known_users_are_bounded(monkeypatch):
    monkeypatch.setattr(outcomes, "MAX_OPEN", 2)
    monkeypatch.setattr(outcomes, "MAX_KNOWN", 2)
    w = Windows()
    assert [w.add(u, "stable", 1.0, "g1", "ignore") for u in ("a", "b", "c")] == [True, True, False]
    for u in ("a", "b", "c"):
        w.know(u)
    assert list(w.known) == ["b", "c"]


def test_saved_windows_resume_in_the_same_order():
    w = Windows(window_s=1, settle_s=2, count_new_users=False)
    w.know("ann")
    for user, at in (("ann", 3.0), ("bob", 1.0), ("ann", 2.0)):
        w.add(user, "canary", at, f"g{int(at)}", "accept")
    back = Windows.from_dict(json.loads(json.dumps(w.to_dict())))
    assert back == w and read(back, 100) == read(w, 100) == [("bob", "canary", "new", False),
                                                              ("ann", "canary", "counted", True)]


def test_a_window_saved_by_older_code_reads_as_of_its_first_arm():
    old = {"window_s": 5, "settle_s": 10, "count_new_users": True, "known": [], "read_through": 0.0,
           "clock": 0.0, "open": {"ann": ["stable", 1.0, 1.0, "g1", "stable", "accept"]}}
    assert read(Windows.from_dict(old), 100) == [("ann", "stable", "counted", True)]


def test_a_read_names_its_kind_as_a_type():
    assert Read("u", "canary", Kind.OUTCOME, True).kind is Kind.OUTCOME and Kind.NEW.value == "new"


@pytest.mark.parametrize("last_seen, n, kept", [
    ({}, 3, []),
    ({"a": 1.0, "b": 3.0, "c": 2.0}, 5, ["a", "c", "b"]),  # all, oldest first: know()'s order
    ({"a": 1.0, "b": 3.0, "c": 2.0}, 2, ["c", "b"]),  # the least recent goes
    ({"b": 2.0, "a": 2.0, "c": 1.0}, 2, ["a", "b"]),  # ties by id: the same episodes, the same set
])
def test_the_users_seen_before_a_canary_keep_the_most_recent(last_seen, n, kept):
    assert outcomes.most_recent(last_seen, n) == kept


def test_seeded_users_past_the_bound_lose_the_least_recent_first(monkeypatch):
    monkeypatch.setattr(outcomes, "MAX_KNOWN", 2)
    w = Windows(count_new_users=False)
    for user in outcomes.most_recent({"old": 1.0, "mid": 2.0, "new": 3.0}, 3):
        w.know(user)
    assert list(w.known) == ["mid", "new"]

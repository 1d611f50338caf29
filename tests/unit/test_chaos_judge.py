"""bench/chaos_judge.py: the whole-loop fault run's invariants, one table per rule, each shown
able to break."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

J = runpy.run_path(str(Path(__file__).resolve().parents[2] / "bench" / "chaos_judge.py"))
VersionCheck = J["VersionCheck"]


@pytest.mark.parametrize("rewards, dead, lost, double", [
    ({"a": {b"r"}, "b": {b"r"}}, {}, 0, 0),
    ({"a": {b"r"}}, {"b": {"ingest:late_feedback"}}, 0, 0),  # a dead letter with its reason accounts
    ({"a": {b"r"}}, {}, 1, 0),  # b: neither
    ({"a": {b"r1", b"r2"}, "b": {b"r"}}, {}, 0, 1),  # a: two distinct rewards
    ({"a": {b"r"}, "b": set()}, {"b": set()}, 1, 0),  # empty entries are nothing
])
def test_every_judged_generation_is_one_reward_or_a_dead_letter(rewards, dead, lost, double):
    inv_lost, inv_double, counts = J["judged_accounted"](["a", "b", "a"], rewards, dead)
    assert (inv_lost.broken, inv_double.broken) == (lost, double)
    assert inv_lost.held == (lost == 0) and inv_double.held == (double == 0)
    assert counts["judged"] == 2 and counts["lost"] == lost


@pytest.mark.parametrize("ledgers, broken", [
    ({1: ["a", "b"], 2: ["c"]}, 0),
    ({1: ["a", "b"], 2: ["b"]}, 1),  # two versions
    ({1: ["a", "a"]}, 1),  # twice in one
    ({0: [], 1: []}, 0),
])
def test_no_sample_trained_twice(ledgers, broken):
    assert J["double_trained"](ledgers).broken == broken


def _check(**kw):
    base = {"version": 3, "first_served_at": 100.0, "store_manifest": "m", "announced_manifest": "m",
                "candidate_manifest": "m", "gated": True, "first_routed_at": 99.0, "chain_error": None}
    return VersionCheck(**{**base, **kw})


@pytest.mark.parametrize("check, held", [
    (_check(), True),
    (_check(version=0, store_manifest=None, gated=False, first_routed_at=None), True),  # the model dir
    (_check(store_manifest=None), False),
    (_check(candidate_manifest="x"), False),
    (_check(announced_manifest="x"), False),
    (_check(gated=False), False),
    (_check(first_routed_at=None), False),
    (_check(first_routed_at=105.0), False),  # served before any routing named it
    (_check(first_routed_at=100.5), True),  # within the clock slack
    (_check(chain_error="delta.fwd hash"), False),
])
def test_a_served_version_was_verified(check, held):
    assert J["unverified"]([check]).held is held


@pytest.mark.parametrize("store, topic, held", [
    (None, None, True),
    ({"revision": 4, "stable_version": 2, "canary_version": None, "canary_share": 0.0, "published": True},
     {"revision": 4, "stable_version": 2, "canary_version": None, "canary_share": 0.0}, True),
    ({"revision": 4, "stable_version": 2, "canary_version": None, "canary_share": 0.0, "published": False},
     {"revision": 4, "stable_version": 2, "canary_version": None, "canary_share": 0.0}, False),
    ({"revision": 5, "stable_version": 2, "canary_version": 3, "canary_share": 0.5, "published": True},
     {"revision": 4, "stable_version": 2, "canary_version": None, "canary_share": 0.0}, False),
    ({"revision": 4, "stable_version": 2, "canary_version": None, "canary_share": 0.0, "published": True}, None, False),
])
def test_the_store_and_the_last_routing_agree(store, topic, held):
    assert J["routing_agrees"](store, topic).held is held


def _row(at, status, latency=0.1):
    return {"at": at, "status": status, "latency_s": latency}


@pytest.mark.parametrize("rows, broken", [
    ([_row(10, 200), _row(20, 429)], 0),  # answered, or refused by design
    ([_row(10, 0)], 1),  # no answer, no restart
    ([_row(55, 0)], 0),  # inside serving's restart
    ([_row(45, 0, latency=5.5)], 0),  # sent before the kill, failed with it
    ([_row(80.5, 503)], 0),  # within the slack after ready
    ([_row(85, 503)], 1),
])
def test_users_answered_outside_serving_restarts(rows, broken):
    assert J["unanswered"](rows, [(50.0, 80.0)]).broken == broken


def test_malformed_records_must_each_be_dead_lettered():
    injected = [("t.gen", "k1"), ("t.gen", "k2")]
    assert J["malformed_dead_lettered"](injected, {("t.gen", "k1"), ("t.gen", "k2")}).held
    assert J["malformed_dead_lettered"](injected, {("t.gen", "k1"), ("t.other", "k2")}).broken == 1


@pytest.mark.parametrize("accept, promoted, held", [
    ({0: {"accept_rate": 0.3}, 2: {"accept_rate": 0.5}}, 2, True),
    ({0: {"accept_rate": 0.3}, 2: {"accept_rate": 0.3}}, 2, True),  # at least v0's
    ({0: {"accept_rate": 0.3}, 2: {"accept_rate": 0.2}}, 2, False),
    ({0: {"accept_rate": 0.3}}, None, False),  # nothing promoted: no learning shown
    ({0: {"accept_rate": 0.3}, 2: {"accept_rate": None}}, 2, False),  # never judged
])
def test_the_loop_still_learns(accept, promoted, held):
    assert J["still_learns"](accept, promoted).held is held


def test_orphans_break_it_by_count():
    assert J["orphans"]([]).held
    assert J["orphans"]([{"pid": 7, "cmd": "VLLM::EngineCore"}]).broken == 1

"""The canary's measurement (release/measure.py): which records count, how outcomes are paired,
and that a saved tally resumes exactly where it stopped."""

from __future__ import annotations

import random

from release import measure
from release.measure import Tally
from release.sequential import PairCount

T0 = 1_000.0


def episode(gid: str, version: int, t: float, signal: str, user: str = "", latency: float = 10.0,
            finish: str = "stop", tokens: int = 4) -> dict:
    return {"generation": {"generation_id": gid, "model_version": version, "created_at": t, "user_id": user or gid,
                           "latency_ms": latency, "finish_reason": finish, "completion_token_ids": [1] * tokens},
            "signal": signal, "rater_id": None}


def tally(**kw) -> Tally:
    return Tally(stable_version=0, canary_version=7, started_at=T0, **kw)


def test_only_the_two_versions_after_the_start_count_and_only_explicit_signals_are_outcomes():
    t = tally()
    t.add_episode(episode("old", 7, T0 - 1, "accept"))  # before the canary started
    t.add_episode(episode("other", 3, T0 + 1, "accept"))  # neither arm
    t.add_episode(episode("ig", 7, T0 + 2, "ignore"))
    t.add_episode(episode("ab", 7, T0 + 3, "reject", finish="abort"))
    t.add_episode(episode("ok", 0, T0 + 4, "edit"))
    canary, stable = t.arms["canary"].stats(), t.arms["stable"].stats()
    assert (canary.requests, canary.outcomes, canary.errors, canary.rejects) == (2, 1, 1, 1)
    assert (stable.requests, stable.outcomes, stable.accepts, stable.rejects) == (1, 1, 0, 0)


def test_pinned_evaluation_traffic_is_in_neither_arm():
    t = tally()
    pinned = episode("eval", 7, T0 + 1, "accept")
    pinned["generation"]["route"] = "pinned"  # a request that named flywheel@v7 itself
    t.add_episode(pinned)
    t.add_episode(episode("user", 7, T0 + 2, "accept"))
    assert t.arms["canary"].stats().requests == 1


def test_a_repeated_record_counts_once():
    t = tally()
    for _ in range(3):  # the episodes topic is at least once
        t.add_episode(episode("g1", 7, T0 + 1, "accept"))
        t.add_reward({"generation_id": "g1", "model_version": 7, "flags": ["repetition"], "generated_at": T0 + 1})
    arm = t.arms["canary"]
    assert (arm.requests, len(arm.outcomes), arm.rewards, arm.flagged) == (1, 1, 1, 1)


def test_only_flags_about_the_answer_count_against_a_version():
    # an abusive user the hash put on the canary's side is no sign of a worse model
    t = tally()
    flags = [["constant_user"], ["user_cap", "rate_anomaly"], ["long"], ["repetition", "constant_user"], []]
    for i, f in enumerate(flags):
        t.add_reward({"generation_id": f"g{i}", "model_version": 7, "flags": f, "generated_at": T0 + 1})
    assert (t.arms["canary"].rewards, t.arms["canary"].flagged) == (5, 2)


def test_rewards_of_generations_from_before_the_start_do_not_count():
    t = tally()
    t.add_reward({"generation_id": "g", "model_version": 0, "flags": ["x"], "generated_at": T0 - 5})
    assert t.arms["stable"].rewards == 0


def test_one_outcome_per_user_by_default():
    t = tally()
    for i in range(5):
        t.add_episode(episode(f"g{i}", 7, T0 + i, "accept" if i else "reject", user="heavy"))
    assert [o for _, o in t.arms["canary"].outcomes] == [False]  # the user's first outcome only
    assert t.arms["canary"].requests == 5 and t.arms["canary"].rejects == 1


def test_each_canary_outcome_is_paired_with_the_next_stable_one_in_time():
    t = tally()
    # stable outcomes at T0+1..T0+9 (accepts at odd seconds); canary at T0+2.5 and T0+7.5
    for s in range(1, 10):
        t.add_episode(episode(f"s{s}", 0, T0 + s, "accept" if s % 2 else "reject"))
    t.add_episode(episode("c2", 7, T0 + 7.5, "accept"))  # arrives first, is later in time
    t.add_episode(episode("c1", 7, T0 + 2.5, "accept"))
    t.add_episode(episode("c3", 7, T0 + 20, "reject"))  # no stable outcome after it yet: waits
    # c1 pairs with s3 (accept: concordant), c2 with s8 (reject: canary wins)
    assert t.pairs() == PairCount(pairs=2, wins=1, losses=0)


def test_pairing_never_looks_at_the_outcomes():
    # equal times: the order is arrival, not the outcome (an order by outcome would pair accepts
    # with accepts and hide every difference)
    t = tally()
    for i, sig in enumerate(["reject", "accept", "reject", "accept"]):
        t.add_episode(episode(f"s{i}", 0, T0 + 1, sig))
        t.add_episode(episode(f"c{i}", 7, T0 + 1, "accept" if sig == "reject" else "reject"))
    assert t.pairs() == PairCount(pairs=4, wins=2, losses=2)


def test_a_saved_tally_resumes_exactly(monkeypatch):
    monkeypatch.setattr(measure, "DEDUPE_IDS", 50)
    rnd = random.Random(3)
    t = tally(outcomes_per_user=2)
    for i in range(200):
        t.add_episode(episode(f"g{i}", rnd.choice([0, 7]), T0 + rnd.random() * 100,
                              rnd.choice(["accept", "reject", "ignore"]), user=f"u{i % 30}"))
    t.offsets = {"episodes": {0: 12, 1: 9}}
    back = Tally.from_dict(t.to_dict())
    assert back.to_dict() == t.to_dict() and back.pairs() == t.pairs()
    # the dedupe window is bounded, and the restored one remembers the same ids
    assert len(back.seen_episodes) == 50
    back.add_episode(episode("g199", 7, T0 + 50, "accept"))
    assert back.arms["canary"].requests == t.arms["canary"].requests


def test_latencies_are_a_bounded_sample(monkeypatch):
    monkeypatch.setattr(measure, "LATENCY_SAMPLE", 10)
    t = tally()
    for i in range(100):
        t.add_episode(episode(f"g{i}", 0, T0 + i, "ignore", latency=float(i)))
    assert t.arms["stable"].latencies_ms == [float(i) for i in range(90, 100)]

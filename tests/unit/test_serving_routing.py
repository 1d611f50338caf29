"""Which user gets which version, and the order engine slots change in to follow a release."""

from __future__ import annotations

import pytest

from serving.arms import split_salt
from serving.routing import Routing, Step, Want, arm_of, bucket, canary_unservable, plan

USERS = [f"user-{i}" for i in range(4000)]


def test_the_canary_share_is_met_and_each_user_keeps_their_arm():
    at_10 = {u for u in USERS if arm_of(u, 0.10) == "canary"}
    assert 0.08 < len(at_10) / len(USERS) < 0.12
    assert at_10 == {u for u in USERS if arm_of(u, 0.10) == "canary"}  # deterministic
    at_50 = {u for u in USERS if arm_of(u, 0.50) == "canary"}
    assert at_10 < at_50  # raising the share only moves users from stable to canary
    assert not any(arm_of(u, 0.0) == "canary" for u in USERS)
    assert all(arm_of(u, 1.0) == "canary" for u in USERS)
    assert all(0.0 <= bucket(u) < 1.0 for u in USERS[:100])


def test_each_canary_draws_a_fresh_split_and_keeps_it_for_its_whole_run():
    """The release record's salt picks the split: without one, the same users were the canary arm
    in every canary (an abusive user landed on the canary side in five seeds of five), so one
    unlucky split biased every verdict the same way."""
    import hashlib

    # no salt: the hash of every record before salts existed, so an old record routes as it did
    old = int.from_bytes(hashlib.sha256(b"flywheel-canary\0user-1").digest()[:8], "big") / 2**64
    assert bucket("user-1") == bucket("user-1", "") == old
    first = {u for u in USERS if arm_of(u, 0.10, "flywheel/v5/aa") == "canary"}
    second = {u for u in USERS if arm_of(u, 0.10, "flywheel/v6/bb") == "canary"}
    # one canary keeps each user on one side: the same salt gives the same split, every time
    assert first == {u for u in USERS if arm_of(u, 0.10, "flywheel/v5/aa") == "canary"}
    assert 0.08 < len(first) / len(USERS) < 0.12 and 0.08 < len(second) / len(USERS) < 0.12
    # another canary draws again: independent splits share ~1% of users (10% of 10%), not all 10%
    assert len(first & second) / len(USERS) < 0.02
    # within one canary, raising the share still only moves users from stable to canary
    assert first < {u for u in USERS if arm_of(u, 0.5, "flywheel/v5/aa") == "canary"}



def test_the_split_is_keyed_by_the_routing_secret_not_by_the_topic_alone():
    """The releases topic carries the canary salt; the split is by ``HMAC(routing_secret, salt)``
    (serving/arms.py), so reading the topic, or knowing the canary salt rule
    (``deployment/vN/manifest[:16]``), no longer tells anyone a user's arm."""
    topic_salt = "flywheel/v5/0123456789abcdef"
    secret = "a-routing-secret-of-64-hex-digits-in-production"
    keyed = split_salt(secret, topic_salt)
    assert keyed not in (topic_salt, "") and topic_salt not in keyed
    by_topic = {u for u in USERS if arm_of(u, 0.5, topic_salt) == "canary"}
    by_secret = {u for u in USERS if arm_of(u, 0.5, keyed) == "canary"}
    # computed from the topic alone the arm is a coin flip: about half the users are guessed wrong
    assert 0.45 < len(by_topic ^ by_secret) / len(USERS) < 0.55
    assert 0.45 < len(by_secret) / len(USERS) < 0.55  # and the share is still met
    # serving and the controller derive the same salt from the same two strings; another secret
    # or another canary gives another split
    assert split_salt(secret, topic_salt) == keyed
    assert split_salt("another-secret-of-sixteen+", topic_salt) != keyed
    assert split_salt(secret, "flywheel/v6/0123456789abcdef") != keyed
    assert split_salt("", topic_salt) == topic_salt  # no secret (no API keys): the topic's salt, as before


# (what slot i holds, routing now, release wanted) -> steps
CASES = {
    "first canary loads into the idle slot, then takes its share": (
        [3, 3], Routing(0), Want(3, 5, 0.1),
        [Step(Routing(0), (1, 5)), Step(Routing(0, 1, 0.1))]),
    "promotion relabels the canary's slot: nothing reloads": (
        [3, 5], Routing(0, 1, 0.1), Want(5),
        [Step(Routing(1))]),
    "rollback just stops routing to the canary": (
        [3, 5], Routing(0, 1, 0.1), Want(3),
        [Step(Routing(0))]),
    "a new stable with no canary loads into the idle slot, then everyone moves": (
        [3, 3], Routing(0), Want(4),
        [Step(Routing(0), (1, 4)), Step(Routing(1))]),
    "a canary replaced by a newer one reloads in place": (
        [3, 5], Routing(0, 1, 0.1), Want(3, 6, 0.1),
        [Step(Routing(0, 1, 0.1), (1, 6)), Step(Routing(0, 1, 0.1))]),
    "promote and start the next canary: stable moves first, then the old slot loads": (
        [3, 5], Routing(0, 1, 0.1), Want(5, 6, 0.2),
        [Step(Routing(1), (0, 6)), Step(Routing(1, 0, 0.2))]),
    "both versions new: each slot reloads in place under its own route": (
        [3, 5], Routing(0, 1, 0.1), Want(7, 8, 0.1),
        [Step(Routing(0, 1, 0.1), (0, 7)), Step(Routing(0, 1, 0.1), (1, 8)), Step(Routing(0, 1, 0.1))]),
    "an idle slot holding the wanted canary serves it at once": (
        [3, 5], Routing(0), Want(3, 5, 0.3),
        [Step(Routing(0, 1, 0.3))]),
    "the same release again changes nothing": (
        [3, 5], Routing(0, 1, 0.1), Want(3, 5, 0.1),
        [Step(Routing(0, 1, 0.1))]),
    "a share change alone is a routing change": (
        [3, 5], Routing(0, 1, 0.1), Want(3, 5, 0.5),
        [Step(Routing(0, 1, 0.5))]),
    "a new canary's salt comes with its route": (
        [3, 3], Routing(0), Want(3, 5, 0.1, "d/v5"),
        [Step(Routing(0), (1, 5)), Step(Routing(0, 1, 0.1, "d/v5"))]),
    "a salt change alone is a routing change": (
        [3, 5], Routing(0, 1, 0.1, "d/v5"), Want(3, 5, 0.1, "d/v5'"),
        [Step(Routing(0, 1, 0.1, "d/v5'"))]),
    "no canary, no salt: every user is on stable whatever the record says": (
        [3, 5], Routing(0, 1, 0.1, "d/v5"), Want(3, None, 0.0, "left over"),
        [Step(Routing(0))]),
    "one engine: a new stable reloads in place": (
        [3], Routing(0), Want(4),
        [Step(Routing(0), (0, 4)), Step(Routing(0))]),
    "new stable and canary from one idle-and-busy pair: idle first, stable moves, then the other": (
        [3, 9], Routing(0), Want(7, 8, 0.1),
        [Step(Routing(0), (1, 7)), Step(Routing(1), (0, 8)), Step(Routing(1, 0, 0.1))]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_plan(name):
    held, now, want, expected = CASES[name]
    steps = plan(held, now, want)
    assert steps == expected
    # whatever the steps, no route ever points at a slot while it loads another version than the
    # one that route is to serve at the end
    final = steps[-1].routing
    for step in steps:
        if step.load is not None:
            slot, _version = step.load
            role = step.routing.role_of(slot)
            assert role is None or final.role_of(slot) == role


def test_one_engine_cannot_serve_a_canary():
    assert canary_unservable([3], Want(3, 5, 0.1))
    assert not canary_unservable([3, 3], Want(3, 5, 0.1)) and not canary_unservable([3], Want(4))
    assert plan([3], Routing(0), Want(3, 5, 0.1)) == [Step(Routing(0))]

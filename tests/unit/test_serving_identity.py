"""API keys, user pseudonyms and the per-user token bucket."""

from __future__ import annotations

import hashlib
import hmac
import shutil
import subprocess

import pytest

from serving.identity import (
    Owner,
    RateLimited,
    RateLimiter,
    RateLimits,
    bearer_key,
    key_allowed,
    key_id,
    owned_response_id,
    owner_of,
    pseudonymise,
    raw_user,
    retry_after_header,
)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


SALT = "a long random deployment secret"


def test_key_id_names_a_key_without_holding_it():
    key = "sk-live-0123456789abcdef"
    kid = key_id(SALT, key)
    assert kid == key_id(SALT, key) and kid.startswith("key-") and len(kid) == 16 and key not in kid
    assert key_id(SALT, "sk-live-0123456789abcdeg") != kid and key_id(SALT, None) is None
    # what flywheel/apikeys.py tells an operator to compute to find a key's id
    assert kid == "key-" + hmac.new(SALT.encode(), b"api-key:" + key.encode(), hashlib.sha256).hexdigest()[:12]


def test_a_published_key_id_does_not_give_away_a_guessable_key():
    """The id is in generation records, the episode archive, metrics labels and the start-up log.
    A plain hash of a short key is found by hashing guesses; keyed with the deployment's secret,
    a guess cannot be checked without it. Stable for one secret (every replica, every restart)."""
    key = "sk-test"
    kid = key_id(SALT, key)
    assert kid != "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]
    assert key_id("another deployment", key) != kid
    # and not the pseudonym serving records for a request with this key and no user (same salt)
    assert pseudonymise(SALT, key)[:12] != kid.removeprefix("key-")


@pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl command here")
def test_the_documented_command_finds_a_key_id():
    from flywheel import apikeys

    command = next(line.strip() for line in apikeys.__doc__.splitlines() if "openssl dgst" in line)
    key = "sk-live-0123456789abcdef"
    done = subprocess.run(["bash", "-c", command], env={"KEY": key, "SALT": SALT, "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, check=True)
    assert done.stdout.strip() == key_id(SALT, key)


def test_pseudonym_is_stable_salted_and_not_the_raw_id():
    a = pseudonymise("salt-1", "alice@example.com")
    assert a == pseudonymise("salt-1", "alice@example.com")
    assert a != pseudonymise("salt-2", "alice@example.com")
    assert a != pseudonymise("salt-1", "bob@example.com")
    assert len(a) == 32 and "alice" not in a
    int(a, 16)  # hex


@pytest.mark.parametrize(
    "header, key",
    [("Bearer sk-1", "sk-1"), ("bearer  sk-1 ", "sk-1"), ("Basic abc", None), ("Bearer", None),
     ("", None), (None, None)],
)
def test_bearer_key(header, key):
    assert bearer_key(header) == key


@pytest.mark.parametrize(
    "key, keys, anonymous, ok",
    [("a", ("a", "b"), False, True), ("c", ("a", "b"), False, False), (None, ("a",), True, False),
     (None, (), True, True), (None, (), False, False), ("x", (), False, False),
     # non-ASCII, as a header's bytes decode: hmac.compare_digest raises TypeError on such a str
     ("sk-t\xc3\xa9st", ("sk-test",), False, False), ("sk-t\u00e9st", ("sk-t\u00e9st", "b"), False, True),
     ("a", ("\u043a\u043b\u044e\u0447", "a"), False, True)],
)
def test_key_allowed(key, keys, anonymous, ok):
    assert key_allowed(key, keys, anonymous) is ok


@pytest.mark.parametrize(
    "body, header, key, want",
    [("u1", "h1", "k", "u1"), (None, "h1", "k", "h1"), (None, None, "k", "k"), (None, None, None, "anonymous")],
)
def test_raw_user_precedence(body, header, key, want):
    assert raw_user(body, header, key) == want


def test_bucket_allows_burst_then_refills_at_rate():
    clock = Clock()
    rl = RateLimiter(per_minute=60, burst=3, clock=clock)  # 1 token per second
    assert [rl.take("u") for _ in range(3)] == [0.0, 0.0, 0.0]
    wait = rl.take("u")
    assert wait == pytest.approx(1.0)
    clock.t += 0.5
    assert rl.take("u") == pytest.approx(0.5)  # half a token so far
    clock.t += 0.5
    assert rl.take("u") == 0.0
    assert rl.take("other") == 0.0  # users have their own buckets


def test_bucket_never_exceeds_burst_and_forgets_idle_users():
    clock = Clock()
    rl = RateLimiter(per_minute=600, burst=2, clock=clock)
    rl.take("a")
    clock.t += 3600
    assert [rl.take("b"), rl.take("b"), rl.take("b") > 0] == [0.0, 0.0, True]
    assert len(rl) == 1  # "a" was idle long enough to be full again, so it was dropped


def test_users_rotated_on_one_key_meet_the_key_bucket():
    """Each user has a bucket and so does each API key: a client that names a new ``user`` per
    request (10 of 10 went through with a user burst of 5) meets its key's bucket. A request takes
    a token from both buckets or from neither."""
    clock = Clock()
    # users: 2 at once, then one a minute; keys: 3 at once, then one a second
    limits = RateLimits(RateLimiter(per_minute=1, burst=2, clock=clock),
                        RateLimiter(per_minute=60, burst=3, clock=clock))
    got = [limits.take(f"u{i}", "key-1") for i in range(5)]
    assert got == [None] * 3 + [RateLimited("key", pytest.approx(1.0))] * 2
    assert limits.take("u0", "key-2") is None  # another key has its own bucket
    clock.t += 3.0  # key-1 full again; a user gets a twentieth of a token back
    # u3 was refused by the key, so it kept its user tokens: two requests, then its own bucket
    assert limits.take("u3", "key-1") is None and limits.take("u3", "key-1") is None
    third = limits.take("u3", "key-1")
    assert third is not None and third.scope == "user" and third.wait_s > 50
    assert limits.take("u4", "key-1") is None  # u3's refusal spent no token of the key
    assert limits.take("u5", "key-1") == RateLimited("key", pytest.approx(1.0))
    assert limits.take("u9", None) is None  # no key: one bucket shared by anonymous traffic


def test_a_users_bucket_belongs_to_the_key_that_names_them():
    """Key B spending user "victim"'s bucket got key A's "victim" a 429: one product throttled
    another's users. Each key's "victim" has a bucket of its own; the key's bucket is unchanged."""
    clock = Clock()
    limits = RateLimits(RateLimiter(per_minute=1, burst=2, clock=clock),
                        RateLimiter(per_minute=60, burst=100, clock=clock))
    assert [limits.take("victim", "key-b") for _ in range(2)] == [None, None]
    refused = limits.take("victim", "key-b")
    assert refused is not None and refused.scope == "user"
    assert [limits.take("victim", "key-a") for _ in range(2)] == [None, None]
    assert limits.take("victim", "key-a") == refused  # the same limit, met on its own
    assert limits.take("victim", None) is None  # anonymous traffic: a bucket of its own too


@pytest.mark.parametrize("wait, header", [(0.01, "1"), (1.0, "1"), (1.2, "2"), (30.0, "30")])
def test_retry_after_rounds_up_to_whole_seconds(wait, header):
    assert retry_after_header(wait) == header


# -- whose answer a generation id is (feedback belongs to the answer's user) ------------------
OWNED = owned_response_id("salt-of-the-deployment", "cmpl-" + "0123456789abcdef" * 2, "alice-pseudonym")


@pytest.mark.parametrize("salt, generation_id, user, owner", [
    ("salt-of-the-deployment", OWNED, "alice-pseudonym", Owner.SAME),
    ("salt-of-the-deployment", OWNED + "-2", "alice-pseudonym", Owner.SAME),  # a choice of n > 1
    ("salt-of-the-deployment", OWNED, "bob-pseudonym", Owner.OTHER),
    ("salt-of-the-deployment", OWNED + "-2", "bob-pseudonym", Owner.OTHER),
    ("another-salt", OWNED, "alice-pseudonym", Owner.OTHER),  # a tag no one without the salt can make
    ("salt-of-the-deployment", OWNED[:-1] + ("0" if OWNED[-1] != "0" else "1"), "alice-pseudonym", Owner.OTHER),
    ("salt-of-the-deployment", "cmpl-" + "0123456789abcdef" * 2, "alice-pseudonym", Owner.UNKNOWN),  # untagged
    ("salt-of-the-deployment", "no-such-generation", "alice-pseudonym", Owner.UNKNOWN),
    ("salt-of-the-deployment", OWNED + "x", "alice-pseudonym", Owner.UNKNOWN),
])
def test_owner_of_a_generation_id(salt, generation_id, user, owner):
    assert owner_of(salt, generation_id, user) is owner


def test_owned_ids_stay_within_the_contracts_limit():
    base = "chatcmpl-" + "f" * 32
    gid = owned_response_id("s" * 64, base, "u" * 32) + "-7"
    assert gid.startswith(base) and len(gid) <= 128 and owner_of("s" * 64, gid, "u" * 32) is Owner.SAME

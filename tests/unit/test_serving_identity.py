"""API keys, user pseudonyms and the per-user token bucket."""

from __future__ import annotations

import pytest

from serving.identity import (
    RateLimiter,
    bearer_key,
    key_allowed,
    pseudonymise,
    raw_user,
    retry_after_header,
)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


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


@pytest.mark.parametrize("wait, header", [(0.01, "1"), (1.0, "1"), (1.2, "2"), (30.0, "30")])
def test_retry_after_rounds_up_to_whole_seconds(wait, header):
    assert retry_after_header(wait) == header

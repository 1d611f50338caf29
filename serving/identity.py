"""Who is calling: API-key checks, user pseudonyms and the rate limits (pure logic).

The recorded ``user_id`` is a pseudonym, ``HMAC-SHA256(salt, raw)`` truncated to 32 hex chars:
stable per user (so reward guards can count per user) yet not reversible without the salt, so
the topics never carry the product's raw user ids. An API key is recorded by its id, an HMAC
under the same salt (flywheel/apikeys.py), never by itself.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import math
import re
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Literal

from flywheel import apikeys

PSEUDONYM_HEX = 32


def pseudonymise(salt: str, raw: str) -> str:
    return hmac.new(salt.encode(), raw.encode(), hashlib.sha256).hexdigest()[:PSEUDONYM_HEX]


#: Hex characters of the owner tag a response id ends with (:func:`owned_response_id`): 64 bits,
#: so a forged tag is right once in 1.8e19 tries, each one a request to the API.
OWNER_TAG_HEX = 16
#: A response id serving made with an owner tag, then the choice suffix of ``n > 1`` (``-<i>``).
_OWNED_ID = re.compile(rf"((?:chatcmpl|cmpl)-[0-9a-f]{{32}})([0-9a-f]{{{OWNER_TAG_HEX}}})(?:-\d{{1,6}})?")


class Owner(enum.Enum):
    """Whose answer a generation id is, as far as the id tells, against the user feedback names."""

    #: The id's owner tag was made for this user.
    SAME = "same"
    #: The id's owner tag was made for another user.
    OTHER = "other"
    #: The id carries no owner tag (made before tags, or not by serving): no one can tell.
    UNKNOWN = "unknown"


def _owner_tag(salt: str, base: str, user_id: str) -> str:
    # keyed by the pseudonym salt, which every serving replica shares: any replica checks the tag
    # another made, with no state to share, and no one without the salt can make one
    msg = b"flywheel-generation-owner\0" + base.encode() + b"\0" + user_id.encode()
    return hmac.new(salt.encode(), msg, hashlib.sha256).hexdigest()[:OWNER_TAG_HEX]


def owned_response_id(salt: str, base: str, user_id: str) -> str:
    """``base`` (``cmpl-<32 hex>``) with the tag of the user pseudonym ``user_id`` appended: the id
    itself says whose answer it is, so feedback naming another user is caught by whichever replica
    takes it, after a restart too (a map of ids to users would be per process and lost)."""
    return base + _owner_tag(salt, base, user_id)


def owner_of(salt: str, generation_id: str, user_id: str) -> Owner:
    """Whether ``generation_id`` (a response id, or one of its choices ``<id>-<i>``) was made for
    the user pseudonym ``user_id``."""
    m = _OWNED_ID.fullmatch(generation_id)
    if m is None:
        return Owner.UNKNOWN
    same = hmac.compare_digest(m.group(2), _owner_tag(salt, m.group(1), user_id))
    return Owner.SAME if same else Owner.OTHER


def bearer_key(authorization: str | None) -> str | None:
    """The key from ``Authorization: Bearer <key>`` (what the openai client sends), else None."""
    if not authorization:
        return None
    scheme, _, key = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        return None
    return key.strip()


def key_id(salt: str, key: str | None) -> str | None:
    """The name a product key is accounted under in records, metrics and ``flywheel usage``: an
    HMAC of it under the deployment's secret ``salt`` (flywheel/apikeys.py, which says how an
    operator finds a key's id), so the key itself is never written anywhere, nor anything a
    guess at it can be checked against. None without a key."""
    return None if key is None else apikeys.key_id(salt, key)


def key_allowed(key: str | None, api_keys: tuple[str, ...], allow_anonymous: bool) -> bool:
    if not api_keys:
        return allow_anonymous
    if key is None:
        return False
    # SHA-256 digests compared, as the release API does (release/auth.py): compare_digest raises
    # TypeError on a str with non-ASCII characters (a header's bytes beyond ASCII arrive as such,
    # and got a 500), and fixed-length digests keep a key's length out of the timing. Every key is
    # compared, so the time taken does not say which one matched.
    presented = _digest(key)
    found = False
    for k in api_keys:
        found |= hmac.compare_digest(presented, _digest(k))
    return found


def _digest(key: str) -> bytes:
    # surrogatepass: a key read from the environment may hold undecodable bytes as surrogates
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def raw_user(body_user: str | None, header_user: str | None, key: str | None) -> str:
    """The OpenAI ``user`` field wins, then ``X-Flywheel-User``, then the key, then anonymous."""
    for candidate in (body_user, header_user, key):
        if candidate:
            return candidate
    return "anonymous"


@dataclass
class _Bucket:
    tokens: float
    stamp: float


class RateLimiter:
    """Token bucket per name (a user on a key, a key): ``burst`` requests at once, refilled at
    ``per_minute / 60`` per s.

    ``take`` returns 0.0 when the request may go ahead, else the seconds until a token is due
    (the ``Retry-After`` value). Idle buckets are forgotten once full again, so memory follows
    the number of recently active users.
    """

    def __init__(
        self, per_minute: float, burst: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.rate = per_minute / 60.0
        self.burst = float(burst)
        self.clock = clock
        self._buckets: dict[Hashable, _Bucket] = {}
        self._lock = threading.Lock()
        self._last_sweep = clock()

    def take(self, user: Hashable) -> float:
        now = self.clock()
        with self._lock:
            b = self._buckets.get(user)
            if b is None:
                b = self._buckets[user] = _Bucket(self.burst, now)
            b.tokens = min(self.burst, b.tokens + (now - b.stamp) * self.rate)
            b.stamp = now
            if b.tokens >= 1.0:
                b.tokens -= 1.0
                wait = 0.0
            else:
                wait = (1.0 - b.tokens) / self.rate
            self._sweep(now)
        return wait

    def give_back(self, user: Hashable) -> None:
        """Return a token :meth:`take` just took (the request was refused by another limit)."""
        with self._lock:
            b = self._buckets.get(user)
            if b is not None:
                b.tokens = min(self.burst, b.tokens + 1.0)

    def _sweep(self, now: float) -> None:
        full_after = self.burst / self.rate
        if now - self._last_sweep < full_after:
            return
        self._last_sweep = now
        stale = [u for u, b in self._buckets.items() if now - b.stamp >= full_after]
        for u in stale:
            del self._buckets[u]

    def __len__(self) -> int:
        return len(self._buckets)


@dataclass(frozen=True)
class RateLimited:
    """A request refused: which bucket was empty, and the seconds until it has a token."""

    scope: Literal["user", "key"]
    wait_s: float


class RateLimits:
    """A bucket per user of each API key and a bucket per API key; a request takes a token from
    both or neither.

    The user is whoever the client names (``user``, ``X-Flywheel-User``), so on its own the user
    limit multiplies with every name a client makes up; the key's bucket bounds what one key gets,
    however many users it speaks for. Sized much larger than a user's: one product key may carry
    every user of a product.

    A user's bucket belongs to the key that names them: two products (two keys) may both have a
    user "alice", and one product's traffic must not spend the other's (a user bucket shared
    across keys let key B throttle key A's users by naming them). The buckets live in this
    process: each serving replica limits on its own, so behind a balancer over N replicas a user
    may get up to N times the limit.
    """

    def __init__(self, per_user: RateLimiter, per_key: RateLimiter) -> None:
        self.per_user, self.per_key = per_user, per_key

    def take(self, user_id: str, key: str | None) -> RateLimited | None:
        key = key or ""  # (no key: one bucket for all anonymous traffic, and its users' among it)
        user = (key, user_id)
        wait = self.per_user.take(user)
        if wait > 0:
            return RateLimited("user", wait)
        wait = self.per_key.take(key)
        if wait > 0:
            self.per_user.give_back(user)  # the user did not get this request either
            return RateLimited("key", wait)
        return None


def retry_after_header(wait_s: float) -> str:
    return str(max(1, math.ceil(wait_s)))

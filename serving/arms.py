"""Which arm of a canary a user is in: the hash serving routes by.

:func:`arm_of` sends a user to the canary when a hash of the split's salt and their pseudonymous
id, read as a number in [0, 1), is below the canary's share (sha256, not Python's salted
``hash``: the same in every process). The salt is :func:`split_salt`: an HMAC under
``routing_secret``, a secret only serving holds, of the canary salt the
release record carries (``ReleaseEvent.canary_salt``, a fresh one per canary). The releases topic
is readable by more than serving, and the canary salt alone let anyone who knew a pseudonym (and
the pseudonym salt, published in the demo's old default) compute a user's arm offline; keyed by a
secret that never rides on a topic, the split is known only where the secret is. The release
controller needs no arm of a user: each generation record names the version that answered, and its
sample-ratio check counts users per version.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Literal

Arm = Literal["stable", "canary"]


def split_salt(routing_secret: str, canary_salt: str) -> str:
    """The salt users are split by in a canary whose release record carries ``canary_salt``.
    Without a secret (a deployment without API keys: serving refuses to start without one beside
    keys) it is ``canary_salt`` itself, as before the secret existed."""
    if not routing_secret:
        return canary_salt
    msg = b"flywheel-canary-split\0" + canary_salt.encode("utf-8", "surrogatepass")
    return hmac.new(routing_secret.encode("utf-8", "surrogatepass"), msg, hashlib.sha256).hexdigest()


def bucket(user_id: str, salt: str = "") -> float:
    """The user's fixed point in [0, 1) for the split salted ``salt``."""
    # the salt ends with a NUL that no salt holds, so ("a", "b\0c") and ("a\0b", "c") differ
    key = (salt.encode("utf-8", "surrogatepass") + b"\0" if salt else b"") + user_id.encode("utf-8", "surrogatepass")
    digest = hashlib.sha256(b"flywheel-canary\0" + key).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def arm_of(user_id: str, canary_share: float, salt: str = "") -> Arm:
    """The arm of ``user_id`` (a pseudonym) at ``canary_share``, split by ``salt`` (:func:`split_salt`)."""
    return "canary" if bucket(user_id, salt) < canary_share else "stable"

"""Who may use the release API, and as what: bearer tokens with a role each.

Tokens come from ``release.tokens`` (``FLYWHEEL_RELEASE_TOKENS``), one ``name:role:token`` entry per
person or tool. Roles are ordered, ``viewer < approver < admin``, and a role may do whatever a lower
one may: a viewer reads, an approver also approves, rejects and rolls back, an admin also pauses and
resumes the pipeline. The name is what the audit log records as the actor of an action.

:func:`parse_tokens` runs once at start (a malformed entry stops the process with a
:class:`~flywheel.settings.SettingsError` naming the entry, never the secret), and the app keeps the
result on ``app.state.release_tokens``; :func:`require` is the FastAPI dependency every guarded
route declares.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from enum import IntEnum

from fastapi import HTTPException, Request

from flywheel.settings import SettingsError

#: Where :func:`require` finds the token table on ``app.state``.
STATE_KEY = "release_tokens"


class Role(IntEnum):
    """Ordered: a higher role may do everything a lower one may."""

    VIEWER = 1
    APPROVER = 2
    ADMIN = 3

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, text: str) -> Role:
        try:
            return cls[text.strip().upper()]
        except KeyError:
            raise ValueError(f"unknown role {text!r}: use {', '.join(r.label for r in cls)}") from None


@dataclass(frozen=True)
class Principal:
    """The caller a token stands for."""

    name: str
    role: Role


class Tokens:
    """The token table. Only SHA-256 digests are kept: the lookup then compares fixed-length
    values, so neither a token's content nor its length shows in the comparison's timing."""

    def __init__(self, principals: Iterable[tuple[str, Principal]]) -> None:
        self._entries = [(_digest(token), who) for token, who in principals]

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, presented: str) -> Principal | None:
        """The principal ``presented`` belongs to, or None. Every entry is compared, whether or not
        an earlier one matched, so the time taken does not say which entry (if any) matched."""
        digest = _digest(presented)
        found: Principal | None = None
        for known, who in self._entries:
            if hmac.compare_digest(digest, known):
                found = who
        return found


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def parse_tokens(entries: Iterable[str]) -> Tokens:
    """``name:role:token`` entries -> :class:`Tokens`; :class:`SettingsError` for a malformed entry,
    an unknown role or a token given twice. The token is everything after the second colon (so it
    may hold colons); messages name the entry's position and name, never its token."""
    seen: dict[str, str] = {}
    out: list[tuple[str, Principal]] = []
    for n, entry in enumerate(entries, 1):
        token, who = _parse_entry(n, entry)
        if token in seen:
            # one token, two names: the audit log could not say who acted
            raise SettingsError(f"release.tokens entry {n} ({who.name}) reuses the token of {seen[token]}: "
                                "give every person or tool a token of its own")
        seen[token] = who.name
        out.append((token, who))
    return Tokens(out)


def _parse_entry(n: int, entry: str) -> tuple[str, Principal]:
    parts = entry.strip().split(":", 2)
    if len(parts) != 3 or not all(parts):
        raise SettingsError(f"release.tokens entry {n} is not name:role:token (three non-empty parts "
                            "separated by colons)")
    name, role_text, token = parts
    if any(ch.isspace() for ch in name + token):
        # a bearer header cannot carry such a token, and a name with spaces reads badly in the audit log
        raise SettingsError(f"release.tokens entry {n} ({name.strip()}): name and token must not contain spaces")
    try:
        role = Role.parse(role_text)
    except ValueError as exc:
        raise SettingsError(f"release.tokens entry {n} ({name}): {exc}") from None
    return token, Principal(name, role)


def bearer(request: Request) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header (scheme case-insensitive), or None."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def _unauthorized(message: str) -> HTTPException:
    return HTTPException(401, message, headers={"WWW-Authenticate": "Bearer"})


def require(role: Role | str) -> Callable[[Request], Awaitable[str]]:
    """A FastAPI dependency admitting callers with ``role`` or a higher one; it gives the caller's
    name. 401 (with ``WWW-Authenticate: Bearer``) without a valid token, 403 naming the role needed
    when the caller's is lower."""
    needed = role if isinstance(role, Role) else Role.parse(role)

    async def caller(request: Request) -> str:  # no I/O: no need for a worker thread
        tokens: Tokens = getattr(request.app.state, STATE_KEY)
        presented = bearer(request)
        if not len(tokens):
            raise _unauthorized("no API tokens are configured on this release controller "
                                "(release.tokens, FLYWHEEL_RELEASE_TOKENS): every route answers 401")
        if presented is None:
            raise _unauthorized("missing bearer token: send the header 'Authorization: Bearer <token>'")
        who = tokens.lookup(presented)
        if who is None:
            raise _unauthorized("invalid token")
        if who.role < needed:
            raise HTTPException(403, f"this needs the {needed.label} role; {who.name} is a {who.role.label}")
        return who.name

    caller.__name__ = f"require_{needed.label}"
    return caller


__all__ = ["STATE_KEY", "Principal", "Role", "Tokens", "bearer", "parse_tokens", "require"]

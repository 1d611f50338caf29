"""A database URL's secrets, read one way for every use: what the start-up log shows
(:func:`redact_database_url`), what error messages get masked (:func:`url_secrets`), and which
URLs are refused because the driver would show their password (:func:`database_url_refusal`).

All three start from :func:`split_url`, so they cannot disagree on where the password ends: the
query starts at the first ``?``, and the host at the last ``@`` before it (a password may hold an
unescaped ``/`` or ``@``, and must not leak through a split at it). Any ``@`` after that one, or
a character a URL must escape before it, is what :func:`database_url_refusal` refuses.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import unquote, unquote_plus

#: A libpq ``key=value`` connection string's password (``password=x``, ``sslpassword = 'x y'``).
_CONNINFO_PASSWORD = re.compile(r"""(?i)\b(\w*password)\s*=\s*(?:'(?:[^'\\]|\\.)*'|\S+)""")

#: What a URL's user name and password may hold unencoded (RFC 3986 ``userinfo``).
_USERINFO = re.compile(r"(?:[A-Za-z0-9._~!$&'()*+,;=:-]|%[0-9A-Fa-f]{2})*")


@dataclass(frozen=True)
class UrlParts:
    """``<scheme>://<userinfo>@<hostpath>?<query>``; ``at`` and ``q`` are the separators as
    written ("" when absent), so the parts joined give the URL back."""

    scheme: str
    userinfo: str
    at: str
    hostpath: str
    q: str
    query: str

    @property
    def password(self) -> str:
        """The password as written (percent-encoded), "" when there is none."""
        return self.userinfo.split(":", 1)[1] if self.at and ":" in self.userinfo else ""


def split_url(url: str) -> UrlParts | None:
    """``url`` in its parts; None for a string with no ``://`` (a libpq ``key=value`` one)."""
    if "://" not in url:
        return None
    scheme, _, rest = url.partition("://")
    before, q, query = rest.partition("?")
    userinfo, at, hostpath = before.rpartition("@")
    return UrlParts(scheme, userinfo, at, hostpath, q, query)


def redact_database_url(url: str) -> str:
    """``url`` with every password it holds replaced by ``***``: the userinfo's
    (``user:pw@host``; the user stays), a query parameter whose name ends in ``password``
    (libpq reads ``?password=`` and ``?sslpassword=``), or a libpq ``key=value`` string's."""
    parts = split_url(url)
    if parts is None:
        return _CONNINFO_PASSWORD.sub(r"\1=***", url)
    userinfo = parts.userinfo.split(":", 1)[0] + ":***" if parts.password else parts.userinfo
    params = "&".join(_redact_param(p) for p in parts.query.split("&")) if parts.q else ""
    return f"{parts.scheme}://{userinfo}{parts.at}{parts.hostpath}{parts.q}{params}"


def _redact_param(param: str) -> str:
    name, eq, _ = param.partition("=")
    return f"{name}=***" if eq and unquote_plus(name).lower().endswith("password") else param


def url_secrets(url: str) -> list[str]:
    """The password in a database URL's userinfo, as written and unescaped, longest first: what
    an error message must not show (flywheel/dberrors.py ``describe`` masks them)."""
    parts = split_url(url)
    password = parts.password if parts is not None else ""
    return sorted({password, unquote(password)} - {""}, key=len, reverse=True)


def database_url_refusal(url: str) -> str | None:
    """Why a PostgreSQL ``url`` would leak its password through the driver's errors, else None.

    libpq ends the user name and password at the first ``@``: a password holding one puts its
    tail in the host name, and the driver says so (``failed to resolve host '<tail>@db'``); a
    ``%`` that starts no escape is quoted with the whole password (``invalid percent-encoded
    token``). So the userinfo must be valid, and no ``@`` may follow it (one after a ``?`` in the
    password moves the host there). The reason quotes no part of the URL."""
    if not url.startswith(("postgresql://", "postgres://")):
        return None
    parts = split_url(url)
    assert parts is not None
    if _USERINFO.fullmatch(parts.userinfo) and "@" not in parts.hostpath + parts.query:
        return None
    return ("its user name or password holds a character a URL must percent-encode: write '@' as %40, '/' as "
            "%2F, '?' as %3F, '#' as %23, '%' as %25, a space as %20 (Python: urllib.parse.quote(password, "
            "safe='')), and an '@' after the host as %40")

"""What a process does about an error of its database: a pure judgement, table-tested.

A stage (and the release controller) must ride out its database misbehaving, not only going
away: a failover that leaves the connection on a read-only server, a full disk, a deadlock
with another replica, a serialization failure. :func:`classify` maps an error to what to do:

- :class:`Reconnect`: the connection is gone, its transaction's outcome may be unknown, or its
  session cannot write (read-only: a standby after a failover, or a session started while the
  database was read-only keeps that for its life). Open a new connection, then go on as after
  :class:`Retry`. Only the driver's connection errors without an SQLSTATE (psycopg's
  ``OperationalError`` and ``InterfaceError``, a store's own :class:`DatabaseLost`) and the
  SQLSTATEs and SQLite errors named below ask for it.
- :class:`LoginRefused` (a :class:`Reconnect`): the server refused the login (SQLSTATE class 28:
  a wrong password, a role that may not log in, no ``pg_hba.conf`` entry; libpq reports these at
  connect without an SQLSTATE, so its message decides). **The rule:** at start the process exits
  77 (EX_NOPERM, as for a refused Kafka login or release API token), naming the setting to fix
  and never the password; while running it logs it once and keeps reconnecting, as for any lost
  connection: a rotated password being rolled out reaches this process with its restart, and
  the database may take the new one before that.
- :class:`Retry`: the server refused this transaction and rolled it back; the connection works.
  Roll back, wait, and run the turn again from the stored state (a deadlock, a serialization
  failure, a full disk, a statement timeout, and every server error of a class nobody foresaw:
  retried, and named in the log, rather than ending the process).
- :class:`Conflict`: a constraint refused a write (SQLSTATE class 23, SQLite's CONSTRAINT). Code
  that expects one (a row that exists already) handles it; code that expects none waits it out
  like a :class:`Retry` (in the stream stages a conflict can only come from two replicas racing
  on one row, which a retry after reading the state again settles).
- :class:`Bug`: the statement or its data is wrong (SQLSTATE class 42, a syntax error or a
  missing table; 22, a data exception; 0A, not supported; psycopg's client-side
  ``ProgrammingError``, ``DataError`` and ``NotSupportedError``, a NUL byte in a text say; SQLite's
  ``SQLITE_ERROR`` and its ``ProgrammingError``, a closed connection). Waiting cannot fix code:
  it is raised, and the process stops (flywheel/stream/runner.py), rather than stalling for ever
  behind a log line that blames the database.

PostgreSQL errors are judged by SQLSTATE (its class, the first two characters, with a few
codes apart), SQLite's by their error name (``SQLITE_BUSY``...), falling back to the message for
errors raised without one. :func:`describe` names an error in one log line with its code and
message and no secret.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from flywheel.dburl import url_secrets  # noqa: F401 - where the stores and the controller take it


@dataclass(frozen=True)
class Reconnect:
    """Open a new connection before the next try. ``code``: SQLSTATE, SQLite's error name, or the
    exception's class when it has neither; ``kind``: what it is, in words."""

    code: str
    kind: str


@dataclass(frozen=True)
class Retry:
    """Roll back, wait, and try again on the same connection."""

    code: str
    kind: str


@dataclass(frozen=True)
class Conflict:
    """A constraint refused a write: expected by some code, a race or a bug elsewhere."""

    code: str
    kind: str


@dataclass(frozen=True)
class LoginRefused(Reconnect):
    """The server refused the login: exit 77 at start, reconnect while running (module docstring)."""


@dataclass(frozen=True)
class Bug:
    """The statement or its data is wrong: raise it, waiting cannot help."""

    code: str
    kind: str


DbOutcome = Reconnect | Retry | Conflict | Bug
_Judged = tuple[type[Reconnect] | type[Retry] | type[Conflict] | type[Bug], str]

#: PostgreSQL SQLSTATEs judged on their own, before their class.
_PG_CODES: dict[str, _Judged] = {
    "25006": (Reconnect, "read-only"),  # a standby, or a session begun read-only: a new one may write
    "25P03": (Reconnect, "idle in transaction timeout"),  # the server ended the session
    "57014": (Retry, "statement timeout or cancel"),  # the session lives on
    "40003": (Reconnect, "statement completion unknown"),
    "40P01": (Retry, "deadlock"),
    "40001": (Retry, "serialization failure"),
    "53100": (Retry, "disk full"),
    "53200": (Retry, "out of memory"),
    "53300": (Retry, "too many connections"),
    "55P03": (Retry, "lock not available"),
}

#: PostgreSQL SQLSTATE classes (the first two characters); any other class is a Retry.
_PG_CLASSES: dict[str, _Judged] = {
    "08": (Reconnect, "connection exception"),
    "25": (Reconnect, "invalid transaction state"),
    "57": (Reconnect, "operator intervention"),  # shutdown, crash, database dropped
    "40": (Retry, "transaction rollback"),
    "53": (Retry, "insufficient resources"),
    "54": (Retry, "program limit exceeded"),
    "55": (Retry, "object not in prerequisite state"),
    "58": (Retry, "system error"),
    "XX": (Retry, "internal error"),
    "23": (Conflict, "constraint violation"),
    "28": (LoginRefused, "login refused"),
    "42": (Bug, "syntax error or access rule violation"),
    "22": (Bug, "data exception"),
    "0A": (Bug, "feature not supported"),
}

#: libpq's messages for a refused login, which it raises at connect with no SQLSTATE (the
#: server's English; a server with other ``lc_messages`` is read as a lost connection).
_PG_LOGIN_MESSAGES: tuple[tuple[re.Pattern[str], str], ...] = tuple((re.compile(p), code) for p, code in (
    (r"password authentication failed", "28P01"), (r"no password supplied", "28P01"),
    (r"is not permitted to log in", "28000"), (r"no pg_hba\.conf entry", "28000"),
    (r"authentication failed for user", "28000"), (r'role "[^"]*" does not exist', "28000"),
))

#: SQLite primary result codes (the part of the extended name before any ``_`` suffix of it).
_SQLITE_NAMES: dict[str, _Judged] = {
    "SQLITE_BUSY": (Retry, "database is locked"),
    "SQLITE_LOCKED": (Retry, "database is locked"),
    "SQLITE_FULL": (Retry, "database or disk is full"),
    "SQLITE_IOERR": (Reconnect, "disk I/O error"),  # the file is opened afresh: its handles may be stale
    "SQLITE_READONLY": (Reconnect, "read-only database"),  # a file opened read-only stays so
    "SQLITE_CANTOPEN": (Reconnect, "unable to open database file"),
    "SQLITE_CONSTRAINT": (Conflict, "constraint violation"),
    "SQLITE_CORRUPT": (Retry, "database disk image is malformed"),
    "SQLITE_NOTADB": (Retry, "file is not a database"),
    "SQLITE_ERROR": (Bug, "SQL error or missing table"),
}

#: sqlite3's classes for a misuse of the module (a closed connection, a wrong parameter): bugs.
_SQLITE_BUG_CLASSES = frozenset({"ProgrammingError", "InterfaceError", "DataError", "NotSupportedError"})

#: SQLite's messages, for errors raised without an error name (by the module itself, or an
#: older Python): the first found in the message decides.
_SQLITE_MESSAGES: tuple[tuple[str, str], ...] = (
    ("database is locked", "SQLITE_BUSY"), ("database table is locked", "SQLITE_LOCKED"),
    ("database or disk is full", "SQLITE_FULL"), ("disk i/o error", "SQLITE_IOERR"),
    ("readonly database", "SQLITE_READONLY"), ("unable to open database", "SQLITE_CANTOPEN"),
    ("constraint failed", "SQLITE_CONSTRAINT"),
)


def classify_postgres(sqlstate: str | None, name: str = "", message: str = "", *,
                      connection: bool = True) -> DbOutcome:
    """A PostgreSQL error by its SQLSTATE. None: raised by the client, not the server; then
    ``connection`` says whether it is a connection error (psycopg's ``OperationalError`` or
    ``InterfaceError``: a connection that failed, broke or refused the login, by ``message``)
    or the client refusing the statement or its data (a :class:`Bug`)."""
    if not sqlstate:
        if not connection:
            return Bug(name or "no SQLSTATE", "statement or data refused by the driver")
        code = next((c for pattern, c in _PG_LOGIN_MESSAGES if pattern.search(message)), None)
        if code is not None:
            return LoginRefused(code, "login refused")
        return Reconnect(name or "no SQLSTATE", "connection lost or refused")
    found = _PG_CODES.get(sqlstate) or _PG_CLASSES.get(sqlstate[:2])
    if found is None:
        return Retry(sqlstate, name or "database error")
    outcome, kind = found
    return outcome(sqlstate, kind)


def classify_sqlite(errorname: str | None, message: str = "", error_class: str = "OperationalError") -> DbOutcome:
    """An SQLite error by its (extended) error name, ``SQLITE_IOERR_FSYNC`` say, or by its
    message when it has none; ``error_class``: sqlite3's class of it, whose misuse classes are
    bugs whatever the name."""
    if error_class in _SQLITE_BUG_CLASSES:
        return Bug(errorname or error_class, "misuse of the database module")
    name = errorname or next((n for text, n in _SQLITE_MESSAGES if text in message.lower()), None)
    if name is None:
        return Retry("SQLITE_ERROR", "database error")
    primary = next((p for p in _SQLITE_NAMES if name == p or name.startswith(p + "_")), None)
    if primary is None:
        return Retry(name, "database error")
    outcome, kind = _SQLITE_NAMES[primary]
    return outcome(name, kind)


def classify(exc: BaseException) -> DbOutcome:
    """What to do about ``exc``, an error of a database (psycopg's or sqlite3's), or one of a
    store's own errors meaning its connection is lost (no SQLSTATE: :class:`Reconnect`)."""
    module = type(exc).__module__
    if module.startswith("sqlite3"):
        return classify_sqlite(getattr(exc, "sqlite_errorname", None), str(exc), type(exc).__name__)
    connection = True
    if module.startswith("psycopg"):
        import psycopg  # installed: it raised this

        connection = isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError))
    return classify_postgres(getattr(exc, "sqlstate", None), type(exc).__name__, str(exc), connection=connection)


def driver_errors(url: str) -> tuple[type[BaseException], ...]:
    """Every error of the driver a database URL is opened with: sqlite3's, and psycopg's for a
    ``postgresql://`` one (imported only then: a deployment on SQLite need not install it)."""
    import sqlite3

    if not url.startswith(("postgresql://", "postgres://")):
        return (sqlite3.Error,)
    import psycopg

    return (sqlite3.Error, psycopg.Error)


def describe(exc: BaseException, secrets: Iterable[str] = ()) -> str:
    """``exc`` in one line: its code and kind, class and first message line, each of
    ``secrets`` (a password) masked wherever the driver echoed it."""
    outcome = classify(exc)
    lines = str(exc).strip().splitlines()
    message = lines[0] if lines else ""
    for secret in secrets:
        if secret:
            message = message.replace(secret, "***")
    return f"{outcome.code} ({outcome.kind}) {type(exc).__name__}: {message}"

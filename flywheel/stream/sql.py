"""One SQL text for a stage's state on SQLite and on PostgreSQL (``stream.database_url``).

The stages write their SQL for SQLite (``?`` parameters, ``BLOB``/``REAL``/``INTEGER``, the
implicit ``rowid``, two-argument ``MIN``). :class:`PgConnection` runs that same text on
PostgreSQL with the sqlite3 calls the stages use (``execute``, ``executemany``,
``executescript``, cursors that iterate and ``fetchone``), translating each statement once:

- ``?`` becomes ``%s``; ``MIN(a, b)`` becomes ``LEAST(a, b)``;
- in DDL, ``BLOB`` is ``BYTEA``, ``REAL`` is ``DOUBLE PRECISION``, ``INTEGER`` is ``BIGINT`` and
  ``AUTOINCREMENT`` goes (sequence numbers are given by the store, never by the database); every
  table a stage declares gets a ``rowid BIGSERIAL`` column last, so that ``ORDER BY rowid`` and
  ``rowid>?`` mean what they mean on SQLite (insertion order), and positional inserts, which
  give the declared columns only, leave it to its default.

Each stage's consumer group has a PostgreSQL schema of its own (:func:`namespace`, set as the
connection's ``search_path``), so one database holds every stage of several deployments; on
SQLite (replicas on one host) each has a file of its own beside the one the URL names.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import sqlite3
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from flywheel.settings import refuse_leaking_url

_TYPES = [(re.compile(r"\bBLOB\b"), "BYTEA"), (re.compile(r"\bREAL\b"), "DOUBLE PRECISION"),
          (re.compile(r"\bINTEGER\b"), "BIGINT"), (re.compile(r"\s*\bAUTOINCREMENT\b"), "")]
#: A reconnect waits at most this long for the server: one that does not answer is tried again
#: after the stage's pause, which then keeps its loop turning (flywheel/stream/runner.py).
RECONNECT_TIMEOUT_S = 10

#: ``MIN(x, y)``, SQLite's two-argument scalar min (the aggregate takes one argument)
_MIN2 = re.compile(r"\bMIN\(([^,()]+),")


def is_postgres(url: str) -> bool:
    return url.startswith(("postgresql://", "postgres://"))


def namespace(group_id: str) -> str:
    """The schema (PostgreSQL) or file (SQLite) of a stage's state in a shared database: one per
    consumer group (each stage has its own, ``ingest.group_id`` and ``reward.group_id``), a valid
    identifier of at most 63 characters."""
    name = re.sub(r"[^a-z0-9_]", "_", group_id.lower())
    if len(name) > 63 or not name[:1].isalpha():
        name = f"g{name[:50]}_{hashlib.sha256(group_id.encode()).hexdigest()[:10]}"
    return name


def sqlite_path(url: str, ns: str) -> Path:
    """The SQLite file of namespace ``ns`` for ``sqlite:///<dir>/<name>.sqlite3``:
    ``<dir>/<name>.<ns>.sqlite3``, so that one URL serves every stage."""
    named = Path(url.removeprefix("sqlite:///"))
    return named.with_name(f"{named.stem}.{ns}{named.suffix or '.sqlite3'}")


def translate(sql: str) -> str:
    """A statement written for SQLite, for PostgreSQL (see the module docstring)."""
    return _MIN2.sub(r"LEAST(\1,", sql.replace("?", "%s"))


def translate_ddl(script: str, rowid: bool) -> list[str]:
    """A schema script's statements for PostgreSQL; ``rowid``: give each table a ``rowid`` column."""
    lines = [line.split("--", 1)[0] for line in script.splitlines()]
    out = []
    for stmt in filter(str.strip, "\n".join(lines).split(";")):
        for pattern, repl in _TYPES:
            stmt = pattern.sub(repl, stmt)
        if rowid and stmt.lstrip().upper().startswith("CREATE TABLE"):
            stmt = stmt[:stmt.rindex(")")] + ", rowid BIGSERIAL)"
        out.append(stmt.strip())
    return out


#: Every connection of a stage to its state database. A replica whose machine dies (power, network)
#: mid-transaction sends no FIN: without keepalives the server holds its session, and the lease
#: rows it locked, until the kernel's default keepalive gives up (about two hours), and the
#: replica taking its partitions over waits that long in ``take()``. With these the server drops
#: the dead session within about 25 s (probes after 10 s idle, every 5 s, 3 lost), and a session
#: idle inside a transaction for 5 minutes whatever its socket says (a turn's longest wait between
#: statements is an archive write, seconds). The client's own keepalives find a dead server alike.
SESSION_OPTIONS = {
    "options": "-c tcp_keepalives_idle=10 -c tcp_keepalives_interval=5 -c tcp_keepalives_count=3 "
               "-c idle_in_transaction_session_timeout=300000",
    "keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 5, "keepalives_count": 3,
}


class PgConnection:
    """A PostgreSQL connection with the sqlite3 calls the stages make (autocommit; a transaction
    is opened with ``BEGIN``, as on SQLite), inside schema ``ns``."""

    def __init__(self, url: str, ns: str) -> None:
        import psycopg  # only a deployment on PostgreSQL needs it

        self.url, self.ns = url, ns
        refuse_leaking_url(url)
        self.conn: Any = psycopg.connect(url, autocommit=True, **SESSION_OPTIONS)
        self._sql: dict[str, str] = {}
        # several replicas start at once: CREATE ... IF NOT EXISTS is not safe against a
        # concurrent twin (a unique violation in the catalog), so the schema is made under a lock
        self.conn.execute("SELECT pg_advisory_lock(hashtext(%s))", (ns,))
        try:
            self.conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{ns}"')
        finally:
            self.conn.execute("SELECT pg_advisory_unlock(hashtext(%s))", (ns,))
        self.conn.execute(f'SET search_path TO "{ns}"')

    def reconnect(self) -> None:
        """A new connection in place of one that was lost (the schema exists already: it only
        sets the search path). Raises, keeping the old one, while the server does not answer."""
        import psycopg

        conn = psycopg.connect(self.url, autocommit=True, connect_timeout=RECONNECT_TIMEOUT_S, **SESSION_OPTIONS)
        try:
            conn.execute(f'SET search_path TO "{self.ns}"')
        except BaseException:
            conn.close()
            raise
        old, self.conn = self.conn, conn
        with contextlib.suppress(psycopg.Error):
            old.close()

    def _t(self, sql: str) -> str:
        pg = self._sql.get(sql)
        if pg is None:
            pg = self._sql[sql] = translate(sql)
        return pg

    def execute(self, sql: str, params: Iterable[Any] = ()) -> Any:
        params = tuple(params)
        return self.conn.execute(self._t(sql), params or None)

    def executemany(self, sql: str, rows: Iterable[Iterable[Any]]) -> Any:
        cursor = self.conn.cursor()
        rows = list(rows)
        if rows:
            cursor.executemany(self._t(sql), rows)
        return cursor

    def executescript(self, script: str, rowid: bool = False) -> None:
        self.conn.execute("SELECT pg_advisory_lock(hashtext(%s))", (self.ns,))
        try:
            for stmt in translate_ddl(script, rowid):
                self.conn.execute(stmt)
        finally:
            self.conn.execute("SELECT pg_advisory_unlock(hashtext(%s))", (self.ns,))

    def columns(self, table: str) -> set[str]:
        return {r[0] for r in self.conn.execute(
            "SELECT column_name FROM information_schema.columns WHERE table_schema=%s AND table_name=%s",
            (self.ns, table))}

    def close(self) -> None:
        self.conn.close()


class SqliteConnection:
    """A stage's SQLite file as one connection that :meth:`reconnect` replaces in place, as
    :class:`PgConnection` does: whoever holds it (a stage keeps ``store.db`` from its start) goes
    on on the new connection, never on a closed one. The sqlite3 calls the stages make go to the
    current connection."""

    def __init__(self, path: Path) -> None:
        self.path = path
        # autocommit mode: transactions are opened explicitly by the store, nothing implicit
        self.conn = self._connect(str(path), uri=False)
        self.conn.execute("PRAGMA journal_mode=WAL")

    @staticmethod
    def _connect(target: str, uri: bool) -> sqlite3.Connection:
        conn = sqlite3.connect(target, uri=uri, isolation_level=None, timeout=30.0)
        # FULL: a committed transaction survives power loss too, not just a process crash.
        conn.execute("PRAGMA synchronous=FULL")
        # Some builds (Debian's among them) default to ON, which rewrites every freed page with
        # zeros: the outbox frees a batch's pages as soon as Kafka acks it, so that doubled the
        # cost of each delete. FAST zeroes only what costs no extra I/O.
        conn.execute("PRAGMA secure_delete=FAST")
        return conn

    def reconnect(self) -> None:
        """A new connection to the same file (one opened read-only stays so; handles of a disk
        that failed may be stale). ``mode=rw``: a file gone is an error, never a new empty store
        that would start every partition afresh. Raises, keeping the old one, while it fails."""
        conn = self._connect(f"{self.path.absolute().as_uri()}?mode=rw", uri=True)  # WAL is the file's own
        old, self.conn = self.conn, conn
        with contextlib.suppress(sqlite3.Error):
            old.close()

    def execute(self, sql: str, params: Any = ()) -> sqlite3.Cursor:
        return self.conn.execute(sql, params)

    def executemany(self, sql: str, rows: Iterable[Any]) -> sqlite3.Cursor:
        return self.conn.executemany(sql, rows)

    def executescript(self, script: str) -> sqlite3.Cursor:
        return self.conn.executescript(script)

    @property
    def in_transaction(self) -> bool:
        return self.conn.in_transaction

    def close(self) -> None:
        self.conn.close()


def sqlite_columns(db: Any, table: str) -> set[str]:
    return {row[1] for row in db.execute(f"PRAGMA table_info({table})")}

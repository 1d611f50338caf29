"""A stream stage's durable state: one SQLite database holding the stage's tables, its input
offsets, its outbox and its archive queue, changed together in one transaction per batch.

The delivery protocol built on it is in docs/exactly-once.md; in short:

- a batch's state changes, the records it owes to Kafka (the **outbox**), the rows it owes to
  its Parquet archive (the **archive queue**) and the input offsets past it commit in ONE
  transaction (WAL, ``synchronous=FULL``): all of it is durable, or none of it;
- outbox rows are sent after the commit and deleted when Kafka acks them (flywheel/stream/outbox.py);
  after a crash the rows still there are sent again: at least once;
- every record carries its idempotency key (a generation id, a dead letter's source coordinates)
  and its consumers drop repeats by that key, so each signal has its effect once.

A restart resumes every input partition at the offset stored here, never at the consumer
group's: the group's offsets are committed afterwards, for lag tools only.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import math
import os
import socket
import sqlite3
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import msgspec

from flywheel.dberrors import Bug, Reconnect, classify, describe
from flywheel.dburl import redact_database_url, url_secrets
from flywheel.settings import SettingsError
from flywheel.stream.sql import (
    PgConnection,
    SqliteConnection,
    is_postgres,
    sqlite_columns,
    sqlite_path,
    translate_ddl,
)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS offsets (
    topic TEXT NOT NULL, part INTEGER NOT NULL, next INTEGER NOT NULL, PRIMARY KEY (topic, part));
-- headers: the record's Kafka headers (its request id and trace context), packed_headers()
CREATE TABLE IF NOT EXISTS outbox (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, shard INTEGER NOT NULL, topic TEXT NOT NULL,
    key TEXT, value BLOB NOT NULL, headers BLOB);
CREATE INDEX IF NOT EXISTS outbox_shard ON outbox (shard, seq);
-- one entry per processed batch (per QUEUE_ENTRY_BYTES of a larger one): its archive rows,
-- msgpack [[seq, archive, value], ...]. A row per record cost three times as much to insert,
-- read back and delete.
-- its shard in a shared store, whose entries are each of one shard: they move with it
CREATE TABLE IF NOT EXISTS archive_queue (
    first INTEGER PRIMARY KEY, last INTEGER NOT NULL, rows INTEGER NOT NULL, data BLOB NOT NULL, shard INTEGER);
-- the id of each input topic as this store last read it: one deleted and created again under
-- its name has another, and the offsets kept for the old one point past the new one's records
CREATE TABLE IF NOT EXISTS topic_ids (topic TEXT PRIMARY KEY, id TEXT NOT NULL);
"""

#: The tables of a shared store (``stream.database_url``) besides those of every store.
_SHARED_SCHEMA = """
-- who processes each shard: taken with the next term by the process the group assigned it to;
-- every transaction of a shard's state checks its term first (StateStore.take)
CREATE TABLE IF NOT EXISTS leases (shard INTEGER PRIMARY KEY, holder TEXT NOT NULL, term INTEGER NOT NULL);
-- 'seq': the next outbox sequence number no process has reserved
CREATE TABLE IF NOT EXISTS counters (k TEXT PRIMARY KEY, v INTEGER NOT NULL);
-- topic_ids per input partition: each replica notes the partitions it reads
CREATE TABLE IF NOT EXISTS part_ids (topic TEXT NOT NULL, part INTEGER NOT NULL, id TEXT NOT NULL,
    PRIMARY KEY (topic, part));
CREATE INDEX IF NOT EXISTS archive_queue_shard ON archive_queue (shard, first);
"""

#: Outbox sequence numbers a shared store's process reserves at a time, in a statement of its
#: own: replicas number their rows from disjoint blocks without serialising on a counter.
SEQ_BLOCK = 10_000


#: An archive-queue entry holds at most about this many bytes of values (a batch's rows may take
#: several entries), and an archive write at most about ARCHIVE_WRITE_BYTES: both hold memory to
#: a bound however large the records and the backlog are.
QUEUE_ENTRY_BYTES = 64 * 1024 * 1024
ARCHIVE_WRITE_BYTES = 256 * 1024 * 1024


class OutRow(NamedTuple):
    """One outbox entry: a record the stage owes to a topic.

    A named tuple rather than a frozen dataclass: one is built per output record, and a frozen
    dataclass's ``__init__`` costs several times more.
    """

    seq: int
    shard: int
    topic: str
    key: str | None
    value: bytes
    headers: list[tuple[str, bytes]] | None = None


#: Kafka headers in a column: msgpack ``[[name, value], ...]``.
_pack_headers = msgspec.msgpack.Encoder().encode
_unpack_headers = msgspec.msgpack.Decoder(list[tuple[str, bytes]]).decode


def packed_headers(headers: Sequence[tuple[str, bytes]] | None) -> bytes | None:
    """``headers`` as a column holds them (None for none): :func:`unpacked_headers` reads them."""
    return _pack_headers(list(headers)) if headers else None


def unpacked_headers(blob: bytes | None) -> list[tuple[str, bytes]] | None:
    return _unpack_headers(blob) if blob else None


class ArchiveRow(NamedTuple):
    """One archive queue entry: a record the stage owes to the archive ``archive``."""

    seq: int
    archive: str
    value: bytes


class ShardMismatch(SettingsError):
    """A state store started for shards other than those it holds the state of."""


class LeaseLost(Exception):
    """Another process took the lease of ``shards`` (the group gave it their partitions): this
    one must not write their state any more. Raised inside a transaction, which rolls back."""

    def __init__(self, shards: set[int]) -> None:
        super().__init__(f"the leases of shards {sorted(shards)} were taken by another process")
        self.shards = shards


class DatabaseLost(Exception):
    """A database error broke the store (its connection lost, a transaction's outcome unknown, a
    transaction refused): nothing may be read or written until :meth:`StateStore.reconnect` has
    succeeded."""


class StateStore:
    """A stage's durable state: offsets, outbox, archive queue and the stage's tables.

    ``StateStore(path, tables)``: an SQLite file in WAL mode, all of it this process's.
    :meth:`shared`: one namespace of a database shared by the stage's replicas, in which this
    process reads and writes only the shards whose leases it holds (:attr:`leases`).
    """

    def __init__(self, path: Path | None, stage_schema: str = "", *, url: str = "", ns: str = "") -> None:
        #: A database shared by the stage's replicas: the shards' leases fence every write.
        self.shared = bool(url)
        self.url, self.ns = url, ns
        self.postgres = is_postgres(url)
        #: This process, as the leases name their holder.
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        #: shard -> term of each lease this process holds (shared stores only)
        self.leases: dict[int, int] = {}
        # rows of the open transaction, inserted in one executemany per table just before COMMIT
        self._appends: list[tuple[int, int, str, str | None, bytes, bytes | None]] = []
        self._queue: dict[int | None, list[tuple[int, str, bytes]]] = {}
        self._on_rollback: list[Callable[[], None]] = []
        self.owed = 0
        self._owed_change = 0  # of the open transaction
        self.queued = 0
        self._unqueued = 0  # rows the open transaction took out of the archive queue
        self._in_txn = False
        #: The last database error since the store broke (None: it works): see :meth:`reconnect`.
        self.broken: BaseException | None = None
        # one of the errors since it broke asks for new connections (flywheel/dberrors.py Reconnect)
        self._reopen = False
        #: Every error of the database (flywheel/dberrors.py judges what each asks for): a runner
        #: waits them out, retrying after :meth:`reconnect`, a read-only database and a full disk
        #: as much as a lost connection. Set below for the store's driver.
        self.lost_errors: tuple[type[BaseException], ...] = (sqlite3.Error, DatabaseLost)
        # masked wherever the driver's messages echo them (describe)
        self._secrets = url_secrets(url)
        self._next_seq = 1  # set from the database below, once the schema exists
        self._block_end: float = math.inf  # a shared store's seqs come in blocks (_reserve)
        if self.postgres:
            self.path: Path | None = None
            self.where = f"{redact_database_url(url)} (schema {ns})"
            import psycopg

            self.lost_errors = (psycopg.Error, DatabaseLost)
            self.db: Any = PgConnection(url, ns)
            self.db.executescript(_SCHEMA + _SHARED_SCHEMA)
            # a store from before records carried headers (IF NOT EXISTS: replicas start at once)
            self.db.executescript("ALTER TABLE outbox ADD COLUMN IF NOT EXISTS headers BLOB")
            self.db.executescript(stage_schema, rowid=True)
            # block reservations commit on their own, never inside a batch's transaction: one
            # replica's batch must not hold the counter the others need
            self._seq_db: Any = PgConnection(url, ns)
            self._begin, self._for_update = "BEGIN", " FOR UPDATE"
        else:
            path = path if path is not None else sqlite_path(url, ns)
            path.parent.mkdir(parents=True, exist_ok=True)
            self.path, self.where = path, str(path)
            self._begin, self._for_update = "BEGIN IMMEDIATE", ""  # IMMEDIATE: one writer at a time
            self.db = self._seq_db = self._open_sqlite(path, stage_schema)
        with self.txn():
            self.db.execute("INSERT INTO meta VALUES ('epoch', ?) ON CONFLICT (k) DO NOTHING", (uuid.uuid4().hex[:12],))
            if self.shared:
                self.db.execute("INSERT INTO counters VALUES ('seq', 1) ON CONFLICT (k) DO NOTHING")
        #: Names this store's archive files (with the rows' sequence numbers) and its shard claims.
        self.epoch: str = self.db.execute("SELECT v FROM meta WHERE k='epoch'").fetchone()[0]
        #: Rows in the archive queue, and when (monotonic) the oldest of them was queued: a queue
        #: found at start counts as due at once.
        self.queued_since: float = float("-inf")
        if self.shared:  # nothing is this process's until it takes a lease
            self._next_seq = 0
            self._block_end = 0
            return
        # Sequence numbers are given here rather than by SQLite, so an output and its archive
        # row share one; sqlite_sequence still records the highest ever used, so none is reused.
        row = self.db.execute("SELECT seq FROM sqlite_sequence WHERE name='outbox'").fetchone()
        self._next_seq = (row[0] if row else 0) + 1
        self.queued = self.db.execute("SELECT coalesce(sum(rows), 0) FROM archive_queue").fetchone()[0]
        #: Rows in the outbox, owed to Kafka (kept by the transactions that add and delete them).
        self.owed = self.db.execute("SELECT count(*) FROM outbox").fetchone()[0]

    @classmethod
    def shared_store(cls, url: str, ns: str, stage_schema: str = "") -> StateStore:
        """Namespace ``ns`` (flywheel/stream/sql.py ``namespace``) of the shared database ``url``."""
        return cls(None, stage_schema, url=url, ns=ns)

    def _open_sqlite(self, path: Path, stage_schema: str) -> SqliteConnection:
        db = SqliteConnection(path)
        db.executescript(_SCHEMA)
        # replicas sharing an SQLite store may start together: each reads the columns again in
        # a transaction of its own (one writer at a time), so only one adds what is missing
        db.execute("BEGIN IMMEDIATE")
        try:
            if "shard" not in sqlite_columns(db, "archive_queue"):  # a store from before shards moved
                db.execute("ALTER TABLE archive_queue ADD COLUMN shard INTEGER")
            if "headers" not in sqlite_columns(db, "outbox"):  # a store from before records carried headers
                db.execute("ALTER TABLE outbox ADD COLUMN headers BLOB")
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.executescript((_SHARED_SCHEMA if self.shared else "") + stage_schema)
        return db

    @contextmanager
    def txn(self, fenced: bool = True) -> Iterator[Any]:
        """One transaction; in a shared store it first checks (``fenced``) that every lease this
        process holds is still its own, and raises :class:`LeaseLost` for those that are not.

        A database error (:attr:`lost_errors`) breaks the store: the transaction may or may not
        have committed (a COMMIT whose answer was lost), and the caches the ``on_rollback`` hooks
        rebuild may hold the batch. Nothing runs until :meth:`reconnect` has read them again."""
        if self.broken is not None:
            raise DatabaseLost(f"the state database failed ({self.describe(self.broken)}): not recovered yet")
        try:
            self.db.execute(self._begin)
        except self.lost_errors as exc:
            self.lost(exc)
            raise
        self._in_txn = True
        first_seq, block_end = self._next_seq, self._block_end
        try:
            if fenced and self.leases:
                self._check_leases()
            yield self.db
            self._write_appends()
            self.db.execute("COMMIT")
        except BaseException as exc:
            self._appends.clear()
            self._queue.clear()
            self._owed_change = self._unqueued = 0
            self._next_seq, self._block_end = first_seq, block_end
            if isinstance(exc, self.lost_errors) and not isinstance(classify(exc), Bug):
                self._refused(exc)
            else:  # not the database's doing (a bug raised from the statement too): the process stops
                self._roll_back()
            raise
        else:
            self.owed += self._owed_change
            self.queued -= self._unqueued
            self._owed_change = self._unqueued = 0
            if self._queue:
                if not self.queued:
                    self.queued_since = time.monotonic()
                self.queued += sum(len(rows) for rows in self._queue.values())
                self._queue.clear()
        finally:
            self._in_txn = False

    def _roll_back(self) -> None:
        try:
            self.db.execute("ROLLBACK")
            for fn in self._on_rollback:  # in-memory caches of state must forget the batch too
                fn()
        except self.lost_errors as exc:  # the hooks run again once it is back (reconnect)
            self.lost(exc)

    def _refused(self, exc: BaseException) -> None:
        """A database error ended the open transaction. A connection to replace gets no ROLLBACK
        (on a dead one it would raise again, over this error; closing it rolls back whatever the
        server had open). One that works ends its transaction now, so that no lock is held while
        the stage waits: a deadlock's other party, a read-only server's session."""
        if not isinstance(classify(exc), Reconnect) and (self.postgres or self.db.in_transaction):
            try:
                self.db.execute("ROLLBACK")
            except self.lost_errors as again:
                self.lost(again)
        self.lost(exc)

    def lost(self, exc: BaseException) -> None:
        """A database error: broken until :meth:`reconnect` (which opens new connections first
        when one of the errors since asked for it: flywheel/dberrors.py ``Reconnect``)."""
        self._reopen = self._reopen or isinstance(classify(exc), Reconnect)
        if self.broken is None or not isinstance(exc, DatabaseLost):
            self.broken = exc

    def describe(self, exc: BaseException) -> str:
        """``exc`` in one log line: its SQLSTATE (or SQLite error name), kind and message, with
        the database's password masked (flywheel/dberrors.py)."""
        return describe(exc, self._secrets)

    def reconnect(self) -> None:
        """Recover from a database error: open the store's connections again when an error asked
        for it (a lost connection, a read-only session: ``Reconnect``), and read again what the
        failed transaction may have left in memory: the ``on_rollback`` hooks' caches, the rows
        owed and queued. Raises a database error while the database does not answer (or cannot
        be read), and the store stays broken.

        The failed transaction may have committed (its COMMIT's answer lost), so the sequence
        numbers after ``_next_seq`` may be taken: a fresh block (on a store of its own, the
        highest SQLite has seen). The leases are not taken again: another process may hold some
        since, which the next transaction's fence finds out.
        """
        if self._reopen:  # in place: whoever holds ``db`` (a stage does) goes on on the new one
            self.db.reconnect()
            if self._seq_db is not self.db:
                self._seq_db.reconnect()
            self._reopen = False
        for fn in self._on_rollback:
            fn()
        if self.shared:
            self._block_end = self._next_seq
        else:
            row = self.db.execute("SELECT seq FROM sqlite_sequence WHERE name='outbox'").fetchone()
            self._next_seq = max(self._next_seq, (row[0] if row else 0) + 1)
        self._rescope()
        self.broken = None

    # -- leases (shared stores) ------------------------------------------------------------
    def take(self, shards: Iterable[int]) -> None:
        """Take the leases of ``shards`` (the group assigned their partitions to this process):
        each with the next term, so that whoever held it before fails its next transaction.

        On PostgreSQL a transaction of the previous holder in progress holds the lease rows
        (``FOR UPDATE``): this waits for it, and what it committed is there to read after.
        """
        want = sorted(set(shards))
        if not self.shared or not want:
            return
        with self.txn(fenced=False):
            self.db.executemany("INSERT INTO leases VALUES (?, ?, 1) ON CONFLICT (shard) DO UPDATE "
                                "SET holder=excluded.holder, term=leases.term+1", [(s, self.holder) for s in want])
            terms = dict(self.db.execute(f"SELECT shard, term FROM leases WHERE shard IN ({_marks(want)})", want))
        self.leases.update(terms)
        # a fresh block: this process's rows of the shards taken follow their previous owner's
        self._block_end = self._next_seq
        self._rescope()

    def release(self, shards: Iterable[int]) -> None:
        """Forget the leases of ``shards`` (revoked, or lost): their next owner takes them."""
        if self.shared:
            for shard in shards:
                self.leases.pop(shard, None)
            if self.broken is None:  # else reconnect() counts
                self._rescope()

    def _check_leases(self) -> None:
        held = sorted(self.leases)
        rows = self.db.execute(f"SELECT shard, holder, term FROM leases WHERE shard IN ({_marks(held)}) "
                               f"ORDER BY shard{self._for_update}", held).fetchall()
        mine = {shard: term for shard, holder, term in rows if holder == self.holder}
        lost = {shard for shard, term in self.leases.items() if mine.get(shard) != term}
        if lost:
            raise LeaseLost(lost)

    def scoped(self, column: str = "shard") -> tuple[str, tuple[int, ...]]:
        """``(" AND <column> IN (...)", shards)``: the condition that keeps a statement to this
        process's shards in a shared store; nothing in a store of its own, all of it this process's."""
        if not self.shared:
            return "", ()
        if not self.leases:
            return " AND 0=1", ()
        held = tuple(sorted(self.leases))
        return f" AND {column} IN ({_marks(held)})", held

    def mine(self, shards: Iterable[int]) -> set[int]:
        """Those of ``shards`` this process may touch: in a shared store, those it holds the lease of."""
        return set(shards) & self.leases.keys() if self.shared else set(shards)

    def _rescope(self) -> None:
        """Count what this process owes of its shards now (they changed)."""
        cond, args = self.scoped()
        self.owed = self.db.execute(f"SELECT count(*) FROM outbox WHERE 1=1{cond}", args).fetchone()[0]
        self.queued = int(self.db.execute(f"SELECT coalesce(sum(rows), 0) FROM archive_queue WHERE 1=1{cond}",
                                          args).fetchone()[0])
        self.queued_since = float("-inf")  # a previous owner's queue is due at once

    def _reserve(self) -> None:
        """The next block of SEQ_BLOCK sequence numbers. On PostgreSQL in a statement of its own;
        on SQLite in the open transaction (it holds the only write lock anyway), whose rollback
        gives the block back (``txn`` then restores the block it had)."""
        end = self._seq_db.execute("UPDATE counters SET v = v + ? WHERE k='seq' RETURNING v",
                                   (SEQ_BLOCK,)).fetchone()[0]
        self._next_seq, self._block_end = end - SEQ_BLOCK, end

    def bind_shards(self, shards: Sequence[int]) -> None:
        """Tie the store to the shards it serves (``()``: all, through the consumer group).

        A shard's join state and undelivered outputs live only in the store that processed it.
        A store started for other shards would strand them here, and its new shards would start
        with no state from wherever the group's offsets point: refused, with the reason. (A
        shared store holds every shard: its leases say whose each is.)
        """
        if self.shared:
            return
        want = _shards_label(shards)
        with self.txn():
            row = self.db.execute("SELECT v FROM meta WHERE k='shards'").fetchone()
            if row is not None:
                have = row[0]
            else:  # a new store, or one written before shards were recorded: its offsets tell
                stray = sorted({p for _, p in self.offsets()} - set(shards)) if shards else []
                have = f"a set including {stray}" if stray else want
                if not stray:
                    self.db.execute("INSERT INTO meta VALUES ('shards', ?)", (want,))
        if have != want:
            raise ShardMismatch(
                f"state store {self.path} holds the state of shards {have}, but this process is "
                f"configured for shards {want}. Run this data_dir with shards {have}, and give other "
                "shards a data_dir of their own (see docs/exactly-once.md, Scaling out)")

    @contextmanager
    def schema_change(self) -> Iterator[Any]:
        """One migration step at a time across the replicas: replicas starting together all find
        a column missing, and all but one would fail adding it again (DuplicateColumn). Under the
        namespace's lock on PostgreSQL (the one its DDL takes, ``PgConnection``) and in one
        transaction (BEGIN IMMEDIATE on SQLite, one writer at a time): read the columns again
        inside it, then change what is still missing (:meth:`add_column`)."""
        if self.postgres:
            self.db.execute("SELECT pg_advisory_lock(hashtext(?))", (self.ns,))
        try:
            with self.txn(fenced=False) as db:
                yield db
        finally:
            if self.postgres:
                with contextlib.suppress(*self.lost_errors):  # a lost session let go of it
                    self.db.execute("SELECT pg_advisory_unlock(hashtext(?))", (self.ns,))

    def add_column(self, table: str, column: str, decl: str) -> None:
        """Inside :meth:`schema_change`: add ``column`` (``decl`` in SQLite's types, translated
        on PostgreSQL, where BLOB is BYTEA) to ``table``."""
        stmt = f"ALTER TABLE {table} ADD COLUMN {column} {decl}"
        self.db.execute(translate_ddl(stmt, rowid=False)[0] if self.postgres else stmt)

    def on_rollback(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` after a rolled-back transaction (a stage rebuilds its caches there)."""
        self._on_rollback.append(fn)

    def columns(self, table: str) -> set[str]:
        """The column names of ``table`` (a stage's migrations ask)."""
        return self.db.columns(table) if self.postgres else sqlite_columns(self.db, table)

    def close(self) -> None:
        if self._seq_db is not self.db:
            self._seq_db.close()
        self.db.close()

    # -- inside a transaction -------------------------------------------------------------
    def set_offsets(self, offsets: dict[tuple[str, int], int]) -> None:
        self.db.executemany(
            "INSERT INTO offsets VALUES (?, ?, ?) ON CONFLICT (topic, part) DO UPDATE SET next=excluded.next",
            [(t, p, n) for (t, p), n in offsets.items()],
        )

    def append(self, shard: int, topic: str, key: str | None, value: bytes, archive: str | None = None,
               headers: Sequence[tuple[str, bytes]] | None = None) -> None:
        """Owe ``value`` to ``topic`` (with ``headers``; and to ``archive`` when named). Call inside
        :meth:`txn`."""
        assert self._in_txn, "outbox rows must be appended inside the processing transaction"
        seq = self._next_seq
        if seq >= self._block_end:
            self._reserve()
            seq = self._next_seq
        self._next_seq = seq + 1
        self._appends.append((seq, shard, topic, key, value, packed_headers(headers)))
        if archive is not None:
            # a shared store queues each shard's rows apart, to move with it; one of its own, a
            # batch's rows as one entry
            self._queue.setdefault(shard if self.shared else None, []).append((seq, archive, value))

    def note_topic_ids(self, ids: dict[Any, str]) -> None:
        """Remember input topics' ids (as :meth:`changed_ids` gave them). Call inside :meth:`txn`:
        in the same transaction as the offsets a recreated topic resets, or a crash between the
        two would leave the reset undone under an id that no longer tells."""
        assert self._in_txn, "topic ids are noted in the transaction that acts on them"
        if self.shared:
            self.db.executemany("INSERT INTO part_ids VALUES (?, ?, ?) ON CONFLICT (topic, part) DO UPDATE "
                                "SET id=excluded.id", [(t, p, i) for (t, p), i in ids.items()])
            return
        self.db.executemany("INSERT INTO topic_ids VALUES (?, ?) ON CONFLICT (topic) DO UPDATE SET id=excluded.id",
                            list(ids.items()))

    def _write_appends(self) -> None:
        # one statement per table and batch instead of one per record
        if self._appends:
            self.db.executemany("INSERT INTO outbox (seq, shard, topic, key, value, headers) VALUES (?, ?, ?, ?, ?, ?)",
                                self._appends)
            self._owed_change += len(self._appends)
            self._appends.clear()
        # and one queue entry per QUEUE_ENTRY_BYTES of values (and shard, in a shared store): SQLite
        # stores no blob over 1 GB, and a transaction closing a backlog of large episodes could pass that
        for shard, rows in self._queue.items():
            start, size = 0, 0
            for i, row in enumerate(rows):
                size += len(row[2])
                if size >= QUEUE_ENTRY_BYTES or i == len(rows) - 1:
                    entry = rows[start:i + 1]
                    self.db.execute("INSERT INTO archive_queue (first, last, rows, data, shard) VALUES (?, ?, ?, ?, ?)",
                                    (entry[0][0], entry[-1][0], len(entry), _encode_queue(entry), shard))
                    start, size = i + 1, 0

    # -- reads and bookkeeping ------------------------------------------------------------
    def offsets(self) -> dict[tuple[str, int], int]:
        return {(t, p): n for t, p, n in self.db.execute("SELECT topic, part, next FROM offsets")}

    def pending(self, shards: Iterable[int], limit: int = 20_000, after: int = -1) -> list[OutRow]:
        """The first ``limit`` rows above seq ``after`` owed by ``shards``, in seq order."""
        if limit <= 0:
            return []
        # One query per shard, merged lazily: each walks the (shard, seq) index in order, where
        # one query over all shards makes SQLite sort every row, blobs included (5x slower), and
        # the merge reads about ``limit`` rows in all, not ``limit`` per shard.
        cursors = [self.db.execute("SELECT seq, shard, topic, key, value, headers FROM outbox "
                                   "WHERE shard=? AND seq>? ORDER BY seq LIMIT ?", (shard, after, limit))
                   for shard in sorted(self.mine(shards))]
        if not cursors:
            return []
        try:
            rows = cursors[0].fetchall() if len(cursors) == 1 else list(itertools.islice(heapq.merge(*cursors), limit))
        finally:
            for cursor in cursors:  # an unfinished read would hold its snapshot of the database
                cursor.close()
        return [OutRow(s, sh, t, k, bytes(v), unpacked_headers(h)) for s, sh, t, k, v, h in rows]

    def delivered(self, seqs: Iterable[int]) -> None:
        """Delete rows Kafka acked (not fenced: a row delivered may go, whoever's it is now)."""
        seqs = set(seqs)
        with self.txn(fenced=False):
            # acks come back mostly in seq order: one range delete per run of consecutive seqs
            # costs about half of a delete per row
            gone = self.db.executemany("DELETE FROM outbox WHERE seq BETWEEN ? AND ?", seq_runs(seqs)).rowcount
            self._owed_change -= gone
        if self.shared and gone != len(seqs):
            # another process deleted some (a previous owner whose acks came late): count again
            self._rescope()

    def queued_batches(self, rows: int) -> list[tuple[int, list[ArchiveRow]]]:
        """The oldest queued batches, whole, until they hold at least ``rows`` rows or
        ``ARCHIVE_WRITE_BYTES`` bytes (or all of them): ``(first seq, its rows in seq order)`` each."""
        out: list[tuple[int, list[ArchiveRow]]] = []
        total = size = 0
        cond, args = self.scoped()
        cursor = self.db.execute(f"SELECT first, rows, data FROM archive_queue WHERE 1=1{cond} ORDER BY first", args)
        try:
            for first, n, data in cursor:
                out.append((first, [ArchiveRow(*r) for r in _decode_queue(data)]))
                total += n
                size += len(data)
                if total >= rows or size >= ARCHIVE_WRITE_BYTES:
                    break
        finally:
            cursor.close()
        return out

    def queued_span(self) -> tuple[int, int] | None:
        """The lowest and highest seq in the archive queue; None when it is empty."""
        cond, args = self.scoped()
        lo, hi = self.db.execute(f"SELECT min(first), max(last) FROM archive_queue WHERE 1=1{cond}", args).fetchone()
        return None if lo is None else (lo, hi)

    def archived(self, firsts: Iterable[int]) -> None:
        """Take whole batches (by first seq) out of the archive queue: their rows are in files.

        In the open transaction if there is one (the archive write's, which holds the leases
        from before its files are written until they leave the queue: Outbox.archive), else in
        one of its own.
        """
        if not self._in_txn:
            with self.txn():
                self._dequeue(firsts)
        else:
            self._dequeue(firsts)

    def _dequeue(self, firsts: Iterable[int]) -> None:
        keys = [(first,) for first in firsts]
        for k in keys:
            row = self.db.execute("SELECT rows FROM archive_queue WHERE first=?", k).fetchone()
            self._unqueued += row[0] if row is not None else 0
        self.db.executemany("DELETE FROM archive_queue WHERE first=?", keys)

    def changed_ids(self, ids: dict[str, str],
                    parts: Iterable[tuple[str, int]] = ()) -> tuple[dict[Any, str], set[str]]:
        """Of topics' ids now (topic -> id): those this store has not noted yet, and the topics
        among them it knew under another id (deleted and created again since). A shared store
        notes them per partition (``parts``: the ones being assigned), each replica its own."""
        if self.shared:
            parts = sorted(set(parts))
            known = {(t, p): i for t, p, i in self.db.execute("SELECT topic, part, id FROM part_ids")}
            changed_parts = {(t, p): ids[t] for t, p in parts if t in ids and known.get((t, p)) != ids[t]}
            return changed_parts, {t for t, p in changed_parts if (t, p) in known}
        known = dict(self.db.execute("SELECT topic, id FROM topic_ids"))
        changed = {t: i for t, i in ids.items() if known.get(t) != i}
        return changed, {t for t in changed if t in known}


_encode_queue = msgspec.msgpack.Encoder().encode
_decode_queue = msgspec.msgpack.Decoder(list[tuple[int, str, bytes]]).decode


def seq_runs(seqs: Iterable[int]) -> list[tuple[int, int]]:
    """``seqs`` as the ``(first, last)`` of each run of consecutive integers, ascending."""
    runs: list[tuple[int, int]] = []
    ordered = sorted(set(seqs))
    if not ordered:
        return runs
    first = last = ordered[0]
    for seq in ordered[1:]:
        if seq != last + 1:
            runs.append((first, last))
            first = seq
        last = seq
    runs.append((first, last))
    return runs


def _shards_label(shards: Sequence[int]) -> str:
    return ",".join(map(str, sorted(shards))) or "all (consumer group)"


def owed_in(url: str, group_id: str, shards: Iterable[int]) -> int:
    """Outbox rows of ``shards`` in the shared store of consumer group ``group_id`` at ``url``:
    what their next owner sends (again, where a dead owner's sends had landed). For operators and
    tests; reads beside the running replicas."""
    from flywheel.stream.sql import namespace

    ns, want = namespace(group_id), sorted(set(shards))
    if not want:
        return 0
    if not is_postgres(url) and not sqlite_path(url, ns).exists():
        return 0  # no replica made it yet: none owes anything
    db: Any = PgConnection(url, ns) if is_postgres(url) else sqlite3.connect(str(sqlite_path(url, ns)), timeout=30.0)
    try:
        if is_postgres(url) and not db.columns("outbox"):
            return 0  # no replica made it yet
        return db.execute(f"SELECT count(*) FROM outbox WHERE shard IN ({_marks(want)})", want).fetchone()[0]
    finally:
        db.close()


def _marks(items: Sequence[Any]) -> str:
    return ",".join("?" * len(items))

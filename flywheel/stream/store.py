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

import heapq
import itertools
import sqlite3
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import msgspec

from flywheel.settings import SettingsError

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS offsets (
    topic TEXT NOT NULL, part INTEGER NOT NULL, next INTEGER NOT NULL, PRIMARY KEY (topic, part));
CREATE TABLE IF NOT EXISTS outbox (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, shard INTEGER NOT NULL, topic TEXT NOT NULL,
    key TEXT, value BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS outbox_shard ON outbox (shard, seq);
-- one entry per processed batch (per QUEUE_ENTRY_BYTES of a larger one): its archive rows,
-- msgpack [[seq, archive, value], ...]. A row per record cost three times as much to insert,
-- read back and delete.
CREATE TABLE IF NOT EXISTS archive_queue (
    first INTEGER PRIMARY KEY, last INTEGER NOT NULL, rows INTEGER NOT NULL, data BLOB NOT NULL);
-- the id of each input topic as this store last read it: one deleted and created again under
-- its name has another, and the offsets kept for the old one point past the new one's records
CREATE TABLE IF NOT EXISTS topic_ids (topic TEXT PRIMARY KEY, id TEXT NOT NULL);
"""


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


class ArchiveRow(NamedTuple):
    """One archive queue entry: a record the stage owes to the archive ``archive``."""

    seq: int
    archive: str
    value: bytes


class ShardMismatch(SettingsError):
    """A state store started for shards other than those it holds the state of."""


class StateStore:
    """A stage's durable state: SQLite in WAL mode holding offsets, outbox and the stage's tables."""

    def __init__(self, path: Path, stage_schema: str = "") -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        # rows of the open transaction, inserted in one executemany per table just before COMMIT
        self._appends: list[tuple[int, int, str, str | None, bytes]] = []
        self._queue: list[tuple[int, str, bytes]] = []
        self._on_rollback: list[Callable[[], None]] = []
        self.owed = 0
        self._owed_change = 0  # of the open transaction
        self.queued = 0
        self._in_txn = False
        self._next_seq = 1  # set from the database below, once the schema exists
        # autocommit mode: transactions are opened explicitly by txn(), nothing implicit.
        self.db = sqlite3.connect(str(path), isolation_level=None, timeout=30.0)
        self.db.execute("PRAGMA journal_mode=WAL")
        # FULL: a committed transaction survives power loss too, not just a process crash.
        self.db.execute("PRAGMA synchronous=FULL")
        # Some builds (Debian's among them) default to ON, which rewrites every freed page with
        # zeros: the outbox frees a batch's pages as soon as Kafka acks it, so that doubled the
        # cost of each delete. FAST zeroes only what costs no extra I/O.
        self.db.execute("PRAGMA secure_delete=FAST")
        self.db.executescript(_SCHEMA + stage_schema)
        with self.txn():
            if self.db.execute("SELECT v FROM meta WHERE k='epoch'").fetchone() is None:
                self.db.execute("INSERT INTO meta VALUES ('epoch', ?)", (uuid.uuid4().hex[:12],))
        #: Names this store's archive files (with the rows' sequence numbers) and its shard claims.
        self.epoch: str = self.db.execute("SELECT v FROM meta WHERE k='epoch'").fetchone()[0]
        # Sequence numbers are given here rather than by SQLite, so an output and its archive
        # row share one; sqlite_sequence still records the highest ever used, so none is reused.
        row = self.db.execute("SELECT seq FROM sqlite_sequence WHERE name='outbox'").fetchone()
        self._next_seq = (row[0] if row else 0) + 1
        #: Rows in the archive queue, and when (monotonic) the oldest of them was queued: a queue
        #: found at start counts as due at once.
        self.queued: int = self.db.execute("SELECT coalesce(sum(rows), 0) FROM archive_queue").fetchone()[0]
        self.queued_since: float = float("-inf")
        #: Rows in the outbox, owed to Kafka (kept by the transactions that add and delete them).
        self.owed: int = self.db.execute("SELECT count(*) FROM outbox").fetchone()[0]

    @contextmanager
    def txn(self) -> Iterator[sqlite3.Connection]:
        self.db.execute("BEGIN IMMEDIATE")
        self._in_txn = True
        first_seq = self._next_seq
        try:
            yield self.db
            self._write_appends()
        except BaseException:
            self._appends.clear()
            self._queue.clear()
            self._owed_change = 0
            self._next_seq = first_seq
            self.db.execute("ROLLBACK")
            for fn in self._on_rollback:  # in-memory caches of state must forget the batch too
                fn()
            raise
        else:
            self.db.execute("COMMIT")
            self.owed += self._owed_change
            self._owed_change = 0
            if self._queue:
                if not self.queued:
                    self.queued_since = time.monotonic()
                self.queued += len(self._queue)
                self._queue.clear()
        finally:
            self._in_txn = False

    def bind_shards(self, shards: Sequence[int]) -> None:
        """Tie the store to the shards it serves (``()``: all, through the consumer group).

        A shard's join state and undelivered outputs live only in the store that processed it.
        A store started for other shards would strand them here, and its new shards would start
        with no state from wherever the group's offsets point: refused, with the reason.
        """
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

    def on_rollback(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` after a rolled-back transaction (a stage rebuilds its caches there)."""
        self._on_rollback.append(fn)

    def close(self) -> None:
        self.db.close()

    # -- inside a transaction -------------------------------------------------------------
    def set_offsets(self, offsets: dict[tuple[str, int], int]) -> None:
        self.db.executemany(
            "INSERT INTO offsets VALUES (?, ?, ?) ON CONFLICT (topic, part) DO UPDATE SET next=excluded.next",
            [(t, p, n) for (t, p), n in offsets.items()],
        )

    def append(self, shard: int, topic: str, key: str | None, value: bytes, archive: str | None = None) -> None:
        """Owe ``value`` to ``topic`` (and to ``archive`` when named). Call inside :meth:`txn`."""
        assert self._in_txn, "outbox rows must be appended inside the processing transaction"
        seq = self._next_seq
        self._next_seq = seq + 1
        self._appends.append((seq, shard, topic, key, value))
        if archive is not None:
            self._queue.append((seq, archive, value))

    def note_topic_ids(self, ids: dict[str, str]) -> None:
        """Remember input topics' ids (topic -> id). Call inside :meth:`txn`: in the same
        transaction as the offsets a recreated topic resets, or a crash between the two would
        leave the reset undone under an id that no longer tells."""
        assert self._in_txn, "topic ids are noted in the transaction that acts on them"
        self.db.executemany("INSERT INTO topic_ids VALUES (?, ?) ON CONFLICT (topic) DO UPDATE SET id=excluded.id",
                            list(ids.items()))

    def _write_appends(self) -> None:
        # one statement per table and batch instead of one per record
        if self._appends:
            self.db.executemany("INSERT INTO outbox (seq, shard, topic, key, value) VALUES (?, ?, ?, ?, ?)",
                                self._appends)
            self._owed_change += len(self._appends)
            self._appends.clear()
        # and one queue entry per QUEUE_ENTRY_BYTES of values: SQLite stores no blob over 1 GB,
        # and a transaction closing a backlog of large episodes could pass that
        start, size = 0, 0
        for i, row in enumerate(self._queue):
            size += len(row[2])
            if size >= QUEUE_ENTRY_BYTES or i == len(self._queue) - 1:
                entry = self._queue[start:i + 1]
                self.db.execute("INSERT INTO archive_queue VALUES (?, ?, ?, ?)",
                                (entry[0][0], entry[-1][0], len(entry), _encode_queue(entry)))
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
        cursors = [self.db.execute("SELECT seq, shard, topic, key, value FROM outbox "
                                   "WHERE shard=? AND seq>? ORDER BY seq LIMIT ?", (shard, after, limit))
                   for shard in sorted(set(shards))]
        try:
            rows = cursors[0].fetchall() if len(cursors) == 1 else list(itertools.islice(heapq.merge(*cursors), limit))
        finally:
            for cursor in cursors:  # an unfinished read would hold its snapshot of the database
                cursor.close()
        return [OutRow(s, sh, t, k, bytes(v)) for s, sh, t, k, v in rows]

    def delivered(self, seqs: Iterable[int]) -> None:
        """Delete rows Kafka acked."""
        with self.txn():
            # acks come back mostly in seq order: one range delete per run of consecutive seqs
            # costs about half of a delete per row
            self._owed_change -= self.db.executemany("DELETE FROM outbox WHERE seq BETWEEN ? AND ?",
                                                     seq_runs(seqs)).rowcount

    def queued_batches(self, rows: int) -> list[tuple[int, list[ArchiveRow]]]:
        """The oldest queued batches, whole, until they hold at least ``rows`` rows or
        ``ARCHIVE_WRITE_BYTES`` bytes (or all of them): ``(first seq, its rows in seq order)`` each."""
        out: list[tuple[int, list[ArchiveRow]]] = []
        total = size = 0
        cursor = self.db.execute("SELECT first, rows, data FROM archive_queue ORDER BY first")
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
        lo, hi = self.db.execute("SELECT min(first), max(last) FROM archive_queue").fetchone()
        return None if lo is None else (lo, hi)

    def archived(self, firsts: Iterable[int]) -> None:
        """Take whole batches (by first seq) out of the archive queue: their rows are in files."""
        keys = [(first,) for first in firsts]
        with self.txn():
            gone = sum(self.db.execute("SELECT rows FROM archive_queue WHERE first=?", k).fetchone()[0] for k in keys)
            self.db.executemany("DELETE FROM archive_queue WHERE first=?", keys)
        self.queued -= gone

    def changed_ids(self, ids: dict[str, str]) -> tuple[dict[str, str], set[str]]:
        """Of topics' ids now (topic -> id): those this store has not noted yet, and the topics
        among them it knew under another id (deleted and created again since)."""
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

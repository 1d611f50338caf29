"""Exactly-once stream processing without Kafka transactions: state store + outbox + recovery scan.

Both stream stages (``ingest`` and ``reward``) use this module; it is stage logic, not a wire
contract, so it lives here and ``reward`` imports it. The full write-up is docs/exactly-once.md.

The protocol, per consumed batch (one *shard* = one input partition number; records keyed by
``generation_id`` put a generation, its feedback, episode and reward on the same number):

1. **Process** - in ONE SQLite transaction (WAL, ``synchronous=FULL``): apply the batch to the
   stage's state tables, append every record the batch produces (outputs and dead letters) to the
   ``outbox`` with a fresh sequence number, queue the records bound for a Parquet archive in
   ``archive_queue`` under the same numbers (one entry per batch, or per 64 MiB of a larger one),
   and store the input offsets
   (``next offset`` per input topic-partition). Either all of it is durable or none of it.
2. **Deliver** - send every outbox row with a header ``flywheel-outbox: <epoch>:<seq>`` to an
   explicitly computed partition (the default key partitioner for keyed records, so shard ``p``'s
   outputs land in partition ``p`` when partition counts match). Acks are collected on the next
   loop turns (pipelining: the loop does not stall on the broker); an acked row is deleted from
   the outbox in one transaction that also remembers each output partition's ``next offset``
   (the *confirmed point*; before a shard's first send to an output partition, the partition's
   end then). A row whose send failed stays, and its shard is settled by the recovery scan below
   before anything is resent; until then that output partition's confirmed point is frozen,
   because the failed row may have landed and the scan starts at that point.
3. **Archive** - queued rows are written out when ``archive_max_rows`` of them wait or the oldest
   has waited ``archive_max_age_s`` (and at shutdown): one Parquet file per archive and hour,
   named after the store's epoch and the rows' sequence range, written atomically (temp file,
   fsync, rename, fsync of the folder), then the rows leave the queue. Batching them is what keeps the archive to a few
   files an hour: one file per loop turn made tens of thousands of tiny files an hour at a
   modest rate, which no Parquet reader lists and opens quickly. Before the first write after a
   start, the files are asked which queued rows they already hold (a crash between the rename
   and the delete), and those leave the queue unwritten.
4. Commit the input offsets to the consumer group too. That commit is informational (lag tools);
   the store's offsets are the truth.

**Where a restart resumes.** When a partition is (re)assigned, the consumer seeks to the offsets in
the store (the end of the last committed transaction), never to the group's committed offsets
(those give a partition the store never read its start, which is stored before any of its records
is read: StreamRunner._store_starts). Before delivering anything new for that
shard, :meth:`Outbox.recover` settles the undelivered outbox rows: it reads every output partition
they could have gone to from its confirmed point to the high watermark, collects the outbox
headers found there, and deletes the rows already delivered. The rest is delivered normally. A
send that fails while running settles its shard the same way before any resend. The archive
queue belongs to the store, not to a shard: it is settled against the files once per start.
Offsets and confirmed points belong to one topic: the store keeps each topic's id, and a topic
deleted and created again under its name (a new id) is read from its start, as an input, and
scanned from its start, as an output.

Why ``kill -9`` at any moment loses and duplicates nothing:

- before step 1 commits: nothing happened; the batch is re-read from the stored offsets.
- between 1 and 2: the rows are in the outbox; recovery finds which (if any) reached the topic,
  and sends only the others.
- after 2: the rows are gone from the outbox; the input offsets already point past the batch.
- around 3: the rows stay queued until the delete after the rename commits; files found holding
  them settle them before anything is written again.

Inputs are deduplicated by id in the stage's state, so an upstream duplicate is folded too.

**On a real Kafka cluster** the same code is correct (it relies only on acks, headers and reading a
partition). One caveat: a request still in flight from the dead process could land after the
recovery scan (bounded by ``request.timeout.ms``; waiting that long before the scan closes it).
Scale-out across machines needs no shared database: each process owns fixed shards with a data_dir
of its own, and shard claims (ingest/claims.py) refuse overlaps. Only automatic failover of a
shard to another machine would need the state tables in a shared database (the SQL is portable to
PostgreSQL) and fencing of the previous owner; that is not built. On a cluster, Kafka transactions
(``send_offsets_to_transaction`` + ``read_committed`` consumers) can replace steps 2 and 4 and the
recovery scan; the embedded broker cannot filter aborted records, which is why this design is the
default here.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import sqlite3
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple, Protocol

import msgspec
from kafka import TopicPartition
from kafka.errors import KafkaError

from flywheel.bus import OutputProducer, RecordRefused, high_watermarks, read_to_end, topic_ids
from flywheel.kafka_batches import unreadable_batch
from flywheel.settings import SettingsError
from ingest.partitioner import out_partition, out_partitions

log = logging.getLogger(__name__)

OUTBOX_HEADER = "flywheel-outbox"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS offsets (
    topic TEXT NOT NULL, part INTEGER NOT NULL, next INTEGER NOT NULL, PRIMARY KEY (topic, part));
CREATE TABLE IF NOT EXISTS outbox (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, shard INTEGER NOT NULL, topic TEXT NOT NULL,
    key TEXT, value BLOB NOT NULL,
    -- written by stores before archive_queue existed; start-up moves such rows to the queue
    archive TEXT, archived INTEGER NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS outbox_shard ON outbox (shard);
-- one entry per processed batch (per QUEUE_ENTRY_BYTES of a larger one): its archive rows,
-- msgpack [[seq, archive, value], ...]. A row per record cost three times as much to insert, read back and delete.
CREATE TABLE IF NOT EXISTS archive_queue (
    first INTEGER PRIMARY KEY, last INTEGER NOT NULL, rows INTEGER NOT NULL, data BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS shard_marks (
    shard INTEGER NOT NULL, topic TEXT NOT NULL, part INTEGER NOT NULL, next INTEGER NOT NULL,
    PRIMARY KEY (shard, topic, part));
-- every partition count an output topic was sent to with: recovery looks for a row wherever
-- any of them put it (partitions added to a topic move where keyed records hash)
CREATE TABLE IF NOT EXISTS out_parts (topic TEXT NOT NULL, n INTEGER NOT NULL, PRIMARY KEY (topic, n));
-- the id of each topic as this store last read or wrote it: one deleted and created again under
-- its name has another, and the offsets and confirmed points kept for the old one mean nothing
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
        self._next_seq = 1  # set from the database below, once the schema exists
        # autocommit mode: transactions are opened explicitly by txn(), nothing implicit.
        self.db = sqlite3.connect(str(path), isolation_level=None, timeout=30.0)
        self.db.execute("PRAGMA journal_mode=WAL")
        # FULL: a committed transaction survives power loss too, not just a process crash; an
        # input batch re-read after a lost commit would get new outbox ids and be sent twice.
        self.db.execute("PRAGMA synchronous=FULL")
        # Some builds (Debian's among them) default to ON, which rewrites every freed page with
        # zeros: the outbox frees a batch's pages as soon as Kafka acks it, so that doubled the
        # cost of each delete. FAST zeroes only what costs no extra I/O.
        self.db.execute("PRAGMA secure_delete=FAST")
        self.db.executescript(_SCHEMA + stage_schema)
        with self.txn():
            row = self.db.execute("SELECT v FROM meta WHERE k='epoch'").fetchone()
            if row is None:
                self.db.execute("INSERT INTO meta VALUES ('epoch', ?)", (uuid.uuid4().hex[:12],))
            # Outbox rows of a store written before the archive queue existed still carry their
            # archive: queue them (the archive settles them against the files first, as after a
            # crash, so rows that store had archived are not written again).
            legacy = [(s, a, bytes(v)) for s, a, v in self.db.execute(
                "SELECT seq, archive, value FROM outbox WHERE archive IS NOT NULL AND archived=0 ORDER BY seq")]
            if legacy:
                self.db.execute("INSERT INTO archive_queue VALUES (?, ?, ?, ?)",
                                (legacy[0][0], legacy[-1][0], len(legacy), _encode_queue(legacy)))
            self.db.execute("UPDATE outbox SET archive=NULL WHERE archive IS NOT NULL")
            # Every send since this version is preceded by its (shard, partition)'s confirmed
            # point (Outbox._mark_first_sends), so a partition with none was never sent to by
            # that shard and the recovery scan can pass it by. A store with rows owed from an
            # older version may have sent some without one: it is marked once it has none.
            if self.db.execute("SELECT 1 FROM meta WHERE k='marks_first'").fetchone() is None and \
                    self.db.execute("SELECT 1 FROM outbox LIMIT 1").fetchone() is None:
                self.db.execute("INSERT INTO meta VALUES ('marks_first', '1')")
        self.epoch: str = self.db.execute("SELECT v FROM meta WHERE k='epoch'").fetchone()[0]
        #: Whether a (shard, topic, partition) without a confirmed point was never sent to.
        self.marks_first: bool = self.db.execute("SELECT 1 FROM meta WHERE k='marks_first'").fetchone() is not None
        self._in_txn = False
        # Sequence numbers are given here rather than by SQLite, so an output and its archive
        # row share one; sqlite_sequence still records the highest ever used, so none is reused.
        row = self.db.execute("SELECT seq FROM sqlite_sequence WHERE name='outbox'").fetchone()
        self._next_seq = (row[0] if row else 0) + 1
        #: Rows in the archive queue, and when (monotonic) the oldest of them was queued: a queue
        #: found at start counts as due at once.
        self.queued: int = self.db.execute("SELECT coalesce(sum(rows), 0) FROM archive_queue").fetchone()[0]
        self.queued_since: float = float("-inf")
        #: Rows in the outbox, owed to Kafka (kept by the transactions that add and delete them).
        self.owed = self.db.execute("SELECT count(*) FROM outbox").fetchone()[0]

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

    def pending_keys(self, shards: Iterable[int]) -> list[tuple[int, int, str, str | None]]:
        """``(seq, shard, topic, key)`` of every row owed by ``shards``: what recovery needs,
        without the values (a long outage can leave more of them than fit in memory)."""
        rows: list[tuple[int, int, str, str | None]] = []
        for shard in sorted(set(shards)):
            rows += self.db.execute("SELECT seq, shard, topic, key FROM outbox WHERE shard=? ORDER BY seq",
                                    (shard,)).fetchall()
        return rows

    def queued_batches(self, rows: int) -> list[tuple[int, list[ArchiveRow]]]:
        """The oldest queued batches, whole, until they hold at least ``rows`` rows or
        ``ARCHIVE_WRITE_BYTES`` bytes (or all of them): ``(first seq, its rows in seq order)`` each."""
        max_bytes = ARCHIVE_WRITE_BYTES
        out: list[tuple[int, list[ArchiveRow]]] = []
        total = size = 0
        cursor = self.db.execute("SELECT first, rows, data FROM archive_queue ORDER BY first")
        try:
            for first, n, data in cursor:
                out.append((first, [ArchiveRow(*r) for r in _decode_queue(data)]))
                total += n
                size += len(data)
                if total >= rows or size >= max_bytes:
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

    def mark_delivered(self, seqs: Iterable[int], marks: dict[tuple[int, str, int], int]) -> None:
        """Delete delivered rows; move each ``(shard, topic, partition)`` confirmed point."""
        with self.txn():
            # acks come back mostly in seq order: one range delete per run of consecutive seqs
            # costs about half of a delete per row
            self._owed_change -= self.db.executemany("DELETE FROM outbox WHERE seq BETWEEN ? AND ?",
                                                     seq_runs(seqs)).rowcount
            # A shard's acks from one partition come in offset order, so a lower one means the
            # topic was recreated while the stage ran: the point follows it down. (Lower is always
            # safe: the recovery scan only reads more.)
            self.db.executemany(
                "INSERT INTO shard_marks VALUES (?, ?, ?, ?) ON CONFLICT (shard, topic, part) "
                "DO UPDATE SET next=excluded.next",
                [(sh, t, p, n) for (sh, t, p), n in marks.items()],
            )

    def forget_marks(self, topics: Iterable[str]) -> None:
        """Confirmed points of recreated ``topics`` back to 0: nothing is known of the new topic,
        so a recovery scan reads it from its start. Call inside :meth:`txn`."""
        assert self._in_txn, "marks are forgotten in the transaction that notes the new topic ids"
        self.db.executemany("UPDATE shard_marks SET next=0 WHERE topic=?", [(t,) for t in topics])

    def first_marks(self, marks: dict[tuple[int, str, int], int]) -> None:
        """Confirmed points for ``(shard, topic, partition)``s that have none (see
        :meth:`Outbox._mark_first_sends`); one that has a point keeps it."""
        with self.txn():
            self.db.executemany("INSERT INTO shard_marks VALUES (?, ?, ?, ?) ON CONFLICT (shard, topic, part) DO NOTHING",
                                [(sh, t, p, n) for (sh, t, p), n in marks.items()])

    def changed_ids(self, ids: dict[str, str]) -> tuple[dict[str, str], set[str]]:
        """Of topics' ids now (topic -> id): those this store has not noted yet, and the topics
        among them it knew under another id (deleted and created again since)."""
        known = dict(self.db.execute("SELECT topic, id FROM topic_ids"))
        changed = {t: i for t, i in ids.items() if known.get(t) != i}
        return changed, {t for t in changed if t in known}

    def note_topic_ids(self, ids: dict[str, str]) -> None:
        """Remember topics' ids (topic -> id). Call inside :meth:`txn`: in the same transaction as
        what a recreated topic resets, or a crash between the two would leave the reset undone
        under an id that no longer tells."""
        assert self._in_txn, "topic ids are noted in the transaction that acts on them"
        self.db.executemany("INSERT INTO topic_ids VALUES (?, ?) ON CONFLICT (topic) DO UPDATE SET id=excluded.id",
                            list(ids.items()))

    def note_partitions(self, topic: str, n: int) -> None:
        """Remember that rows are sent to ``topic`` keyed by ``n`` partitions (before they are)."""
        with self.txn():
            self.db.execute("INSERT INTO out_parts VALUES (?, ?) ON CONFLICT DO NOTHING", (topic, n))

    def partition_counts(self, topic: str) -> set[int]:
        """Every partition count rows were sent to ``topic`` with."""
        return {n for (n,) in self.db.execute("SELECT n FROM out_parts WHERE topic=?", (topic,))}

    def marked(self) -> set[tuple[int, str, int]]:
        """Every ``(shard, topic, partition)`` with a confirmed point."""
        return {(sh, t, p) for sh, t, p in self.db.execute("SELECT shard, topic, part FROM shard_marks")}

    def out_mark(self, shard: int, topic: str, part: int) -> int | None:
        """Where shard ``shard``'s unconfirmed records in ``topic[part]`` can start; None when
        the shard never sent there (see :attr:`marks_first`; 0 for an older store's rows).

        Per shard, not per partition: several shards write to one output partition (dead letters
        keyed off-partition), and another shard's acks must not move this shard's point past a
        record of its own that landed unacknowledged before a crash.
        """
        row = self.db.execute(
            "SELECT next FROM shard_marks WHERE shard=? AND topic=? AND part=?", (shard, topic, part)
        ).fetchone()
        if row is not None:
            return row[0]
        return None if self.marks_first else 0

    def outbox_id(self, seq: int) -> str:
        return f"{self.epoch}:{seq}"


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


class ShardMismatch(SettingsError):
    """A state store started for shards other than those it holds the state of."""


def _shards_label(shards: Sequence[int]) -> str:
    return ",".join(map(str, sorted(shards))) or "all (consumer group)"


class Archive(Protocol):
    """Where rows appended with ``archive`` set are also written (see ingest/archive.py)."""

    def write(self, epoch: str, rows: list[ArchiveRow]) -> None: ...

    def archived_seqs(self, epoch: str, lo: int, hi: int) -> set[int]: ...


class OutputUnavailable(RuntimeError):
    """An output topic's partition count is unknown: the broker does not answer (or the topic is
    gone). Rows for it stay in the outbox until a later turn finds it."""


class Outbox:
    """Delivers outbox rows to Kafka and the archive queue to the archives; settles both after a crash.

    ``archive_max_rows`` / ``archive_max_age_s``: the queue is written out when this many rows
    wait, or when the oldest has waited this long (:meth:`archive`).
    """

    def __init__(
        self,
        store: StateStore,
        producer: OutputProducer,
        bootstrap: str,
        archives: dict[str, Archive] | None = None,
        flush_timeout_s: float = 30.0,
        max_in_flight: int = 50_000,
        archive_max_rows: int = 50_000,
        archive_max_age_s: float = 300.0,
    ) -> None:
        self.store = store
        self.producer = producer
        self.bootstrap = bootstrap
        self.archives = archives or {}
        self.flush_timeout_s = flush_timeout_s
        self.max_in_flight = max_in_flight
        self.archive_max_rows = archive_max_rows
        self.archive_max_age_s = archive_max_age_s
        # queued rows found in the archive files at the first write since start (None: not yet
        # asked); only a crash between a file's rename and its rows' dequeue leaves any
        self._done: set[int] | None = None
        self._parts: dict[str, int] = {}
        self._checked: set[str] = set()  # output topics whose identity this run has checked
        self._marked = store.marked()
        self._in_flight: dict[int, int] = {}  # seq -> shard, for rows sent and not yet reported
        self._suspect: set[int] = set()  # shards with a failed send, to settle before resending
        # seq -> (shard, first failure) of rows whose sends failed and that have not landed since:
        # a row the broker refuses every time (too large for the topic) must show as a stall
        self._failing: dict[int, tuple[int, float]] = {}
        # Output partitions whose confirmed point must not move: a failed send there may still
        # have landed, and the recovery scan starts at the confirmed point. Advancing it past the
        # failed row (on a later row's ack) would hide that row from the scan and resend it.
        self._frozen: set[tuple[str, int]] = set()
        #: Why the last delivery stopped short of the pending rows (None while nothing holds them).
        self.blocked: str | None = None
        self._progress = time.monotonic()  # the last ack or report, or when sending began after idle

    def partitions(self, topic: str) -> int:
        """``topic``'s partition count (cached: it may only grow, and the outbox keys by it; kept
        in the store too, for :meth:`recover` after partitions are added)."""
        if topic not in self._parts:
            parts = self.producer.partitions(topic)
            if not parts:
                raise OutputUnavailable(f"no partition metadata for {topic}: the broker does not answer")
            self.store.note_partitions(topic, parts)
            self._parts[topic] = parts
        return self._parts[topic]

    def _check_topics(self, topics: Iterable[str]) -> None:
        """Once per run and output topic, before recovering or sending anything to it: was it
        deleted and created again since this store last wrote to it? Its confirmed points then
        name offsets of the old topic, and a recovery scan from them would miss rows that landed
        below them in the new one (and send them twice): they go back to 0."""
        todo = set(topics) - self._checked
        if not todo:
            return
        changed, recreated = self.store.changed_ids(topic_ids(self.bootstrap, todo, client_id="flywheel-outbox"))
        if changed:
            with self.store.txn():
                self.store.forget_marks(recreated)
                self.store.note_topic_ids(changed)
            if recreated:
                log.warning("output topics %s were recreated since this store last wrote to them: their "
                            "confirmed points start over at 0", sorted(recreated))
        self._checked |= todo

    def stuck_s(self) -> float:
        """Seconds owed outputs have waited without any ack or report, or a row has failed to
        land since its first failed send, whichever is longer (0 with none owed).

        Rows in flight are acked continuously while the broker is healthy; a stalled or
        unreachable broker leaves them waiting, or holds the pending rows back, and this grows.
        So it does while the broker refuses one row at every try (MESSAGE_TOO_LARGE: the topic's
        ``max.message.bytes`` is below the record), however well the other rows go.
        """
        now = time.monotonic()
        failing = now - min(since for _, since in self._failing.values()) if self._failing else 0.0
        if not self._in_flight and self.blocked is None:
            return failing
        return max(failing, now - self._progress)

    @property
    def in_flight(self) -> int:
        """Rows sent whose acks have not been collected yet."""
        return len(self._in_flight)

    def deliver(self, shards: Iterable[int], wait: bool = False) -> int:
        """Send the pending rows of ``shards`` without waiting for their acks.

        Acks are collected on later calls (or now with ``wait``): a row leaves the outbox only
        once Kafka acked it, so the loop keeps processing while the broker acks the previous
        batch. Returns how many rows were confirmed delivered by this call.
        """
        shards = set(shards)
        if self._suspect & shards:  # a send failed: it may still have landed, so settle first
            self.recover(self._suspect & shards)
            self._suspect -= shards
        # rows are appended in seq order, so new work is above the highest seq in flight
        after = max(self._in_flight) if self._in_flight else -1
        rows = self.store.pending(shards, limit=max(0, self.max_in_flight - len(self._in_flight)), after=after)
        blocked = None
        if rows:
            if not self._in_flight and self.blocked is None:
                self._progress = time.monotonic()  # owed from now on
            send, epoch, header = self.producer.send, self.store.epoch, OUTBOX_HEADER
            counts: dict[str, int] = {}  # partition count of each topic the rows go to
            for i, row in enumerate(rows):
                if row.topic not in counts:
                    try:
                        counts[row.topic] = self.partitions(row.topic)
                    except OutputUnavailable as exc:
                        # stop here, in seq order: this row and the ones after it go on a later turn
                        blocked = str(exc)
                        rows = rows[:i]
                        break
            oids = [f"{epoch}:{row.seq}" for row in rows]  # StateStore.outbox_id, inlined: once per output
            # keyed rows by their key, dead letters by their id (ingest/partitioner.py), in one pass
            parts = out_partitions([(oid if row.key is None else row.key).encode("utf-8") for row, oid in zip(rows, oids)],
                                   [counts[row.topic] for row in rows])
            planned = list(zip(rows, oids, parts))
            try:
                self._check_topics({row.topic for row, _, _ in planned})
                self._mark_first_sends({(row.shard, row.topic, part) for row, _, part in planned})
            except (KafkaError, TimeoutError) as exc:
                blocked = f"no topic id or end offset for an output this run has not written to yet: {exc}"
                planned = []
            for row, oid, part in planned:
                try:
                    send(row.seq, row.topic, part, row.key, row.value, [(header, oid.encode())])
                except RecordRefused as exc:
                    # It never left the client, so nothing needs settling; it stays owed, and
                    # stalled, until the limit is raised, while the rows after it go on.
                    if row.seq not in self._failing:
                        log.error("outbox row %d (%d bytes to %s) is refused by the producer: %s", row.seq,
                                  len(row.value), row.topic, exc)
                        self._failing[row.seq] = (row.shard, time.monotonic())
                    continue
                self._in_flight[row.seq] = row.shard  # after: a send that raised is still pending
        self._set_blocked(blocked)
        if wait or len(self._in_flight) >= self.max_in_flight:
            try:
                self.producer.flush(self.flush_timeout_s)
            except TimeoutError:
                if wait:
                    raise
                # the broker is slow to ack: keep the loop turning, the acks are reaped later
                log.debug("%d sends still unacknowledged after %ss", len(self._in_flight), self.flush_timeout_s)
        return self._reap()

    def release(self, shards: Iterable[int]) -> None:
        """Forget the failed rows of ``shards``, no longer ours: their new owner delivers them."""
        gone = set(shards)
        if self._failing and gone:
            self._failing = {seq: f for seq, f in self._failing.items() if f[0] not in gone}

    def _mark_first_sends(self, targets: set[tuple[int, str, int]]) -> None:
        """Give each ``(shard, topic, partition)`` about to get its first record a confirmed point:
        the partition's end now, stored before the send.

        Without one, a recovery scan after a crash between that send and its ack would start at
        offset 0 and read the whole partition, however long it is (a new store, a shard new to
        this store, on topics holding months of records). Nothing of this shard can be in the
        partition above its end today: none of its records has been sent there yet.
        """
        new = targets - self._marked
        if not new:
            return
        # a short wait: the loop waits with it, and a broker that does not answer holds the rows
        # back (blocked) until a later turn, as an unknown partition count does
        ends = high_watermarks(self.bootstrap, {TopicPartition(t, p) for _, t, p in new},
                               client_id="flywheel-outbox", timeout_s=5.0)
        self.store.first_marks({(sh, t, p): ends[TopicPartition(t, p)] for sh, t, p in new})
        self._marked |= new

    def _set_blocked(self, reason: str | None) -> None:
        if reason is not None and self.blocked is None:
            log.warning("outputs held in the outbox: %s; retrying every loop turn", reason)
        elif reason is None and self.blocked is not None:
            log.info("outputs flowing again")
        self.blocked = reason

    def flush(self, timeout_s: float | None = None) -> int:
        """Wait for every send in flight and settle it (before shards move, and at shutdown), up
        to ``timeout_s`` (default ``flush_timeout_s``)."""
        self.producer.flush(self.flush_timeout_s if timeout_s is None else timeout_s)
        return self._reap()

    def _reap(self) -> int:
        done: list[int] = []
        marks: dict[tuple[int, str, int], int] = {}
        failed: list[int] = []
        reports = self.producer.reports()
        if reports:
            self._progress = time.monotonic()
            # every partition with a failure of this lot first: an ack listed before a failure to
            # the same partition must not move its confirmed point past the failed record either
            self._frozen.update((topic, part) for _, topic, part, _, error in reports if error is not None)
        for seq, topic, part, offset, error in reports:
            shard = self._in_flight.pop(seq, None)
            if shard is None:
                continue  # not ours any more (cannot happen while one Outbox owns the producer)
            if error is not None:
                if not failed:  # one line per turn: a stall fails every send in flight at once
                    log.warning("send of outbox row %d failed (%s); settling before a resend", seq, error)
                self._failing.setdefault(seq, (shard, time.monotonic()))
                self._suspect.add(shard)
                failed.append(seq)
                continue
            done.append(seq)
            if (topic, part) not in self._frozen and offset + 1 > marks.get((shard, topic, part), 0):
                marks[(shard, topic, part)] = offset + 1
        if done:
            self.store.mark_delivered(done, marks)
            if self._failing:
                for seq in done:
                    self._failing.pop(seq, None)
        if len(failed) > 1:
            log.warning("%d sends failed in all (rows %d-%d), shards %s to settle", len(failed), min(failed),
                        max(failed), sorted(self._suspect))
        if failed and self._in_flight:
            # drain, so the failed rows (below the highest seq in flight) are read again
            self.producer.flush(self.flush_timeout_s)
            return len(done) + self._reap()
        return len(done)

    def archive(self, force: bool = False) -> int:
        """Write the archive queue out when it is due (or now, with ``force``); returns rows written.

        Due: ``archive_max_rows`` rows wait, or the oldest has waited ``archive_max_age_s``. Whole
        queued batches are written about ``archive_max_rows`` rows at a time, each time as one file
        per archive and hour, and leave the queue in one transaction after their files are
        renamed into place.
        """
        store = self.store
        if not store.queued or not self.archives:
            return 0
        age = time.monotonic() - store.queued_since
        if not force and store.queued < self.archive_max_rows and age < self.archive_max_age_s:
            return 0
        written = 0
        try:
            if self._done is None:
                self._done = self._archived_before()
            while store.queued and (batches := store.queued_batches(self.archive_max_rows)):
                by_archive: dict[str, list[ArchiveRow]] = {}
                for _, rows in batches:
                    for row in rows:
                        if row.seq not in self._done:
                            by_archive.setdefault(row.archive, []).append(row)
                for name, todo in by_archive.items():
                    self.archives[name].write(store.epoch, todo)
                    written += len(todo)
                store.archived(first for first, _ in batches)
                if not force and store.queued < self.archive_max_rows:
                    break  # the rest are younger than the limit: they wait for the next turn
        except BaseException:
            self._done = None  # files may hold rows still queued: ask them again next time
            raise
        return written

    def _archived_before(self) -> set[int]:
        """Queued rows a previous run wrote to a file but did not take out of the queue.

        Batches leave the queue oldest first, so every row an archive file holds within the
        queue's seq span is a queued row: no need to decode the queue to ask.
        """
        span = self.store.queued_span()
        if span is None:
            return set()
        found: set[int] = set()
        for archive in self.archives.values():
            found |= archive.archived_seqs(self.store.epoch, *span)
        log.info("archive queue: %d of %d rows were already in the archive files", len(found), self.store.queued)
        return found

    def recover(self, shards: Iterable[int]) -> int:
        """Settle rows a crashed run may have delivered; returns how many were found in Kafka."""
        rows = [r for r in self.store.pending_keys(shards) if r[0] not in self._in_flight]
        if not rows:
            return 0
        self._check_topics({topic for _, _, topic, _ in rows})
        wanted: dict[tuple[str, int], set[str]] = {}
        start: dict[tuple[str, int], int] = {}
        by_id: dict[str, int] = {}
        counts: dict[str, set[int]] = {}
        marks: dict[tuple[int, str, int], int | None] = {}
        for seq, shard, topic, key in rows:
            oid = self.store.outbox_id(seq)
            if topic not in counts:  # a row sent before partitions were added went by the old count
                counts[topic] = self.store.partition_counts(topic) | {self.partitions(topic)}
            for tp in {(topic, out_partition(key, oid, n)) for n in counts[topic]}:
                if (shard, *tp) not in marks:
                    marks[(shard, *tp)] = self.store.out_mark(shard, *tp)
                mark = marks[(shard, *tp)]
                if mark is None:  # this shard never sent to that partition: nothing of it is there
                    continue
                wanted.setdefault(tp, set()).add(oid)
                start[tp] = min(start.get(tp, mark), mark)
            by_id[oid] = seq
        found = self._scan(wanted, start) if wanted else set()
        # The confirmed points do not move here: the next delivery advances them.
        self.store.mark_delivered([by_id[o] for o in found], {})
        for oid in found:
            self._failing.pop(by_id[oid], None)
        if not self._suspect - set(shards):  # no failed row is left unsettled anywhere
            self._frozen.clear()
        log.info("recovery: %d of %d outbox rows were already delivered", len(found), len(rows))
        return len(found)

    def _scan(self, wanted: dict[tuple[str, int], set[str]], start: dict[tuple[str, int], int],
              timeout_s: float = 60.0) -> set[str]:
        """Read each output partition from ``start`` (confirmed points) to the high watermark."""
        found: set[str] = set()
        starts = {TopicPartition(t, p): start[(t, p)] for t, p in wanted}
        for tp, rec in read_to_end(self.bootstrap, starts, client_id="flywheel-recovery", timeout_s=timeout_s):
            if rec.headers and (marker := unreadable_batch(rec.headers)) is not None:
                log.error("recovery: %s; the outbox rows sent there are not confirmed, so they are sent again",
                          marker.describe(tp.topic, tp.partition))
                continue
            for name, val in rec.headers or ():
                # (another client may write the header name with no value, or bytes that are
                # no outbox id of ours: neither is a record this store sent)
                if name == OUTBOX_HEADER and val is not None:
                    oid = val.decode("utf-8", "replace")
                    if oid in wanted[(tp.topic, tp.partition)]:
                        found.add(oid)
        return found

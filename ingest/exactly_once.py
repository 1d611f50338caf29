"""Exactly-once stream processing without Kafka transactions: state store + outbox + recovery scan.

Both stream stages (``ingest`` and ``reward``) use this module; it is stage logic, not a wire
contract, so it lives here and ``reward`` imports it. The full write-up is docs/exactly-once.md.

The protocol, per consumed batch (one *shard* = one input partition number; records keyed by
``generation_id`` put a generation, its feedback, episode and reward on the same number):

1. **Process** - in ONE SQLite transaction (WAL, ``synchronous=FULL``): apply the batch to the
   stage's state tables, append every record the batch produces (outputs and dead letters) to the
   ``outbox`` with a fresh sequence number, and store the input offsets (``next offset`` per input
   topic-partition). Either all of it is durable or none of it.
2. **Archive** - outbox rows bound for a Parquet archive are written to a file named after the
   store's epoch and the rows' sequence range, atomically (temp file + rename). The files are
   the record of what is archived: rows are marked ``archived`` only when their send fails
   and by the recovery below.
3. **Deliver** - send every outbox row with a header ``flywheel-outbox: <epoch>:<seq>`` to an
   explicitly computed partition (the default key partitioner for keyed records, so shard ``p``'s
   outputs land in partition ``p`` when partition counts match). Acks are collected on the next
   loop turns (pipelining: the loop does not stall on the broker); an acked row is deleted from
   the outbox in one transaction that also remembers each output partition's ``next offset``
   (the *confirmed point*). A row whose send failed stays, and its shard is settled by the
   recovery scan below before anything is resent; until then that output partition's confirmed
   point is frozen, because the failed row may have landed and the scan starts at that point.
4. Commit the input offsets to the consumer group too. That commit is informational (lag tools);
   the store's offsets are the truth.

**Where a restart resumes.** When a partition is (re)assigned, the consumer seeks to the offsets in
the store (the end of the last committed transaction), never to the group's committed offsets
(used only when the store has none, i.e. a fresh store). Before delivering anything new for that
shard, :meth:`Outbox.recover` settles the undelivered outbox rows: it reads every output partition
they could have gone to from its confirmed point to the high watermark, collects the outbox
headers found there, and deletes the rows already delivered; it reads the archive files whose
sequence range overlaps rows not marked archived and marks the ones found. The rest is delivered
normally. A send that fails while running settles its shard the same way before any resend.

Why ``kill -9`` at any moment loses and duplicates nothing:

- before step 1 commits: nothing happened; the batch is re-read from the stored offsets.
- between 1 and 3: the rows are in the outbox; recovery finds which (if any) reached the topic
  and the archive, and sends only the others.
- after 3: the rows are gone from the outbox; the input offsets already point past the batch.

Inputs are deduplicated by id in the stage's state, so an upstream duplicate is folded too.

**On a real Kafka cluster** the same code is correct (it relies only on acks, headers and reading a
partition), with two caveats: a request still in flight from the dead process could land after the
recovery scan (bounded by ``request.timeout.ms``; waiting that long before the scan closes it), and
scale-out across machines needs the state tables in a shared database (the SQL is portable to
PostgreSQL). There, Kafka transactions (``send_offsets_to_transaction`` + ``read_committed``
consumers) can replace steps 3-4 and the recovery scan; the embedded broker cannot filter aborted
records, which is why this design is the default here.
"""

from __future__ import annotations

import logging
import sqlite3
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple, Protocol

from kafka import TopicPartition
from kafka.partitioner.default import murmur2

from flywheel.bus import OutputProducer, read_to_end
from flywheel.settings import SettingsError

log = logging.getLogger(__name__)

OUTBOX_HEADER = "flywheel-outbox"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS offsets (
    topic TEXT NOT NULL, part INTEGER NOT NULL, next INTEGER NOT NULL, PRIMARY KEY (topic, part));
CREATE TABLE IF NOT EXISTS outbox (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, shard INTEGER NOT NULL, topic TEXT NOT NULL,
    key TEXT, value BLOB NOT NULL, archive TEXT, archived INTEGER NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS outbox_shard ON outbox (shard);
CREATE TABLE IF NOT EXISTS shard_marks (
    shard INTEGER NOT NULL, topic TEXT NOT NULL, part INTEGER NOT NULL, next INTEGER NOT NULL,
    PRIMARY KEY (shard, topic, part));
"""


class OutRow(NamedTuple):
    """One outbox entry: a record the stage owes to a topic (and maybe to an archive).

    A named tuple rather than a frozen dataclass: one is built per output record, and a frozen
    dataclass's ``__init__`` costs several times more.
    """

    seq: int
    shard: int
    topic: str
    key: str | None
    value: bytes
    archive: str | None
    archived: bool


class StateStore:
    """A stage's durable state: SQLite in WAL mode holding offsets, outbox and the stage's tables."""

    def __init__(self, path: Path, stage_schema: str = "") -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        # outbox rows of the open transaction, inserted in one executemany just before COMMIT
        self._appends: list[tuple[int, str, str | None, bytes, str | None]] = []
        self._on_rollback: list[Callable[[], None]] = []
        # autocommit mode: transactions are opened explicitly by txn(), nothing implicit.
        self.db = sqlite3.connect(str(path), isolation_level=None, timeout=30.0)
        self.db.execute("PRAGMA journal_mode=WAL")
        # FULL: a committed transaction survives power loss too, not just a process crash; an
        # input batch re-read after a lost commit would get new outbox ids and be sent twice.
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.executescript(_SCHEMA + stage_schema)
        with self.txn():
            row = self.db.execute("SELECT v FROM meta WHERE k='epoch'").fetchone()
            if row is None:
                self.db.execute("INSERT INTO meta VALUES ('epoch', ?)", (uuid.uuid4().hex[:12],))
        self.epoch: str = self.db.execute("SELECT v FROM meta WHERE k='epoch'").fetchone()[0]
        self._in_txn = False

    @contextmanager
    def txn(self) -> Iterator[sqlite3.Connection]:
        self.db.execute("BEGIN IMMEDIATE")
        self._in_txn = True
        try:
            yield self.db
            self._write_appends()
        except BaseException:
            self._appends.clear()
            self.db.execute("ROLLBACK")
            for fn in self._on_rollback:  # in-memory caches of state must forget the batch too
                fn()
            raise
        else:
            self.db.execute("COMMIT")
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
        self._appends.append((shard, topic, key, value, archive))

    def _write_appends(self) -> None:
        # one statement per batch instead of one per record; list order keeps seq order
        if self._appends:
            self.db.executemany(
                "INSERT INTO outbox (shard, topic, key, value, archive) VALUES (?, ?, ?, ?, ?)",
                self._appends,
            )
            self._appends.clear()

    # -- reads and bookkeeping ------------------------------------------------------------
    def offsets(self) -> dict[tuple[str, int], int]:
        return {(t, p): n for t, p, n in self.db.execute("SELECT topic, part, next FROM offsets")}

    def pending(self, shards: Iterable[int], limit: int = 20_000, after: int = -1) -> list[OutRow]:
        if limit <= 0:
            return []
        # One query per shard, merged here: each walks the (shard, seq) index in order, where one
        # query over all shards makes SQLite sort every row, blobs included (5x slower).
        rows: list[tuple] = []
        for shard in sorted(set(shards)):
            rows += self.db.execute(
                "SELECT seq, shard, topic, key, value, archive, archived FROM outbox "
                "WHERE shard=? AND seq>? ORDER BY seq LIMIT ?", (shard, after, limit)).fetchall()
        rows.sort()  # seq is unique, so tuples compare on it alone
        return [OutRow(s, sh, t, k, bytes(v), a, bool(ad)) for s, sh, t, k, v, a, ad in rows[:limit]]

    def mark_archived(self, seqs: Iterable[int]) -> None:
        with self.txn():
            self.db.executemany("UPDATE outbox SET archived=1 WHERE seq=?", [(s,) for s in seqs])

    def mark_delivered(self, seqs: Iterable[int], marks: dict[tuple[int, str, int], int]) -> None:
        """Delete delivered rows; move each ``(shard, topic, partition)`` confirmed point."""
        with self.txn():
            # acks come back mostly in seq order: one range delete per run of consecutive seqs
            # costs about half of a delete per row
            self.db.executemany("DELETE FROM outbox WHERE seq BETWEEN ? AND ?", seq_runs(seqs))
            self.db.executemany(
                "INSERT INTO shard_marks VALUES (?, ?, ?, ?) ON CONFLICT (shard, topic, part) "
                "DO UPDATE SET next=max(next, excluded.next)",
                [(sh, t, p, n) for (sh, t, p), n in marks.items()],
            )

    def out_mark(self, shard: int, topic: str, part: int) -> int:
        """Where shard ``shard``'s unconfirmed records in ``topic[part]`` can start.

        Per shard, not per partition: several shards write to one output partition (dead letters
        keyed off-partition), and another shard's acks must not move this shard's point past a
        record of its own that landed unacknowledged before a crash.
        """
        row = self.db.execute(
            "SELECT next FROM shard_marks WHERE shard=? AND topic=? AND part=?", (shard, topic, part)
        ).fetchone()
        return row[0] if row else 0

    def outbox_id(self, seq: int) -> str:
        return f"{self.epoch}:{seq}"


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
    """Where outbox rows with ``archive`` set are also written (see ingest/archive.py)."""

    def write(self, epoch: str, rows: list[OutRow]) -> None: ...

    def archived_seqs(self, epoch: str, lo: int, hi: int) -> set[int]: ...


def out_partition(key: str | None, outbox_id: str, partitions: int) -> int:
    """The partition a record goes to: the default key partitioner, or a stable hash of its id.

    Computed, not left to the producer, so recovery knows exactly which partition to read back.
    """
    data = (key if key is not None else outbox_id).encode("utf-8")
    return (murmur2(data) & 0x7FFFFFFF) % partitions


class Outbox:
    """Delivers outbox rows (archive, then Kafka) and settles them after a crash."""

    def __init__(
        self,
        store: StateStore,
        producer: OutputProducer,
        bootstrap: str,
        archives: dict[str, Archive] | None = None,
        flush_timeout_s: float = 30.0,
        max_in_flight: int = 50_000,
    ) -> None:
        self.store = store
        self.producer = producer
        self.bootstrap = bootstrap
        self.archives = archives or {}
        self.flush_timeout_s = flush_timeout_s
        self.max_in_flight = max_in_flight
        self._parts: dict[str, int] = {}
        self._in_flight: dict[int, int] = {}  # seq -> shard, for rows sent and not yet reported
        self._suspect: set[int] = set()  # shards with a failed send, to settle before resending
        # Output partitions whose confirmed point must not move: a failed send there may still
        # have landed, and the recovery scan starts at the confirmed point. Advancing it past the
        # failed row (on a later row's ack) would hide that row from the scan and resend it.
        self._frozen: set[tuple[str, int]] = set()

    def partitions(self, topic: str) -> int:
        if topic not in self._parts:
            deadline = time.monotonic() + 30
            while not (parts := self.producer.partitions(topic)):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no partitions for topic {topic}")
                time.sleep(0.1)
            self._parts[topic] = parts
        return self._parts[topic]

    @property
    def in_flight(self) -> int:
        """Rows sent whose acks have not been collected yet."""
        return len(self._in_flight)

    def deliver(self, shards: Iterable[int], wait: bool = False) -> int:
        """Archive and send the pending rows of ``shards`` without waiting for their acks.

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
        if rows:
            self._archive(rows)
            send, epoch, header = self.producer.send, self.store.epoch, OUTBOX_HEADER
            for row in rows:
                oid = f"{epoch}:{row.seq}"  # StateStore.outbox_id, inlined: once per output record
                part = out_partition(row.key, oid, self.partitions(row.topic))
                self._in_flight[row.seq] = row.shard
                send(row.seq, row.topic, part, row.key, row.value, [(header, oid.encode())])
        if wait or len(self._in_flight) >= self.max_in_flight:
            self.producer.flush(self.flush_timeout_s)
        return self._reap()

    def flush(self) -> int:
        """Wait for every send in flight and settle it (before shards move, and at shutdown)."""
        self.producer.flush(self.flush_timeout_s)
        return self._reap()

    def _reap(self) -> int:
        done: list[int] = []
        marks: dict[tuple[int, str, int], int] = {}
        failed: list[int] = []
        for seq, topic, part, offset, error in self.producer.reports():
            shard = self._in_flight.pop(seq, None)
            if shard is None:
                continue  # not ours any more (cannot happen while one Outbox owns the producer)
            if error is not None:
                log.warning("send of outbox row %d failed (%s); settling before a resend", seq, error)
                self._suspect.add(shard)
                self._frozen.add((topic, part))
                failed.append(seq)
                continue
            done.append(seq)
            if (topic, part) not in self._frozen and offset + 1 > marks.get((shard, topic, part), 0):
                marks[(shard, topic, part)] = offset + 1
        if done:
            self.store.mark_delivered(done, marks)
        if failed:
            # every row sent was archived first: mark the few that stay, so settling them (maybe
            # much later, if their shard moves away meanwhile) need not read the files back
            self.store.mark_archived(failed)
        if failed and self._in_flight:
            # drain, so the failed rows (below the highest seq in flight) are read again
            self.producer.flush(self.flush_timeout_s)
            return len(done) + self._reap()
        return len(done)

    def _archive(self, rows: list[OutRow]) -> None:
        by_archive: dict[str, list[OutRow]] = {}
        for row in rows:
            if row.archive and not row.archived:
                by_archive.setdefault(row.archive, []).append(row)
        # Not marked archived here: marking rewrites every row, blob included (a third of the
        # archive's cost). A row reaches this point once per run: later calls start above the
        # highest seq in flight, and a row whose send failed is marked by _reap() and settled by
        # recover() before any resend. After a restart, recover() asks the files themselves.
        for name, batch in by_archive.items():
            self.archives[name].write(self.store.epoch, batch)

    def recover(self, shards: Iterable[int]) -> tuple[int, int]:
        """Settle rows a crashed run may have delivered; returns (found in Kafka, found archived)."""
        rows = [r for r in self.store.pending(shards, limit=10**9) if r.seq not in self._in_flight]
        if not rows:
            return 0, 0
        archived = self._recover_archive(rows)
        wanted: dict[tuple[str, int], set[str]] = {}
        start: dict[tuple[str, int], int] = {}
        by_id: dict[str, int] = {}
        for row in rows:
            oid = self.store.outbox_id(row.seq)
            tp = (row.topic, out_partition(row.key, oid, self.partitions(row.topic)))
            wanted.setdefault(tp, set()).add(oid)
            mark = self.store.out_mark(row.shard, *tp)
            start[tp] = min(start.get(tp, mark), mark)
            by_id[oid] = row.seq
        found = self._scan(wanted, start)
        # The confirmed points do not move here: the next delivery advances them.
        self.store.mark_delivered([by_id[o] for o in found], {})
        if not self._suspect - set(shards):  # no failed row is left unsettled anywhere
            self._frozen.clear()
        log.info("recovery: %d of %d outbox rows were already delivered, %d archived",
                 len(found), len(rows), archived)
        return len(found), archived

    def _recover_archive(self, rows: list[OutRow]) -> int:
        todo: dict[str, list[int]] = {}
        for row in rows:
            if row.archive and not row.archived:
                todo.setdefault(row.archive, []).append(row.seq)
        count = 0
        for name, seqs in todo.items():
            done = self.archives[name].archived_seqs(self.store.epoch, min(seqs), max(seqs))
            hit = [s for s in seqs if s in done]
            if hit:
                self.store.mark_archived(hit)
                count += len(hit)
        return count

    def _scan(self, wanted: dict[tuple[str, int], set[str]], start: dict[tuple[str, int], int],
              timeout_s: float = 60.0) -> set[str]:
        """Read each output partition from ``start`` (confirmed points) to the high watermark."""
        found: set[str] = set()
        starts = {TopicPartition(t, p): start[(t, p)] for t, p in wanted}
        for tp, rec in read_to_end(self.bootstrap, starts, client_id="flywheel-recovery", timeout_s=timeout_s):
            for name, val in rec.headers or ():
                if name == OUTBOX_HEADER and val.decode() in wanted[(tp.topic, tp.partition)]:
                    found.add(val.decode())
        return found

"""Delivers a stage's outbox to Kafka, at least once, and its archive queue to Parquet files.

Outbox rows are sent after the transaction that stored them commits, and deleted when Kafka acks
them. A row whose send failed, or that was in flight when the process died, is sent again: a
record may therefore reach its topic twice, and every consumer drops the repeat by the key it
carries (docs/exactly-once.md). The producer picks each record's partition from its key (Kafka's
default murmur2 partitioner, in both clients), so a repeat lands where the original did and the
same consumer shard sees both (dead letters are keyed too: flywheel/stream/deadletters.py).

Acks are collected on later loop turns: the loop keeps processing while the broker acks the
previous batch, with at most ``max_in_flight`` rows sent and unacked.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Protocol

from flywheel.kafka.producers import OutputProducer, RecordRefused
from flywheel.stream.store import ArchiveRow, StateStore

log = logging.getLogger(__name__)


class Archive(Protocol):
    """Where rows appended with ``archive`` set are also written (flywheel/stream/archive.py)."""

    def write(self, epoch: str, rows: list[ArchiveRow]) -> None: ...

    def archived_seqs(self, epoch: str, lo: int, hi: int) -> set[int]: ...


class Outbox:
    """Sends the outbox, deletes what Kafka acked, resends what failed; writes the archive queue.

    ``archive_max_rows`` / ``archive_max_age_s``: the queue is written out when this many rows
    wait, or when the oldest has waited this long (:meth:`archive`).
    """

    def __init__(
        self,
        store: StateStore,
        producer: OutputProducer,
        archives: dict[str, Archive] | None = None,
        flush_timeout_s: float = 30.0,
        max_in_flight: int = 50_000,
        archive_max_rows: int = 50_000,
        archive_max_age_s: float = 300.0,
    ) -> None:
        self.store = store
        self.producer = producer
        self.archives = archives or {}
        self.flush_timeout_s = flush_timeout_s
        self.max_in_flight = max_in_flight
        self.archive_max_rows = archive_max_rows
        self.archive_max_age_s = archive_max_age_s
        # queued rows found in the archive files at the first write since start or since shards
        # were taken over (None: ask at the next write); only a crash between a file's rename
        # and its rows' dequeue leaves any
        self._done: set[int] | None = None
        self._in_flight: dict[int, int] = {}  # seq -> shard, for rows sent and not yet reported
        # seq -> (shard, first failure) of rows whose sends failed and that have not landed since:
        # a row the broker refuses every time (too large for the topic) must show as a stall
        self._failing: dict[int, tuple[int, float]] = {}
        self._progress = time.monotonic()  # the last ack or report, or when sending began after idle

    def stuck_s(self) -> float:
        """Seconds owed outputs have waited without any ack or report, or a row has failed to
        land since its first failed send, whichever is longer (0 with none owed).

        Rows in flight are acked continuously while the broker is healthy; a stalled or
        unreachable broker leaves them waiting, and this grows. So it does while the broker
        refuses one row at every try (MESSAGE_TOO_LARGE: the topic's ``max.message.bytes`` is
        below the record), however well the other rows go.
        """
        now = time.monotonic()
        failing = now - min(since for _, since in self._failing.values()) if self._failing else 0.0
        if not self._in_flight:
            return failing
        return max(failing, now - self._progress)

    @property
    def in_flight(self) -> int:
        """Rows sent whose acks have not been collected yet."""
        return len(self._in_flight)

    def deliver(self, shards: Iterable[int], wait: bool = False) -> int:
        """Send the rows of ``shards`` not in flight, without waiting for their acks (or with
        ``wait``). Returns how many rows Kafka acked since the last call."""
        # rows are appended in seq order, so new work is above the highest seq in flight; a failed
        # row below it is read again once the sends in flight are drained (_reap)
        after = max(self._in_flight) if self._in_flight else -1
        rows = self.store.pending(shards, limit=max(0, self.max_in_flight - len(self._in_flight)), after=after)
        if rows and not self._in_flight:
            self._progress = time.monotonic()  # owed from now on
        send = self.producer.send
        for row in rows:
            try:
                send(row.seq, row.topic, row.key, row.value, row.headers)
            except RecordRefused as exc:
                # It never left the client; it stays owed, and stalled, until the limit is
                # raised, while the rows after it go on.
                if row.seq not in self._failing:
                    log.error("outbox row %d (%d bytes to %s) is refused by the producer: %s", row.seq,
                              len(row.value), row.topic, exc)
                    self._failing[row.seq] = (row.shard, time.monotonic())
                continue
            self._in_flight[row.seq] = row.shard  # after: a send that raised is still pending
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
        """Forget the rows of ``shards``, no longer ours: their new owner sends them."""
        gone = set(shards)
        if gone:
            self._failing = {seq: f for seq, f in self._failing.items() if f[0] not in gone}
            self._in_flight = {seq: sh for seq, sh in self._in_flight.items() if sh not in gone}

    def restart(self) -> None:
        """Forget every row in flight or failing, and what the archive files hold (the state
        database came back after a connection error, which may have cut off the delete of acked
        rows or the dequeue of archived ones): the next :meth:`deliver` reads the owed rows from
        the database again and sends them, the acked ones too (at least once)."""
        self._in_flight.clear()
        self._failing.clear()
        self._done = None

    def flush(self, timeout_s: float | None = None) -> int:
        """Wait for every send in flight and settle it (before shards move, and at shutdown), up
        to ``timeout_s`` (default ``flush_timeout_s``)."""
        self.producer.flush(self.flush_timeout_s if timeout_s is None else timeout_s)
        return self._reap()

    def _reap(self) -> int:
        done: list[int] = []
        failed: list[int] = []
        reports = self.producer.reports()
        if reports:
            self._progress = time.monotonic()
        for seq, error in reports:
            shard = self._in_flight.pop(seq, None)
            if shard is None:
                continue  # released: its shard moved to another owner, who sends it
            if error is not None:
                if not failed:  # one line per turn: a stall fails every send in flight at once
                    log.warning("send of outbox row %d failed (%s); it is sent again", seq, error)
                self._failing.setdefault(seq, (shard, time.monotonic()))
                failed.append(seq)
                continue
            done.append(seq)
        if done:
            self.store.delivered(done)
            if self._failing:
                for seq in done:
                    self._failing.pop(seq, None)
        if len(failed) > 1:
            log.warning("%d sends failed in all (rows %d-%d); they are sent again", len(failed), min(failed),
                        max(failed))
        if failed and self._in_flight:
            # drain, so the failed rows (below the highest seq in flight) are read again
            try:
                self.producer.flush(self.flush_timeout_s)
            except TimeoutError:
                log.debug("draining after a failed send: %d still unacknowledged", len(self._in_flight))
            return len(done) + self._reap()
        return len(done)

    def taken(self, shards: Iterable[int]) -> None:
        """This process took over ``shards`` (a shared store's leases): their previous owner may
        have renamed a file of their queued rows into the shared archive root and died before
        taking them out of the queue, so the files are asked again before the next write."""
        if set(shards):
            self._done = None

    def archive(self, force: bool = False) -> int:
        """Write the archive queue out when it is due (or now, with ``force``); returns rows written.

        Due: ``archive_max_rows`` rows wait, or the oldest has waited ``archive_max_age_s``. Whole
        queued batches are written about ``archive_max_rows`` rows at a time, each time as one file
        per archive and hour, and leave the queue in the transaction that read them, after their
        files are renamed into place.

        That transaction holds the leases of a shared store throughout (its fence locks them): a
        takeover of one of this process's shards waits for the write to end, and finds its rows
        either out of the queue or, had this process died before the commit, in the files
        (:meth:`taken`). A write never overlaps a takeover, so no row is written by two owners.
        On SQLite it holds the one write lock for as long: other replicas' turns wait seconds at most.
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
            while store.queued:
                with store.txn():
                    batches = store.queued_batches(self.archive_max_rows)
                    written += self._write(batches)
                    store.archived(first for first, _ in batches)
                if not batches or (not force and store.queued < self.archive_max_rows):
                    break  # the rest are younger than the limit: they wait for the next turn
        except BaseException:
            self._done = None  # files may hold rows still queued: ask them again next time
            raise
        return written

    def _write(self, batches: list[tuple[int, list[ArchiveRow]]]) -> int:
        """Write the rows of ``batches`` that no file holds yet; returns how many."""
        assert self._done is not None
        by_archive: dict[str, list[ArchiveRow]] = {}
        skipped = 0
        for _, rows in batches:
            for row in rows:
                if row.seq in self._done:
                    skipped += 1
                else:
                    by_archive.setdefault(row.archive, []).append(row)
        if skipped:
            log.info("archive queue: %d of %d rows were already in the archive files; not written again", skipped,
                     skipped + sum(len(todo) for todo in by_archive.values()))
        for name, todo in by_archive.items():
            self.archives[name].write(self.store.epoch, todo)
        return sum(len(todo) for todo in by_archive.values())

    def _archived_before(self) -> set[int]:
        """Queued rows a previous run (or owner) wrote to a file but did not take out of the queue.

        Every queued row a file holds has its seq in the queue's span, so the files of that span
        are asked, without decoding the queue. They may hold other rows of the span too (rows
        already out of the queue; other replicas' rows, on a shared root): seqs never repeat, so
        those match no queued row.
        """
        span = self.store.queued_span()
        if span is None:
            return set()
        found: set[int] = set()
        for archive in self.archives.values():
            found |= archive.archived_seqs(self.store.epoch, *span)
        return found

"""The consume -> process -> deliver loop every stream stage runs on.

A :class:`Stage` holds the stage's rules; :class:`StreamRunner` drives it: on partition
assignment it seeks each input partition to the offset in the state store, then per poll it runs
``stage.process`` and ``stage.tick`` inside one state-store transaction together with the input
offsets (flywheel/stream/store.py), sends the outbox and collects its acks
(flywheel/stream/outbox.py), writes the archive queue out when it is due, and commits the
positions to the consumer group for lag tools.

**When the broker does not answer** (an outage, a stall, a partition without a leader) the loop
keeps turning instead of exiting: a failed turn is retried after a pause, outputs wait in the
outbox, and ``<stage>_stalled_seconds`` and ``/health`` say how long nothing has moved. Nothing
is skipped: broker calls happen outside the state-store transaction (poll before it, delivery
after its commit), so a failed turn leaves the stored state as the last good turn left it.

**When the state database fails** (PostgreSQL restarted, failed over to a server that is
read-only for now, a connection ended, a full disk, a deadlock; SQLite locked, read-only or out
of space) the same: the turn that failed is retried after the pause, once the store has
recovered (on new connections where the error asks for them, flywheel/dberrors.py) and read
again what the failed transaction may have left in memory (``StateStore.reconnect``), and every
owned input partition is read again from its stored offset. One log line names each kind of
error of an outage (its SQLSTATE or SQLite error name and message). Other errors (a bug) still
stop the process, whose restart resumes from the stored state: a database error that says the
statement or its data is wrong (flywheel/dberrors.py ``Bug``: a syntax error, a missing table, a
NUL byte in a text) among them, since waiting cannot fix it.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol, TypeVar

from kafka import KafkaConsumer, TopicPartition
from kafka.consumer.fetcher import ConsumerRecord
from kafka.consumer.subscription_state import ConsumerRebalanceListener
from kafka.errors import KafkaError
from kafka.structs import OffsetAndMetadata
from prometheus_client import CollectorRegistry

from flywheel.contracts import (
    CONTRACT_REASONS,
    MAX_RECORD_BYTES,
    ContractError,
    EpisodeEvent,
    FeedbackEvent,
    GenerationEvent,
    decode,
)
from flywheel.dberrors import Bug, Reconnect, classify
from flywheel.kafka.batches import unreadable_batch
from flywheel.kafka.clients import partitions_of, topic_ids
from flywheel.kafka.ends import readable_end
from flywheel.kafka.headers import unreadable_header
from flywheel.kafka.lag import LagGauge
from flywheel.kafka.security import connection_of
from flywheel.probes import Heartbeat
from flywheel.settings import SettingsError
from flywheel.stream.deadletters import DeadLetters
from flywheel.stream.outbox import Outbox
from flywheel.stream.store import LeaseLost, StateStore

log = logging.getLogger(__name__)

#: Errors of a broker that does not answer (or answers with an error): the loop retries them.
BROKER_ERRORS: tuple[type[BaseException], ...] = (KafkaError, TimeoutError)
try:
    from confluent_kafka import KafkaException

    BROKER_ERRORS += (KafkaException,)
except ImportError:  # pragma: no cover - confluent-kafka is a dependency; kafka-python alone works too
    pass

#: Pause before retrying a turn that failed on the broker.
RETRY_PAUSE_S = 1.0

#: A stop waits at most this long for the acks of sends in flight, and each consumer at most
#: STOP_CLOSE_MS to leave its group: unacked sends stay in the outbox and the next start sends
#: them again, and leaving is best effort, while the whole stop must fit a supervisor's grace period
#: (Kubernetes gives 30 s before SIGKILL). Unbounded, a stop during a broker stall took 29-36 s.
STOP_FLUSH_S = 5.0
STOP_CLOSE_MS = 2000

#: The wall clock moved this much more (or less) than the monotonic clock between two turns: it
#: was stepped (NTP, a VM's clock set, a wrong clock corrected). A stage that keeps waits on it
#: moves them by as much (``clock_stepped``).
CLOCK_STEP_S = 5.0

#: Outbox rows owed to Kafka past which the loop stops reading input until half of them are
#: delivered: while an output cannot be written (a partition without a leader, a deleted topic,
#: missing ACLs) the backlog then waits in the input topics, where lag alerts see it, rather
#: than being copied into the state store's disk. Four times the outbox's sends in flight.
MAX_OWED_ROWS = 200_000

#: The keyed records the stages consume (each carries a generation_id).
E = TypeVar("E", GenerationEvent, FeedbackEvent, EpisodeEvent)

#: The dead-letter reasons :func:`decode_keyed` gives.
KEYED_DECODE_REASONS: tuple[str, ...] = (*CONTRACT_REASONS, "wrong_key", "unreadable_batch")


def decode_keyed(cls: type[E], rec: ConsumerRecord, dead: DeadLetters,
                 max_bytes: int = MAX_RECORD_BYTES) -> E | None:
    """Decode ``rec`` as ``cls`` at the stage's edge, or dead-letter it and return None.

    Besides the contract, the record's key must be its ``generation_id``: both stages rely on
    a generation's records sharing a partition number (see docs/exactly-once.md). A header key
    that is not UTF-8 breaks the Kafka protocol: its producer is broken, so the record is
    ``undecodable`` even when its value is fine. A stand-in for records that could not be read
    from their batch is ``unreadable_batch`` (flywheel/kafka/batches.py).
    """
    if rec.headers and (marker := unreadable_batch(rec.headers)) is not None:
        dead.send_unreadable(rec, marker)
        return None
    if rec.headers and (bad := unreadable_header(rec.headers)) is not None:
        dead.send_record(rec, "undecodable", f"header key {bad.raw!r} is not UTF-8")
        return None
    try:
        event = decode(cls, rec.value, max_bytes=max_bytes)
    except ContractError as exc:
        dead.send_record(rec, exc.reason, exc.detail)
        return None
    # bytes against bytes: a key that is not UTF-8 must not match by way of replacement characters
    if rec.key != event.generation_id.encode("utf-8", "surrogatepass"):
        dead.send_record(rec, "wrong_key", f"key {rec.key!r} is not the generation_id {event.generation_id!r}")
        return None
    return event


class Stage(Protocol):
    def process(self, records: list[ConsumerRecord], now: float) -> None:
        """Apply records to state and append outputs to the outbox (inside the transaction)."""

    def tick(self, shards: set[int], now: float) -> bool | None:
        """Time-driven work for shards whose inputs are caught up (inside the transaction).
        True: it left due work for the next turn, which then does not wait on an idle input."""

    # Optional: ``clock_stepped(by: float) -> None``, called inside the transaction of the first
    # turn after the wall clock stepped ``by`` seconds while the stage ran. A stage that stores
    # times of the wall clock to wait for (ingest's windows) moves them by as much, so that a step
    # neither ends its waits at once (forward) nor stretches them by hours (back).
    #
    # Optional: ``shards_changed(owned: set[int]) -> None``, called between turns when the shards
    # this process owns changed (assigned, revoked, or their leases lost): a stage that caches
    # state in memory (reward's guard counts) loads the owned shards' from a shared store there.


class OutboxDeadLetters(DeadLetters):
    """Dead letters appended to the stage's outbox, so they ride the turn's transaction.

    Each is a row of the partition of the record it is about (the ``partition`` every letter
    names): only the process that owns that partition delivers the row, and after a crash
    recovers it, with the rest of that partition's output. Taken from the letter, not from a
    cursor the stage sets before each record, so a letter raised after other partitions' records
    were handled still goes with its own.
    """

    def __init__(self, store: StateStore, topic: str, stage: str, registry: CollectorRegistry,
                 reasons: Iterable[str] = ()) -> None:
        super().__init__(None, topic, stage, registry, reasons)
        self.store = store

    def _write(self, partition: int | None, key: str | None, value: bytes) -> None:
        if partition is None:
            raise ValueError("a stage's dead letter names its record's partition: its outbox row is that partition's")
        self.store.append(partition, self.topic, key, value)


class StreamRunner(ConsumerRebalanceListener):
    """Runs a stage with exactly-once output, on a consumer group or on fixed ``shards``."""

    def __init__(
        self,
        stage: Stage,
        store: StateStore,
        outbox: Outbox,
        consumer: KafkaConsumer,
        topics: list[str],
        lag: LagGauge,
        max_batch: int,
        poll_ms: int,
        shards: Sequence[int] = (),
        max_owed: int = MAX_OWED_ROWS,
    ) -> None:
        self.stage, self.store, self.outbox, self.consumer = stage, store, outbox, consumer
        # where and how the consumer reads: the topic ids of the inputs are asked there, so
        self.connection = connection_of(consumer.config)
        self.max_owed = max_owed
        self.holding = False  # input paused: the outbox owes max_owed rows
        self.topics, self.lag, self.max_batch, self.poll_ms = topics, lag, max_batch, poll_ms
        self.shards = tuple(sorted(shards))
        self.owned: set[int] = set()
        self._lock = threading.Lock()
        self._assigned: set[TopicPartition] = set()
        self._revoked: set[int] = set()
        self.last_loop = time.monotonic()
        #: beaten when a turn starts and ends: /livez (flywheel/probes.py)
        self.heartbeat = Heartbeat()
        self.records_in = 0
        self.delivered = 0
        self._failing_since: float | None = None  # monotonic: the first of the failed turns in a row
        self._failing_on = ""  # what failed them: "the broker" or "the state database"
        self._failing_codes: set[str] = set()  # the database errors of this outage logged so far
        self._more_due = False  # the last tick left due work: poll without waiting
        self._committed: dict[TopicPartition, int] = {}  # each position last committed to the group
        self._clock: tuple[float, float] | None = None  # (wall, monotonic) at the last committed turn
        store.bind_shards(self.shards)
        if self.shards:
            self._assign_static()
        else:
            consumer.subscribe(topics, listener=self)

    def _assign_static(self) -> None:
        """Own ``shards`` of every input outright: no group membership, so no rebalances.

        The partitions are set up by the loop like a group assignment (seek to the stored
        offsets, resume); the group id still receives offset commits for lag
        tools. Every shard must exist in every input, or the join would silently miss records.
        """
        for topic in self.topics:
            parts = partitions_of(self.consumer, topic)
            missing = [p for p in self.shards if p not in parts]
            if missing:
                raise SettingsError(f"shards {missing} are not partitions of {topic} "
                                    f"(it has {len(parts)}: 0-{len(parts) - 1})")
        tps = [TopicPartition(t, p) for t in self.topics for p in self.shards]
        self.consumer.assign(tps)
        self.consumer.pause(*tps)
        self._assigned = set(tps)

    # -- rebalance ------------------------------------------------------------------------
    # kafka-python calls these on its network thread, which must not touch the store (SQLite is
    # per thread) or block. New partitions are paused here and set up by the loop thread before
    # any of their records is processed: seek to the stored offsets, resume.
    def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        with self._lock:
            self._revoked |= {tp.partition for tp in revoked}

    def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        self.consumer.pause(*assigned)
        with self._lock:
            self._assigned |= set(assigned)

    def _settle_rebalance(self) -> None:
        with self._lock:
            revoked, self._revoked = self._revoked, set()
            assigned, self._assigned = self._assigned, set()
        try:
            self._settle(revoked, assigned)
        except BaseException:
            with self._lock:  # settled again on the next turn: every step of it can be repeated
                self._revoked |= revoked
                self._assigned |= assigned
            raise

    def _settle(self, revoked: set[int], assigned: set[TopicPartition]) -> None:
        if revoked:
            self.delivered += self.outbox.flush()  # settle what is in flight while these shards are still ours
            self.outbox.release(revoked)
            self.store.release(revoked)
        before = set(self.owned)
        self.owned -= revoked
        self._committed = {tp: n for tp, n in self._committed.items() if tp.partition not in revoked}
        assigned = {tp for tp in assigned if tp in self.consumer.assignment()}
        if not assigned:
            self._shards_changed(before)
            return
        shards = {tp.partition for tp in assigned}
        if self.store.shared:
            # Leases first: whoever held these shards fails its next transaction from here on, and
            # (on PostgreSQL) one in progress has committed before take() returns, so the offsets
            # and state read below are all it left. The sends it had in flight are drained, so
            # that what it left in the outbox, with lower seqs, is read by deliver() below. Its
            # archive write in progress has ended too (it holds the leases): the files are asked
            # again for the queued rows it renamed into place and did not dequeue.
            self.store.take(shards)
            self.outbox.taken(shards)
            self.delivered += self.outbox.flush()
        stored = self._restart_recreated(assigned, self.store.offsets())
        if new := {tp: (tp.topic, tp.partition) for tp in assigned if (tp.topic, tp.partition) not in stored}:
            stored.update(self._store_starts(new))
        for tp in assigned:
            self.consumer.seek(tp, stored[(tp.topic, tp.partition)])
        # what a previous owner stored and did not see acked is sent again (at least once)
        self.delivered += self.outbox.deliver(shards)
        self.owned |= shards
        # on a shared store, after every take: shards revoked and given back in one settle leave
        # ``owned`` as it was, while another replica may have changed their state meanwhile
        self._shards_changed(before, taken=self.store.shared)
        self.consumer.resume(*assigned)
        log.info("assigned shards %s; resuming at %s", sorted(shards),
                 {f"{t}[{p}]": n for (t, p), n in stored.items() if p in shards})

    def _shards_changed(self, before: set[int], taken: bool = False) -> None:
        # a broken store cannot be read: _recover calls the hook once it is back
        if ((taken or self.owned != before) and self.store.broken is None
                and (hook := getattr(self.stage, "shards_changed", None))):
            hook(set(self.owned))

    def _lose(self, lost: LeaseLost) -> None:
        """Another process took the leases of ``lost.shards`` (the group moved their partitions and
        this process has not heard yet: a stall, a slow rebalance): stop processing them at once.
        The turn that found out was rolled back.

        Then ask the group for a rebalance. Usually this process is a member the group already
        left behind, and rejoins anyway. But a process that settled an assignment of a generation
        the group had already moved past takes leases the group gives to another: then the group
        still assigns the partitions here, no rebalance would come, and they would stay paused,
        processed by nobody (a whole-loop fault run saw partitions unowned for minutes). The
        rebalance settles every member's assignment again, and each takes the leases of its own."""
        log.warning("%s: dropping them and asking the group for a rebalance", lost)
        before = set(self.owned)
        self.owned -= lost.shards
        self.outbox.release(lost.shards)
        self.store.release(lost.shards)
        self._committed = {tp: n for tp, n in self._committed.items() if tp.partition not in lost.shards}
        self.consumer.pause(*[tp for tp in self.consumer.assignment() if tp.partition in lost.shards])
        self._shards_changed(before)
        if not self.shards:  # a group member (fixed shards have no group to ask)
            request_rejoin(self.consumer)

    def _restart_recreated(self, assigned: set[TopicPartition],
                           stored: dict[tuple[str, int], int]) -> dict[tuple[str, int], int]:
        """``stored`` offsets, with every partition of an input topic deleted and created again
        since this store read it (a new topic id) back at 0, stored so in the transaction that
        notes the new id.

        Stored offsets of the old topic point past records of the new one, all of them once it
        has grown past them: read from there, they were lost without a trace.
        """
        parts = {(tp.topic, tp.partition) for tp in assigned}
        changed, recreated = self.store.changed_ids(
            topic_ids(self.connection, {tp.topic for tp in assigned}, client_id="flywheel-inputs"), parts)
        if not changed:
            return stored
        # a shared store's other partitions are other processes' to restart, when they see it
        mine = parts if self.store.shared else [*stored, *parts]
        restart = {key: 0 for key in mine if key[0] in recreated}
        with self.store.txn():
            self.store.set_offsets(restart)
            self.store.note_topic_ids(changed)
        if recreated:
            log.error("input topics %s were recreated since this store read them: reading them again from their "
                      "start (stored offsets were %s)", sorted(recreated),
                      {f"{t}[{p}]": n for (t, p), n in stored.items() if t in recreated})
        return {**stored, **restart}

    def _store_starts(self, new: dict[TopicPartition, tuple[str, int]]) -> dict[tuple[str, int], int]:
        """Where this store starts partitions it never read: the group's committed offset (a
        store replacing a lost one goes on where it left off), else ``auto_offset_reset``;
        stored before any of their records is read.

        From then on only this store moves them. Left to the group, a partition that moved away
        before the store read a record of it (a rebalance soon after a start, or while its first
        records were on their way) came back at whatever offset the group held then, and any
        other member of the group (an operator's consumer under the stage's group id) could
        have committed past records this store never saw.
        """
        starts: dict[tuple[str, int], int] = {}
        for tp, key in new.items():
            offset = self.consumer.position(tp, timeout_ms=10_000)
            if offset is None:
                raise TimeoutError(f"no start offset for {tp.topic}[{tp.partition}]: the broker does not answer")
            starts[key] = offset
        with self.store.txn():
            self.store.set_offsets(starts)
        log.info("first read of %s: starting at %s", sorted(f"{t}[{p}]" for t, p in starts),
                 {f"{t}[{p}]": n for (t, p), n in starts.items()})
        return starts

    # -- loop -----------------------------------------------------------------------------
    def caught_up(self, positions: dict[TopicPartition, int | None] | None = None) -> set[int]:
        """Shards whose every input partition is read up to where its last fetch said it can be
        read (the high watermark, or the last stable offset below an open transaction)."""
        if positions is None:
            positions = self.positions()
        behind: set[int] = set()
        for tp, pos in positions.items():
            high = readable_end(self.consumer, tp)
            if high is None or pos is None or pos < high:
                behind.add(tp.partition)
        return {tp.partition for tp in positions} - behind

    def positions(self) -> dict[TopicPartition, int | None]:
        """The consumer's position in each input partition of an owned shard (None: unknown)."""
        out: dict[TopicPartition, int | None] = {}
        for tp in self.consumer.assignment():
            if tp.partition in self.owned:
                try:
                    out[tp] = self.consumer.position(tp, timeout_ms=100)
                except Exception:  # noqa: BLE001 - position is unknown during a rebalance: not caught up
                    out[tp] = None
        return out

    def _hold_input(self) -> None:
        """Pause the owned input partitions while the outbox owes ``max_owed`` rows, until it owes
        half of that (polling goes on, so the group keeps this member; windows still close)."""
        owed = self.store.owed
        if not self.holding and owed >= self.max_owed:
            self.holding = True
            log.warning("the outbox owes %d rows (limit %d): input paused until half are delivered", owed,
                        self.max_owed)
        elif self.holding and owed <= self.max_owed // 2:
            self.holding = False
            log.info("the outbox owes %d rows: input resumed", owed)
            self.consumer.resume(*[tp for tp in self.consumer.assignment() if tp.partition in self.owned])
        if self.holding:  # every turn: partitions assigned since are resumed by their settling
            self.consumer.pause(*[tp for tp in self.consumer.assignment() if tp.partition in self.owned])

    def step(self) -> int:
        try:
            return self._step()
        except LeaseLost as lost:
            self._lose(lost)
            return 0

    def _step(self) -> int:
        self._settle_rebalance()
        self._hold_input()
        # While sends await their acks, poll briefly: an idle input must not hold delivered
        # records in the outbox for a whole poll_ms.
        timeout = 0 if self._more_due else min(self.poll_ms, 10) if self.outbox.in_flight else self.poll_ms
        batches = self.consumer.poll(timeout_ms=timeout, max_records=self.max_batch)
        if self._assigned or self._revoked:
            # a rebalance happened inside poll: its partitions may have been re-seeked, so drop
            # this batch (nothing was stored) and read again from settled positions
            self._settle_rebalance()
            current = self.consumer.assignment()
            for tp, recs in batches.items():
                if tp in current and recs:
                    self.consumer.seek(tp, recs[0].offset)
            return 0
        batches = {tp: recs for tp, recs in batches.items() if tp.partition in self.owned}
        records = [r for recs in batches.values() for r in recs]
        offsets = {(tp.topic, tp.partition): recs[-1].offset + 1 for tp, recs in batches.items() if recs}
        now, mono = time.time(), time.monotonic()
        stepped = 0.0 if self._clock is None else (now - self._clock[0]) - (mono - self._clock[1])
        positions = self.positions()  # past this batch, and past any transaction markers behind it
        ready = self.caught_up(positions)
        with gc_paused():
            try:
                with self.store.txn():
                    if abs(stepped) >= CLOCK_STEP_S and (shift := getattr(self.stage, "clock_stepped", None)):
                        log.warning("the wall clock stepped %+.0f s since the last turn: moving the stage's "
                                    "waits by as much", stepped)
                        shift(stepped)
                    if records:
                        self.stage.process(records, now)
                        self.store.set_offsets(offsets)
                    more_due = bool(self.stage.tick(ready, now))
            except BaseException:
                # rolled back: read the batch again, whether the turn is retried or the process ends
                for tp, recs in batches.items():
                    if recs:
                        self.consumer.seek(tp, recs[0].offset)
                raise
            self._more_due = more_due
            self._clock = (now, mono)  # after the commit: a shift rolled back is made again
            self.delivered += self.outbox.deliver(self.owned)
            self.outbox.archive()
        self._commit_positions(positions)
        self.lag.update(self.consumer)
        self.last_loop = time.monotonic()
        self.records_in += len(records)
        return len(records)

    def _commit_positions(self, positions: dict[TopicPartition, int | None]) -> None:
        """Commit to the consumer group each position that moved since it was last committed.

        The store's offsets are the truth; the group's are for lag tools, and for a store made
        afresh (``_store_starts``). The positions, not the last record read plus one: past a
        transaction's commit marker (a control record no poll hands out), a commit of the last
        record read plus one would show a lag of 1 on the partition for good. Every position is
        at most the batch just stored ends at, or past markers only.
        """
        moved = {tp: pos for tp, pos in positions.items() if pos is not None and self._committed.get(tp) != pos}
        if moved:
            self.consumer.commit_async({tp: OffsetAndMetadata(pos, "", -1) for tp, pos in moved.items()})
            self._committed.update(moved)

    def run(self, stop: StopFlag, check: Callable[[], None] | None = None) -> None:
        """Step until ``stop``; ``check()`` runs before every step and stops the loop by raising
        (the shard claims, flywheel/stream/claims.py)."""
        while not stop.is_set():
            if check is not None:
                check()
            self.heartbeat.beat()
            try:
                if self.store.broken is not None:
                    self._recover()
                self.step()
            except BROKER_ERRORS as exc:
                self._failed_turn(exc, stop, "the broker")
            except self.store.lost_errors as exc:
                if isinstance(classify(exc), Bug):  # waiting cannot fix the statement: stop (docstring)
                    raise
                self.store.lost(exc)
                self._failed_turn(exc, stop, "the state database")
            else:
                if self._failing_since is not None:
                    log.info("%s answers again after %.0fs", self._failing_on, time.monotonic() - self._failing_since)
                self._failing_since = None
                self._failing_codes.clear()
            self.heartbeat.beat()
        self.finish()

    def _recover(self) -> None:
        """Before the next turn after the state database's connection was lost: reconnect, and
        settle what the failed turn may have left half done. Its transaction may have committed
        or not (a COMMIT whose answer was lost), so every owned partition is read again from its
        stored offset; rows acked whose delete failed, or in flight, are sent again (readers drop
        the repeats by key). Raises a connection error while the database does not answer."""
        self.store.reconnect()
        self.outbox.restart()
        stored = self.store.offsets()
        for tp in self.consumer.assignment():
            if tp.partition in self.owned and (at := stored.get((tp.topic, tp.partition))) is not None:
                self.consumer.seek(tp, at)
        if hook := getattr(self.stage, "shards_changed", None):  # skipped while it was broken
            hook(set(self.owned))

    def _failed_turn(self, exc: BaseException, stop: StopFlag, on: str) -> None:
        now = time.monotonic()
        # the database: once per kind of error in an outage (read-only, then refused while it
        # fails over, say), so the log names each without a line per retry
        new_code = on == "the state database" and classify(exc).code not in self._failing_codes
        if self._failing_since is None or on != self._failing_on or new_code:
            self._failing_since = self._failing_since if self._failing_since is not None else now
            self._failing_on = on
            if on == "the broker":
                log.warning("a turn failed on the broker (%s: %s); retrying every %.0fs until it answers",
                            type(exc).__name__, exc, RETRY_PAUSE_S)
            else:
                self._failing_codes.add(classify(exc).code)
                log.warning("the state database failed a turn (%s); %s every %.0fs until it works",
                            self.store.describe(exc),
                            "reconnecting and retrying" if isinstance(classify(exc), Reconnect) else "retrying",
                            RETRY_PAUSE_S)
        else:
            log.debug("still failing on %s: %s: %s", on, type(exc).__name__, exc)
        self.last_loop = now  # the loop is alive; stalled_s() says that it is not getting anywhere
        end = now + RETRY_PAUSE_S
        while not stop.is_set() and time.monotonic() < end:
            time.sleep(0.05)

    def stalled_s(self) -> float:
        """Seconds the stage has made no progress with the broker or the state database: turns
        failing in a row, or outputs owed with no ack (0 while it is fine)."""
        failing = 0.0 if self._failing_since is None else time.monotonic() - self._failing_since
        return max(failing, self.outbox.stuck_s())

    def finish(self) -> None:
        """Deliver what is in flight and write the archive queue out: a clean stop leaves
        nothing behind in the outbox or the queue (but for sends the broker did not ack, which
        the next start sends again)."""
        with gc_paused():
            try:
                self.delivered += self.outbox.flush(STOP_FLUSH_S)
            except BROKER_ERRORS as exc:
                log.warning("stopping with %d sends unacknowledged (%s); the next start sends them again",
                            self.outbox.in_flight, exc)
            except self.store.lost_errors as exc:
                log.warning("stopping with the state database not answering (%s): the owed rows and the "
                            "archive queue wait in it for the next start", exc)
                return
            try:
                self.outbox.archive(force=True)
            except LeaseLost as lost:  # their new owner writes them
                log.warning("stopping with archive rows of shards moved away unwritten: %s", lost)
            except self.store.lost_errors as exc:
                log.warning("stopping with the archive queue unwritten, the state database not answering (%s)", exc)

    def healthy(self, stale_s: float = 60.0) -> tuple[bool, dict[str, object]]:
        """Ready: a turn finished, and progress made with the broker, within ``stale_s``
        (``probes.stale_s``); a turn still running past it makes the stage unready, not dead."""
        age, stalled = time.monotonic() - self.last_loop, self.stalled_s()
        return age < stale_s and stalled < stale_s, {
            "loop_age_s": round(age, 3), "stalled_s": round(stalled, 3), "shards": sorted(self.owned),
            "records_in": self.records_in, "delivered": self.delivered, "owed": self.store.owed,
            "input_paused": self.holding}


def request_rejoin(consumer: KafkaConsumer) -> None:
    """Make ``consumer`` rejoin its group at its next poll: a rebalance of every member.
    kafka-python has no public call for it; its coordinator's ``request_rejoin`` is what a
    metadata change of a subscribed topic calls."""
    coordinator = getattr(consumer, "_coordinator", None)
    if coordinator is None or not hasattr(coordinator, "request_rejoin"):  # pragma: no cover - another client
        log.warning("this Kafka client cannot be asked to rejoin its group: the next rebalance settles it")
        return
    coordinator.request_rejoin()


@contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection while a batch is processed and sent.

    A batch allocates tens of thousands of short-lived objects (decoded events, rows, send
    futures) that reference counting frees. With the collector on, a collection every 700
    allocations walks the batch's live objects again and again: 10-15% of the stage's CPU in
    bench/ingest_throughput.py. Whatever cycles a batch leaves are collected after it.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class StopFlag(Protocol):
    def is_set(self) -> bool: ...

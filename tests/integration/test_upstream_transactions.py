"""Input topics written by *transactional* producers (confluent-kafka with ``transactional.id``),
on the real broker.

A committed transaction leaves a control record (its commit marker) in every partition it
wrote: the data records' offsets have gaps, and a partition's high watermark sits one past a
marker that no consumer ever receives as a record. What depends on that: the ingest stage's
``caught_up`` (join windows close only on shards read up to their high watermark), the lag
gauge, the stored and committed input offsets, a restart from them, the readers to the high
watermark (the dead-letter tools') and the trainer's offset book.

Aborted transactions appear only where the test does not depend on a consumer filtering their
records out, which the embedded broker cannot do (local/broker.py). It does hold back the
records of a transaction still open from a ``read_committed`` consumer (the last stable offset),
which the last test relies on.
"""

from __future__ import annotations

import logging
import time
import uuid
from contextlib import closing
from pathlib import Path

import pytest
from confluent_kafka import Producer as ConfluentProducer
from conftest import accept_feedback, read_all, small_generation, stage_settings
from kafka import TopicPartition
from kafka.coordinator.assignors.range import RangePartitionAssignor
from kafka.partitioner.default import murmur2
from relay_helpers import Crash

from flywheel.contracts import EpisodeEvent, decode, encode
from flywheel.kafka.clients import high_watermarks, make_consumer, read_to_end
from flywheel.kafka.lag import LagGauge
from flywheel.kafka.producers import make_output_producer
from flywheel.metrics import new_registry
from flywheel.stream.outbox import Outbox
from flywheel.stream.runner import StreamRunner
from flywheel.stream.store import StateStore
from ingest.stage import SCHEMA, IngestStage
from trainer.batching import OffsetBook

pytestmark = pytest.mark.integration
WINDOW_S = 1.0
PARTITIONS = 2  # the kafka_settings fixture's


def partition_of(key: str) -> int:
    """The partition the default (Java, kafka-python) partitioner gives ``key``."""
    return (murmur2(key.encode()) & 0x7FFFFFFF) % PARTITIONS


def ids_in(partition: int, n: int, prefix: str = "g") -> list[str]:
    return [g for g in (f"{prefix}{i}" for i in range(10_000)) if partition_of(g) == partition][:n]


def producer_of(kafka_settings, kind: str) -> ConfluentProducer:
    """A confluent-kafka producer as a product's service would run one: ``transactional``
    (transactions initialised) or ``idempotent``."""
    conf = {"bootstrap.servers": kafka_settings.bootstrap, "linger.ms": 0, "enable.idempotence": True,
            "logger": logging.getLogger("confluent_kafka.test")}
    if kind == "transactional":
        conf["transactional.id"] = f"product-{uuid.uuid4().hex[:8]}"
    producer = ConfluentProducer(conf)
    if kind == "transactional":
        producer.init_transactions(10)
    return producer


def send_generation(producer: ConfluentProducer, topics, gid: str, t: float) -> None:
    producer.produce(topics.generations, encode(small_generation(gid, t)), gid, partition=partition_of(gid))


def send_accept(producer: ConfluentProducer, topics, gid: str, t: float) -> None:
    producer.produce(topics.feedback, encode(accept_feedback(f"f-{gid}", gid, t)), gid, partition=partition_of(gid))


def in_transaction(producer: ConfluentProducer, kind: str, sends) -> None:
    """``sends(producer)`` in one committed transaction (or, idempotent, just sent and flushed)."""
    if kind == "transactional":
        producer.begin_transaction()
    sends(producer)
    if kind == "transactional":
        producer.commit_transaction(10)
    else:
        assert producer.flush(10) == 0


def name(tp: TopicPartition) -> str:
    """``generations[0]``: a partition named without the test's topic prefix."""
    return f"{tp.topic.rsplit('.', 1)[-1]}[{tp.partition}]"


def ends(kafka_settings, topics) -> dict[TopicPartition, int]:
    tps = [TopicPartition(t, p) for t in (topics.generations, topics.feedback) for p in range(PARTITIONS)]
    return high_watermarks(kafka_settings, tps, client_id="test")


class Ingest:
    """The ingest stage on a :class:`StreamRunner`, turned by the test's thread (SQLite objects
    belong to the thread that made them)."""

    def __init__(self, kafka_settings, topics, data_dir: Path, group: str, max_batch: int) -> None:
        settings = stage_settings(kafka_settings, topics, data_dir, FLYWHEEL_INGEST_WINDOW_S=str(WINDOW_S),
                                  FLYWHEEL_INGEST_GRACE_S="0", FLYWHEEL_INGEST_ORPHAN_WAIT_S=str(WINDOW_S))
        self.topics, self.registry = topics, new_registry()
        self.store = StateStore(data_dir / "ingest" / "state.sqlite3", SCHEMA)
        self.outbox = Outbox(self.store, make_output_producer(kafka_settings, "ingest"))
        self.consumer = make_consumer(kafka_settings, "ingest", group,
                                      partition_assignment_strategy=[RangePartitionAssignor])
        self.runner = StreamRunner(IngestStage(settings.ingest, topics, self.store, self.registry), self.store,
                                   self.outbox, self.consumer, [topics.generations, topics.feedback],
                                   LagGauge("ingest", self.registry), max_batch, 50)

    def turn_until(self, done, timeout_s: float = 20.0, what: str = "") -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            assert time.monotonic() < deadline, (
                f"not done in {timeout_s}s: {what} (read {self.runner.records_in} records, delivered "
                f"{self.runner.delivered}, caught up {sorted(self.runner.caught_up())}, owned {sorted(self.runner.owned)}, "
                f"positions {self.positions()}, high watermarks {self.highs()})")
            self.runner.step()

    def turn_for(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.runner.step()

    def positions(self) -> dict[str, int | None]:
        return {name(tp): self.consumer.position(tp) for tp in self.consumer.assignment()}

    def highs(self) -> dict[str, int | None]:
        return {name(tp): self.consumer.highwater(tp) for tp in self.consumer.assignment()}

    def lag(self) -> dict[str, float | None]:
        self.runner.lag.update(self.consumer, every_s=0)
        return {name(TopicPartition(t, p)): self.registry.get_sample_value(
            "ingest_consumer_lag_records", {"topic": t, "partition": str(p)})
            for t in (self.topics.generations, self.topics.feedback) for p in range(PARTITIONS)}

    def close(self) -> None:
        self.runner.finish()
        self.consumer.close(autocommit=False)
        self.outbox.producer.close()
        self.store.close()


def episodes(kafka_settings, topics, expect: int | None = None) -> list[EpisodeEvent]:
    return [decode(EpisodeEvent, r.value)
            for r in read_all(kafka_settings.bootstrap, topics.episodes, expect=expect, timeout_s=10 if expect else 1.5)]


def produce_joined(kafka_settings, topics, kind: str, n_per_partition: int) -> tuple[list[str], int]:
    """One transaction per generation (with an accept of it for every other one, in the same
    transaction): ``(generation ids, data records sent)``."""
    gids = [g for p in range(PARTITIONS) for g in ids_in(p, n_per_partition)]
    producer = producer_of(kafka_settings, kind)
    t, sent = time.time(), 0
    for i, gid in enumerate(gids):
        def sends(to: ConfluentProducer, gid=gid, i=i) -> None:
            send_generation(to, topics, gid, t)
            if i % 2 == 0:
                send_accept(to, topics, gid, t)
        in_transaction(producer, kind, sends)
        sent += 1 + (i % 2 == 0)
    assert producer.flush(10) == 0
    del producer  # its threads stop with it, before the broker does
    return gids, sent


def assert_joined_once(kafka_settings, topics, gids: list[str]) -> None:
    eps = episodes(kafka_settings, topics, expect=len(gids))
    got = sorted(e.generation_id for e in eps)
    assert got == sorted(gids), f"episodes {got} for generations {sorted(gids)}"
    for e in eps:
        i = gids.index(e.generation_id)
        want = ("accept", (f"f-{e.generation_id}",), False) if i % 2 == 0 else ("ignore", (), True)
        assert (e.signal, e.feedback_ids, e.timed_out) == want, e.generation_id
    letters = read_all(kafka_settings.bootstrap, topics.deadletter, timeout_s=1.0)
    assert letters == [], [r.value[:200] for r in letters]


# -- committed transactions -------------------------------------------------------------------
# an idempotent producer's records carry no markers: the transactional run holds the rule, and
# the idempotent one runs in the slow suite (5-6 s)
@pytest.mark.parametrize("kind", ["transactional", pytest.param("idempotent", marks=pytest.mark.slow)])
def test_records_of_committed_transactions_are_joined_once_and_every_window_closes(
        kafka_settings, topics, tmp_path, kind):
    """Each generation (and the accept of every other one) in a transaction of its own: every
    partition holds a commit marker after each record, and ends with one. One record per batch,
    so every batch ends right before a marker. Each record is read once, every window closes
    (the generations without feedback only close once their shard counts as caught up), the
    shards end caught up and the lag gauge at 0. The idempotent producer (no markers) as a control."""
    gids, sent = produce_joined(kafka_settings, topics, kind, n_per_partition=4)
    end = ends(kafka_settings, topics)
    if kind == "transactional":  # the markers are there: each partition's end is past its records
        assert sum(end.values()) == 2 * sent, end
    ingest = Ingest(kafka_settings, topics, tmp_path, f"{topics.prefix}ingest", max_batch=1)
    try:
        ingest.turn_until(lambda: ingest.runner.delivered >= len(gids), what=f"{len(gids)} episodes")
        ingest.turn_for(0.5)  # nothing more is emitted or read
        assert ingest.runner.records_in == sent
        assert ingest.runner.caught_up() == {0, 1}, (ingest.positions(), ingest.highs())
        assert set(ingest.lag().values()) == {0.0}, ingest.lag()
        assert_joined_once(kafka_settings, topics, gids)
    finally:
        ingest.close()


def test_the_group_offsets_reach_the_end_of_partitions_that_end_in_a_commit_marker(
        kafka_settings, topics, tmp_path):
    """The offsets the stage commits to its consumer group are there for external lag tools
    (docs/exactly-once.md, step 5; the runbooks' drain waits for the lag to reach 0). A stage
    that has read everything must have committed each partition's end: a commit one short of it
    (at the last marker) shows a lag of 1 on every such partition for good."""
    gids, _ = produce_joined(kafka_settings, topics, "transactional", n_per_partition=2)
    end = ends(kafka_settings, topics)
    ingest = Ingest(kafka_settings, topics, tmp_path, f"{topics.prefix}ingest", max_batch=100)
    try:
        ingest.turn_until(lambda: ingest.runner.delivered >= len(gids), what=f"{len(gids)} episodes")
        ingest.turn_for(1.0)  # the commits are asynchronous: sent on later turns
        assert ingest.runner.caught_up() == {0, 1} and set(ingest.lag().values()) == {0.0}
        committed = {name(tp): ingest.consumer.committed(tp) for tp in end}
        want = {name(tp): n for tp, n in end.items()}
        assert committed == want, (
            f"group offsets {committed}, partition ends {want}: external lag tools see the stage behind "
            "by the commit marker of each partition's last transaction")
    finally:
        ingest.close()


@pytest.mark.slow  # a fault run (a stage stopped and started again mid-stream): 8-12 s of the default suite
def test_a_restart_resumes_past_the_markers_reading_nothing_twice(kafka_settings, topics, tmp_path):
    """The stored offsets point at the commit markers after the last records read. A restart on
    the same store seeks there: it reads no record again, emits nothing again, counts as caught
    up, and the next transactions' records are read once each."""
    gids, _ = produce_joined(kafka_settings, topics, "transactional", n_per_partition=2)
    first = Ingest(kafka_settings, topics, tmp_path, f"{topics.prefix}ingest", max_batch=3)
    try:
        first.turn_until(lambda: first.runner.delivered >= len(gids), what=f"{len(gids)} episodes")
    finally:
        first.close()

    # a group of its own: the store's offsets, not the group's, say where it resumes (and the
    # embedded broker's groups that all members left may not complete a later join)
    second = Ingest(kafka_settings, topics, tmp_path, f"{topics.prefix}ingest2", max_batch=3)
    try:
        second.turn_until(lambda: second.runner.caught_up() == {0, 1}, what="caught up after the restart")
        second.turn_for(WINDOW_S + 0.5)
        assert (second.runner.records_in, second.runner.delivered) == (0, 0)
        assert set(second.lag().values()) == {0.0}, second.lag()
        more = [ids_in(p, 1, prefix="more")[0] for p in range(PARTITIONS)]
        producer = producer_of(kafka_settings, "transactional")
        t = time.time()
        in_transaction(producer, "transactional", lambda to: [send_generation(to, topics, g, t) for g in more])
        del producer
        second.turn_until(lambda: second.runner.delivered >= len(more), what="the episodes after the restart")
        second.turn_for(0.5)
        assert second.runner.records_in == len(more)
    finally:
        second.close()
    got = sorted(e.generation_id for e in episodes(kafka_settings, topics, expect=len(gids) + len(more)))
    assert got == sorted(gids + more)


# -- aborted transactions, where no filtering is asked for -------------------------------------
def test_partitions_that_end_in_an_abort_marker_still_count_as_caught_up(kafka_settings, topics, tmp_path):
    """Committed generations, then on every partition of both inputs a transaction that is
    aborted after its records reached the broker: each partition ends in an abort marker. (Whether
    the aborted records are read is not asked here: the embedded broker cannot filter them.) The
    committed generations' windows close once each, the shards count as caught up, lag 0."""
    gids = [g for p in range(PARTITIONS) for g in ids_in(p, 2)]
    producer = producer_of(kafka_settings, "transactional")
    t = time.time()
    in_transaction(producer, "transactional", lambda to: [send_generation(to, topics, g, t) for g in gids])
    producer.begin_transaction()
    for gid in (ids_in(p, 1, prefix="aborted")[0] for p in range(PARTITIONS)):
        send_generation(producer, topics, gid, t)
        send_accept(producer, topics, gid, t)
    assert producer.flush(10) == 0  # landed, then aborted
    producer.abort_transaction(10)
    del producer
    ingest = Ingest(kafka_settings, topics, tmp_path, f"{topics.prefix}ingest", max_batch=2)
    try:
        ingest.turn_until(lambda: ingest.runner.delivered >= len(gids) and ingest.runner.caught_up() == {0, 1},
                          what="the committed generations' episodes")
        ingest.turn_for(WINDOW_S + 0.5)  # (the aborted records' episodes, read here as the broker gives them)
        assert ingest.runner.caught_up() == {0, 1}, (ingest.positions(), ingest.highs())
        assert set(ingest.lag().values()) == {0.0}, ingest.lag()
    finally:
        ingest.close()
    got = [e.generation_id for e in episodes(kafka_settings, topics) if e.generation_id in gids]
    assert sorted(got) == sorted(gids)


# -- a transaction still open ------------------------------------------------------------------
def test_a_transaction_still_open_is_not_joined_and_holds_no_window_back(kafka_settings, topics, tmp_path):
    """A product service has begun a transaction (a generation and its accept are on the broker)
    and not committed it yet: it may still abort it. The stage must not join what may be rolled
    back (it does not read it before the commit), and other generations of the same shard must
    not wait for that commit either: their windows close as usual. After the commit its episode
    comes, once."""
    ok, pending = ids_in(0, 2)
    t = time.time()
    committed = producer_of(kafka_settings, "transactional")
    in_transaction(committed, "transactional", lambda to: send_generation(to, topics, ok, t))
    del committed
    open_txn = producer_of(kafka_settings, "transactional")
    open_txn.begin_transaction()
    send_generation(open_txn, topics, pending, t)
    send_accept(open_txn, topics, pending, t)
    assert open_txn.flush(10) == 0  # on the broker, not committed
    ingest = Ingest(kafka_settings, topics, tmp_path, f"{topics.prefix}ingest", max_batch=100)
    try:
        ingest.turn_until(lambda: ingest.runner.delivered >= 1, what=f"the episode of {ok}, whose window is due")
        ingest.turn_for(WINDOW_S + 0.5)
        eps = [(e.generation_id, e.signal) for e in episodes(kafka_settings, topics)]
        assert (eps, ingest.runner.records_in) == ([(ok, "ignore")], 1), (
            f"episodes {eps} after reading {ingest.runner.records_in} records: the stage read (and joined) the "
            f"records of a transaction that is not committed, so it may still be aborted")
        open_txn.commit_transaction(10)
        ingest.turn_until(lambda: ingest.runner.delivered >= 2, what=f"the episode of {pending} after its commit")
        ingest.turn_for(0.5)
    finally:
        del open_txn
        ingest.close()
    eps = sorted((e.generation_id, e.signal, e.feedback_ids) for e in episodes(kafka_settings, topics, expect=2))
    assert eps == [(ok, "ignore", ()), (pending, "accept", (f"f-{pending}",))]


# -- readers to the high watermark: the dead-letter tools' reader, the trainer's offset book ----
@pytest.mark.timeout(60)
def test_an_output_partition_that_ends_in_a_commit_marker_is_read_to_its_end_and_written_on(
        kafka_settings, topics, tmp_path):
    """Output topics are anyone's to write to (the dead-letter topic above all): a transactional
    writer leaves the partition ending in a commit marker, past every record. The reader to the
    high watermark (``read_to_end``: ``flywheel deadletters``) must end there, not wait out its
    timeout for a record that never comes; and a stage's outbox goes on writing to the partition:
    rows acked before a crash, and not recorded, are sent again after it (at least once), each
    landing twice, beside the foreign records once each."""
    store = StateStore(tmp_path / "s.sqlite3")
    with store.txn():
        for i in range(10):
            store.append(0, topics.deadletter, "same-key", f"v{i}".encode())
    part = partition_of("same-key")
    first = Outbox(store, make_output_producer(kafka_settings, "t1"))
    real = store.delivered
    store.delivered = lambda *a, **k: (_ for _ in ()).throw(Crash())  # "killed" right after the acks
    with pytest.raises(Crash):
        first.deliver({0}, wait=True)
    store.delivered = real
    first.producer.close()
    assert store.owed == 10
    foreign = producer_of(kafka_settings, "transactional")
    for _ in range(2):
        foreign.begin_transaction()
        foreign.produce(topics.deadletter, b"foreign", b"same-key", partition=part)
        foreign.commit_transaction(10)
    del foreign

    tp = TopicPartition(topics.deadletter, part)
    started = time.monotonic()
    read = [rec.value for _, rec in read_to_end(kafka_settings, {tp: 0}, client_id="test", timeout_s=5.0)]
    assert time.monotonic() - started < 5.0 and sorted(read) == sorted([b"foreign"] * 2 + [f"v{i}".encode()
                                                                                         for i in range(10)])
    assert high_watermarks(kafka_settings, [tp], client_id="test")[tp] > 12  # past the records: markers

    second = Outbox(store, make_output_producer(kafka_settings, "t2"))
    assert second.deliver({0}, wait=True) == 10 and store.owed == 0
    second.producer.close()
    store.close()
    values = [r.value for r in read_all(kafka_settings.bootstrap, topics.deadletter, expect=22, timeout_s=10)]
    assert sorted(values) == sorted([b"foreign"] * 2 + [f"v{i}".encode() for i in range(10)] * 2)


def test_the_trainers_offset_book_settles_past_the_markers_and_resumes_after_them(kafka_settings, topics):
    """Rewards written in transactions, read and trained one by one as trainer/loop.py does
    (``seen`` on arrival, ``settle`` once trained): every record counts as settled, the floor
    passes every gap, and a restart that seeks where the book says reads no record again."""
    producer = producer_of(kafka_settings, "transactional")
    for txn in range(3):
        producer.begin_transaction()
        for i in range(3):
            producer.produce(topics.rewards, f"r{txn}.{i}".encode(), f"k{i}", partition=0)
        producer.commit_transaction(10)
    del producer
    tp = TopicPartition(topics.rewards, 0)
    book = OffsetBook()
    with closing(make_consumer(kafka_settings, "trainer", None)) as consumer:
        consumer.assign([tp])
        consumer.seek(tp, 0)
        offsets: list[int] = []
        deadline = time.monotonic() + 10
        while len(offsets) < 9 or consumer.position(tp) != consumer.highwater(tp):
            assert time.monotonic() < deadline, (offsets, consumer.position(tp), consumer.highwater(tp))
            for rec in consumer.poll(timeout_ms=200).get(tp, []):
                assert not book.taken(rec.topic, rec.partition, rec.offset)
                book.seen(rec.topic, rec.partition, rec.offset)
                book.settle(rec.topic, rec.partition, rec.offset)
                offsets.append(rec.offset)
        end = consumer.highwater(tp)
    assert offsets == sorted(set(offsets)) and len(offsets) == 9 and offsets[-1] + 1 < end  # gaps: markers
    assert all(book.is_settled(tp.topic, 0, o) for o in offsets)
    assert offsets[-1] + 1 <= book.floors[(tp.topic, 0)] <= end and not book.above.get((tp.topic, 0))
    restart = OffsetBook.from_json(book.to_json())
    starts = {tp: restart.resume_at(tp.topic, 0)}
    again = list(read_to_end(kafka_settings, starts, client_id="test", timeout_s=10))
    assert again == []

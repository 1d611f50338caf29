"""The outbox recovery step on the real broker: a crash between send and bookkeeping resends nothing.

Crashes are simulated at the two dangerous points of ingest/exactly_once.py by making the
bookkeeping call fail after its effect happened (Kafka acked / archive file renamed); a fresh
Outbox (new producer, as after a restart) must then settle the rows without sending or writing
them again.
"""

from __future__ import annotations

import time

import pyarrow as pa
import pytest
from confluent_kafka import Producer as ConfluentProducer
from conftest import read_all
from ingest.exactly_once import OUTBOX_HEADER
from kafka import TopicPartition
from kafka.errors import MessageSizeTooLargeError
from relay_helpers import Crash, Relay, feed

from flywheel.kafka.producers import make_output_producer
from flywheel.stream.archive import ParquetArchive
from flywheel.stream.outbox import Outbox
from flywheel.stream.store import StateStore

pytestmark = pytest.mark.integration
SCHEMA = pa.schema([pa.field("v", pa.string())])


@pytest.fixture(params=["confluent", "kafka-python"])
def out_settings(request, kafka_settings):
    """The fast-join test settings with each producer client the outbox supports."""
    return kafka_settings.model_copy(update={"producer_client": request.param})


def fill(store: StateStore, topic: str, n: int) -> None:
    with store.txn():
        for i in range(n):
            store.append(i % 2, topic, f"k{i}", f"v{i}".encode(), archive="a")
            store.append(i % 2, topic, None, f"unkeyed{i}".encode())  # like a dead letter without key


def feed_generations(kafka_settings, topics, n: int) -> None:
    """``n`` records on the generations topic, keyed ``g<i>`` with value ``v<i>``."""
    feed(kafka_settings, topics.generations, n)


def archive(tmp_path) -> ParquetArchive:
    return ParquetArchive(tmp_path / "archive", SCHEMA, lambda v: (0.0, {"v": v.decode()}))


def test_crash_after_send_before_mark_is_not_resent(kafka_settings, out_settings, topics, tmp_path):
    store = StateStore(tmp_path / "s.sqlite3")
    fill(store, topics.episodes, 50)
    first = Outbox(store, make_output_producer(out_settings, "t1"), {"a": archive(tmp_path)})
    real_mark = store.mark_delivered
    store.mark_delivered = lambda *a, **k: (_ for _ in ()).throw(Crash())  # "killed" right after the acks
    with pytest.raises(Crash):
        first.deliver({0, 1}, wait=True)
    store.mark_delivered = real_mark
    first.producer.close()

    second = Outbox(store, make_output_producer(out_settings, "t2"), {"a": archive(tmp_path)})
    assert second.recover({0, 1}) == 100  # all rows were in Kafka
    assert second.deliver({0, 1}, wait=True) == 0
    values = sorted(r.value for r in read_all(kafka_settings.bootstrap, topics.episodes, expect=100, timeout_s=10))
    assert len(values) == 100 and len(set(values)) == 100
    assert second.archive(force=True) == 50  # the archive queue is the store's, whatever Kafka got
    assert len(archive(tmp_path).archived_seqs(store.epoch, 0, 10**9)) == 50


def test_recovery_passes_over_outbox_headers_another_client_wrote(kafka_settings, topics, tmp_path):
    """An output topic is anyone's to write to: a header of the outbox's name with no value, or
    with bytes that are not UTF-8, names no row of this store, and must not end every start's
    recovery scan with an error."""
    store = StateStore(tmp_path / "s.sqlite3")
    fill(store, topics.episodes, 10)
    first = Outbox(store, make_output_producer(kafka_settings, "t1"), {"a": archive(tmp_path)})
    real_mark = store.mark_delivered
    store.mark_delivered = lambda *a, **k: (_ for _ in ()).throw(Crash())
    with pytest.raises(Crash):
        first.deliver({0, 1}, wait=True)
    store.mark_delivered = real_mark
    first.producer.close()
    other = ConfluentProducer({"bootstrap.servers": kafka_settings.bootstrap})
    for partition in (0, 1):
        for value in (None, b"\xff\xfe"):
            other.produce(topics.episodes, b"foreign", partition=partition, headers=[(OUTBOX_HEADER, value)])
    assert other.flush(30) == 0
    del other  # its threads stop with it, before the broker does

    second = Outbox(store, make_output_producer(kafka_settings, "t2"), {"a": archive(tmp_path)})
    assert second.recover({0, 1}) == 20 and second.deliver({0, 1}, wait=True) == 0
    second.producer.close()
    store.close()


def test_a_first_send_is_confirmed_from_the_partitions_end_so_recovery_reads_no_history(
        kafka_settings, out_settings, topics, tmp_path):
    """A new store writing to partitions that hold other records: each (shard, partition) gets
    the partition's end as its confirmed point before its first send. Without it, a crash
    before the first ack left the recovery scan to read every partition from offset 0."""
    from contextlib import closing

    from flywheel.kafka.clients import make_producer

    with closing(make_producer(kafka_settings, "history")) as producer:
        for i in range(60):
            producer.send(topics.episodes, key=f"old{i}", value=b"old", partition=i % 2)
        producer.flush()
    store = StateStore(tmp_path / "s.sqlite3")
    fill(store, topics.episodes, 20)
    first = Outbox(store, make_output_producer(out_settings, "t1"))
    real_mark = store.mark_delivered
    store.mark_delivered = lambda *a, **k: (_ for _ in ()).throw(Crash())  # killed before any ack counted
    with pytest.raises(Crash):
        first.deliver({0, 1}, wait=True)
    store.mark_delivered = real_mark
    first.producer.close()
    marks = {(sh, p): store.out_mark(sh, topics.episodes, p) for sh in (0, 1) for p in (0, 1)}
    assert set(marks.values()) == {30}  # where the partitions ended before the first send

    second = Outbox(store, make_output_producer(out_settings, "t2"))
    assert second.recover({0, 1}) == 40 and second.deliver({0, 1}, wait=True) == 0
    values = [r.value for r in read_all(kafka_settings.bootstrap, topics.episodes, expect=100, timeout_s=10)]
    assert len(values) == 100 and len(set(values) - {b"old"}) == 40
    second.producer.close()


class OnePartition:
    """Wraps a real producer that sees one partition in every topic: the topic before
    partitions were added to it."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def partitions(self, topic):
        return 1


def test_rows_sent_before_partitions_were_added_are_found_where_they_went(
        kafka_settings, out_settings, topics, tmp_path):
    """Sent while the topic had one partition, unconfirmed at a crash, recovered once it has two:
    keyed rows now hash elsewhere, and recovery must look where they went, not send them again."""
    store = StateStore(tmp_path / "s.sqlite3")
    fill(store, topics.deadletter, 20)
    first = Outbox(store, OnePartition(make_output_producer(out_settings, "t1")))
    real_mark = store.mark_delivered
    store.mark_delivered = lambda *a, **k: (_ for _ in ()).throw(Crash())  # killed after the acks
    with pytest.raises(Crash):
        first.deliver({0, 1}, wait=True)
    store.mark_delivered = real_mark
    first.producer.close()

    second = Outbox(store, make_output_producer(out_settings, "t2"))
    assert second.partitions(topics.deadletter) == 2
    assert second.recover({0, 1}) == 40 and second.deliver({0, 1}, wait=True) == 0
    values = [r.value for r in read_all(kafka_settings.bootstrap, topics.deadletter, expect=40, timeout_s=10)]
    assert len(values) == 40 and len(set(values)) == 40
    second.producer.close()


def test_crash_between_archive_files_and_dequeue_writes_nothing_twice(tmp_path):
    """Killed after one archive's file was renamed into place, before the other's was written and
    before either left the queue: the next run writes only the missing rows."""
    store = StateStore(tmp_path / "s.sqlite3")
    with store.txn():
        for i in range(30):
            store.append(0, "out", f"k{i}", f"v{i}".encode(), archive="ab"[i % 2])
    first = {"a": archive(tmp_path / "a"), "b": archive(tmp_path / "b")}
    first["b"].write = lambda *a, **k: (_ for _ in ()).throw(Crash())  # dies while writing b
    with pytest.raises(Crash):
        Outbox(store, None, first).archive(force=True)
    assert store.queued == 30 and len(first["a"].files()) == 1
    store.close()

    store = StateStore(tmp_path / "s.sqlite3")  # the restart
    second = {"a": archive(tmp_path / "a"), "b": archive(tmp_path / "b")}
    assert store.queued == 30
    assert Outbox(store, None, second).archive() == 15  # due at once after a start; a settled by its file
    assert store.queued == 0 and store.queued_batches(100) == []
    for name in "ab":
        assert len(second[name].files()) == 1
        assert len(second[name].archived_seqs(store.epoch, 0, 10**9)) == 15


def test_restart_resumes_from_stored_offsets(tmp_path):
    store = StateStore(tmp_path / "s.sqlite3")
    with store.txn():
        store.set_offsets({("in", 0): 17, ("in", 1): 4})
    store.close()
    again = StateStore(tmp_path / "s.sqlite3")
    assert again.offsets() == {("in", 0): 17, ("in", 1): 4}
    with pytest.raises(Crash), again.txn():
        again.set_offsets({("in", 0): 99})
        again.append(0, "out", "k", b"v")
        raise Crash()  # a crash mid-transaction leaves neither offsets nor outbox behind
    assert again.offsets()[("in", 0)] == 17 and again.pending([0]) == []


class LandedButReportedFailed:
    """Wraps a real producer; the first ``n`` reports turn into errors although the records landed.

    That is what a send that timed out on the client but reached the broker looks like.
    """

    def __init__(self, inner, n: int) -> None:
        self.inner, self.left = inner, n

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def reports(self):
        out = []
        for token, topic, part, offset, error in self.inner.reports():
            if self.left > 0 and error is None:
                self.left -= 1
                out.append((token, topic, part, -1, TimeoutError("simulated client timeout")))
            else:
                out.append((token, topic, part, offset, error))
        return out


def test_failed_report_for_a_landed_record_is_not_resent(kafka_settings, out_settings, topics, tmp_path):
    """A later row's ack must not move the confirmed point past a row whose send 'failed'.

    Otherwise a crash before the failed row is settled makes the next owner's recovery scan start
    after it, miss it, and send it a second time (seen in the SIGKILL soak as duplicate dead letters).
    """
    store = StateStore(tmp_path / "s.sqlite3")
    with store.txn():
        for i in range(10):
            store.append(0, topics.deadletter, "same-key", f"v{i}".encode())  # one output partition
    producer = LandedButReportedFailed(make_output_producer(out_settings, "t1"), n=3)
    first = Outbox(store, producer)
    first.deliver({0}, wait=True)  # rows 1-3 "fail" (but landed), rows 4-10 are acked
    first.producer.close()  # crash before the failed rows are settled

    second = Outbox(store, make_output_producer(out_settings, "t2"))
    assert second.recover({0}) == 3  # the scan starts early enough to find all three
    assert second.deliver({0}, wait=True) == 0
    values = [r.value for r in read_all(kafka_settings.bootstrap, topics.deadletter, expect=10, timeout_s=10)]
    assert sorted(values) == sorted(f"v{i}".encode() for i in range(10))


def test_failed_sends_are_settled_without_sending_or_archiving_twice(kafka_settings, out_settings, topics, tmp_path):
    """In a running stage, rows whose reports failed are settled by a recovery scan before the
    next delivery: neither their records nor their archive rows are written a second time."""
    store = StateStore(tmp_path / "s.sqlite3")
    with store.txn():
        for i in range(10):
            store.append(0, topics.episodes, "same-key", f"v{i}".encode(), archive="a")
    arch = archive(tmp_path)
    outbox = Outbox(store, LandedButReportedFailed(make_output_producer(out_settings, "t1"), n=4), {"a": arch})
    assert outbox.deliver({0}, wait=True) == 6  # four reports "failed", though their rows landed
    assert len(store.pending({0})) == 4
    assert outbox.deliver({0}, wait=True) == 0  # settled by the scan: found, nothing resent
    assert store.pending({0}) == []
    assert outbox.archive(force=True) == 10 and len(arch.files()) == 1
    assert len(arch.archived_seqs(store.epoch, 0, 10**9)) == 10
    values = [r.value for r in read_all(kafka_settings.bootstrap, topics.episodes, expect=10, timeout_s=10)]
    assert sorted(values) == sorted(f"v{i}".encode() for i in range(10))
    outbox.producer.close()


def test_another_shards_acks_do_not_hide_a_crashed_shards_records(kafka_settings, out_settings, topics, tmp_path):
    """Shards share output partitions (dead letters are keyed off-partition). After a crash, shard 1's
    landed-but-unconfirmed records must still be found when shard 0 was confirmed past them first,
    as when a restarted stage gets shard 0 before the dead member's shard 1 moves to it."""
    store = StateStore(tmp_path / "s.sqlite3")
    with store.txn():
        for i in range(5):
            store.append(1, topics.deadletter, "same-key", f"s1-{i}".encode())
    first = Outbox(store, make_output_producer(out_settings, "t1"))
    real_mark = store.mark_delivered
    store.mark_delivered = lambda *a, **k: (_ for _ in ()).throw(Crash())  # killed after the acks
    with pytest.raises(Crash):
        first.deliver({1}, wait=True)
    store.mark_delivered = real_mark
    first.producer.close()

    second = Outbox(store, make_output_producer(out_settings, "t2"))
    with store.txn():
        for i in range(5):
            store.append(0, topics.deadletter, "same-key", f"s0-{i}".encode())  # same partition
    assert second.deliver({0}, wait=True) == 5  # shard 0 confirmed beyond shard 1's records
    assert second.recover({1}) == 5
    assert second.deliver({1}, wait=True) == 0
    values = [r.value for r in read_all(kafka_settings.bootstrap, topics.deadletter, expect=10, timeout_s=10)]
    assert len(values) == 10 and len(set(values)) == 10


def test_a_broker_that_does_not_answer_holds_outputs_back_without_failing(broker, kafka_settings, out_settings,
                                                                         topics, tmp_path):
    """With the broker stalled, the partition lookup of a topic not yet sent to once raised out
    of the stage's loop and the process exited (a crash loop for as long as the outage lasted).
    Now delivery stops short, in order, says why and for how long, and resumes once it answers."""
    store = StateStore(tmp_path / "s.sqlite3")
    fill(store, topics.episodes, 20)
    outbox = Outbox(store, make_output_producer(out_settings, "t"))
    assert outbox.stuck_s() == 0.0
    broker.pause()
    try:
        assert outbox.deliver({0, 1}) == 0
        # the producer asks the broker for the topic (kafka-python's connects on first use) and
        # gets no answer: held back, with the reason
        assert outbox.blocked is not None and topics.episodes in outbox.blocked and outbox.in_flight == 0
        assert len(store.pending({0, 1}, limit=100)) == 40
        time.sleep(0.2)
        assert outbox.stuck_s() >= 0.2
    finally:
        broker.resume()
    delivered, deadline = 0, time.monotonic() + 30
    while delivered < 40 and time.monotonic() < deadline:  # as the stage's loop turns
        delivered += outbox.deliver({0, 1})
        time.sleep(0.05)
    assert delivered == 40 and outbox.blocked is None and outbox.stuck_s() == 0.0
    values = [r.value for r in read_all(kafka_settings.bootstrap, topics.episodes, expect=40, timeout_s=10)]
    assert len(values) == 40 and len(set(values)) == 40
    outbox.producer.close()


class _FailsOnce:
    """A stage that relays every record, and whose first batch fails as a broker timeout would."""

    def __init__(self, store: StateStore, out: str) -> None:
        self.store, self.out, self.failed = store, out, False

    def process(self, records, now: float) -> None:
        for rec in records:
            self.store.append(rec.partition, self.out, rec.key.decode(), rec.value)
        if not self.failed:
            self.failed = True
            raise TimeoutError("the broker did not answer in time")

    def tick(self, shards: set[int], now: float) -> None:
        return None


class RefusesOne:
    """Wraps a real producer; the broker "refuses" one record at every try, as Kafka refuses a
    record larger than its topic's ``max.message.bytes`` (the embedded broker has no such limit)."""

    def __init__(self, inner, value: bytes) -> None:
        self.inner, self.value, self.refused = inner, value, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def send(self, token, topic, partition, key, value, headers):
        if value == self.value:
            self.refused.append((token, topic, partition, -1, MessageSizeTooLargeError("simulated")))
        else:
            self.inner.send(token, topic, partition, key, value, headers)

    def reports(self):
        out, self.refused = self.refused + self.inner.reports(), []
        return out


def test_a_row_the_broker_refuses_at_every_try_shows_as_a_stall(kafka_settings, out_settings, topics, tmp_path):
    """Every other row flows, so acks keep coming: the stall clock must still see the one row that
    never lands, or nothing would page while it waits forever. Once the topic takes it (its limit
    raised), it lands once and the clock is back at 0."""
    store = StateStore(tmp_path / "s.sqlite3")
    with store.txn():
        for i in range(10):
            store.append(0, topics.episodes, f"k{i}", b"too-big" if i == 3 else f"v{i}".encode())
    producer = RefusesOne(make_output_producer(out_settings, "t"), b"too-big")
    outbox = Outbox(store, producer)
    started, delivered = time.monotonic(), 0
    while time.monotonic() - started < 1.5:  # as the stage's loop turns
        delivered += outbox.deliver({0}, wait=True)
        time.sleep(0.05)
    assert delivered == 9 and [r.value for r in store.pending({0})] == [b"too-big"]
    before = outbox.stuck_s()
    outbox.deliver({0}, wait=True)  # refused once more: a report, but no progress
    time.sleep(0.3)
    assert before >= 0.5 and outbox.stuck_s() >= before + 0.3
    producer.value = None  # the operator raised the topic's max.message.bytes
    assert outbox.deliver({0}, wait=True) == 1 and outbox.stuck_s() == 0.0
    values = [r.value for r in read_all(kafka_settings.bootstrap, topics.episodes, expect=10, timeout_s=10)]
    assert len(values) == 10 and len(set(values)) == 10
    producer.close()


def test_a_turn_that_fails_on_the_broker_is_retried_and_skips_nothing(kafka_settings, out_settings, topics, tmp_path):
    """The loop retries a turn that failed with a broker error instead of exiting; the records
    that turn had polled are read again (its transaction rolled back), so each is relayed once."""
    import threading

    from flywheel.kafka.clients import make_consumer
    from flywheel.kafka.lag import LagGauge
    from flywheel.metrics import new_registry
    from flywheel.stream.runner import StreamRunner

    feed_generations(kafka_settings, topics, 30)
    stop, made = threading.Event(), {}

    def run() -> None:  # SQLite objects belong to the thread that made them: the loop's, here
        store = StateStore(tmp_path / "s.sqlite3")
        made["stage"] = _FailsOnce(store, topics.episodes)
        outbox = Outbox(store, make_output_producer(out_settings, "t"))
        consumer = make_consumer(kafka_settings, "t", f"{topics.prefix}relay")
        made["runner"] = StreamRunner(made["stage"], store, outbox, consumer, [topics.generations],
                                      LagGauge("ingest", new_registry()), 100, 100)
        try:
            made["runner"].run(stop)
        finally:
            consumer.close()
            outbox.producer.close()
            store.close()

    loop = threading.Thread(target=run, daemon=True)
    loop.start()
    try:
        values = [r.value for r in read_all(kafka_settings.bootstrap, topics.episodes, expect=30, timeout_s=30)]
        assert sorted(values) == sorted(f"v{i}".encode() for i in range(30))
        assert made["stage"].failed and loop.is_alive() and made["runner"].stalled_s() == 0.0
    finally:
        stop.set()
        loop.join(timeout=30)


def test_a_record_the_client_refuses_holds_back_nothing_else(kafka_settings, out_settings, topics, tmp_path):
    """A record over the producer's own size limit is refused by the client as it is handed over
    (settings refuse such a limit at start; this is the guard behind them). It used to fail every
    turn after its batch was stored, so nothing after it was ever sent: now it alone waits,
    counted as stalled, and is sent once the limit is raised."""
    small = out_settings.model_construct(**{**out_settings.model_dump(), "max_request_bytes": 64 * 1024})
    store = StateStore(tmp_path / "s.sqlite3")
    with store.txn():
        for i in range(8):
            store.append(i % 2, topics.episodes, f"k{i}", b"x" * 200_000 if i == 2 else f"v{i}".encode())
    outbox = Outbox(store, make_output_producer(small, "t1"))
    delivered = sum(outbox.deliver({0, 1}, wait=True) for _ in range(3))
    assert delivered == 7 and [len(r.value) for r in store.pending({0, 1})] == [200_000]
    time.sleep(0.3)
    assert outbox.stuck_s() >= 0.3
    outbox.producer.close()

    raised = Outbox(store, make_output_producer(out_settings, "t2"))
    assert raised.recover({0, 1}) == 0 and raised.deliver({0, 1}, wait=True) == 1 and raised.stuck_s() == 0.0
    values = [r.value for r in read_all(kafka_settings.bootstrap, topics.episodes, expect=8, timeout_s=10)]
    assert len(values) == 8 and len(set(values)) == 8
    raised.producer.close()


def test_recovery_reads_no_partition_the_shard_never_sent_to(kafka_settings, topics, tmp_path, monkeypatch):
    """A shard's first send to a partition is preceded by its confirmed point, so a partition it
    has none for holds nothing of it: a crash before any send (a new store, or rows held back)
    settles without reading topics that may hold months of other records. A store with rows owed
    from a version that sent without such points still reads from the start."""
    from ingest import exactly_once

    store = StateStore(tmp_path / "s.sqlite3")
    fill(store, topics.deadletter, 10)
    scans: list = []
    real_read = exactly_once.read_to_end
    monkeypatch.setattr(exactly_once, "read_to_end", lambda bootstrap, starts, **kw: scans.append(starts) or
                        real_read(bootstrap, starts, **kw))
    outbox = Outbox(store, make_output_producer(kafka_settings, "t1"))
    assert outbox.recover({0, 1}) == 0 and scans == []
    outbox.producer.close()
    store.close()

    older = StateStore(tmp_path / "old.sqlite3")
    fill(older, topics.deadletter, 10)
    with older.txn():
        older.db.execute("DELETE FROM meta WHERE k='marks_first'")
    older.close()
    older = StateStore(tmp_path / "old.sqlite3")  # reopened with rows owed: not marked complete
    outbox = Outbox(older, make_output_producer(kafka_settings, "t2"))
    assert outbox.recover({0, 1}) == 0 and len(scans) == 1 and set(scans[0].values()) == {0}
    assert outbox.deliver({0, 1}, wait=True) == 20
    outbox.producer.close()
    older.close()


def test_a_retired_kafka_python_producer_has_reported_its_sends_when_retire_returns(kafka_settings, topics):
    """Its failures must be in before the next producer's acks can be counted: an ack counted
    first would move the partition's confirmed point past a failed record that may have landed."""
    from flywheel.kafka.clients import make_producer
    from flywheel.kafka.producers import KafkaPythonOutput

    cfg = kafka_settings.model_copy(update={"linger_ms": 2000})
    out = KafkaPythonOutput(lambda: make_producer(cfg, "t", max_block_ms=5000))
    n = out.partitions(topics.episodes)
    for i in range(500):
        out.send(i, topics.episodes, i % n, None, b"v" * 200, [(OUTBOX_HEADER, b"e:%d" % i)])
    out.producer.retire()
    reports = out.reports()
    assert len(reports) == 500 and all(error is not None for *_, error in reports)
    out.close()


class Unwritable:
    """Wraps a real producer; while ``closed`` the output topic cannot be looked up, as with a
    partition without a leader or a deleted topic: the outbox holds its rows back."""

    def __init__(self, inner, topic: str) -> None:
        self.inner, self.topic, self.closed = inner, topic, True

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def partitions(self, topic):
        return None if self.closed and topic == self.topic else self.inner.partitions(topic)


def test_input_pauses_while_the_outbox_owes_too_much_and_resumes_once_half_is_delivered(
        kafka_settings, out_settings, topics, tmp_path):
    """An output that cannot be written must not copy the whole input stream into the state
    store: past ``max_owed`` rows the loop stops reading (the backlog waits in the input topic,
    where lag shows it) and reads on once half are delivered. Every record goes out once."""
    from flywheel.kafka.clients import make_consumer
    from flywheel.kafka.lag import LagGauge
    from flywheel.metrics import new_registry
    from flywheel.stream.runner import StreamRunner

    feed_generations(kafka_settings, topics, 300)
    store = StateStore(tmp_path / "s.sqlite3")
    producer = Unwritable(make_output_producer(out_settings, "t"), topics.episodes)
    outbox = Outbox(store, producer)
    consumer = make_consumer(kafka_settings, "t", f"{topics.prefix}relay")
    runner = StreamRunner(Relay(store, topics.episodes), store, outbox, consumer, [topics.generations],
                          LagGauge("ingest", new_registry()), 20, 50, max_owed=50)
    try:
        deadline = time.monotonic() + 30
        while not runner.holding:
            assert time.monotonic() < deadline, "input was never paused"
            runner.step()
        held_at = (runner.records_in, store.owed)
        assert 50 <= held_at[0] < 80 and held_at[1] == held_at[0]
        for _ in range(20):
            runner.step()
        assert (runner.records_in, store.owed) == held_at and runner.healthy()[1]["input_paused"]
        producer.closed = False
        while runner.delivered < 300:
            assert time.monotonic() < deadline + 30, f"delivered {runner.delivered} of 300"
            runner.step()  # (it may pause again on the way: 300 records are six times max_owed)
        runner.step()  # a turn decides on the pause as it begins
        assert not runner.holding and store.owed == 0
    finally:
        consumer.close()
        producer.close()
        store.close()
    values = [r.value for r in read_all(kafka_settings.bootstrap, topics.episodes, expect=300, timeout_s=10)]
    assert sorted(values) == sorted(f"v{i}".encode() for i in range(300))


def test_an_assignment_whose_recovery_fails_is_settled_again_on_the_next_turn(kafka_settings, topics, tmp_path):
    """The recovery scan that sets up an assigned shard can fail on the broker: the shard stays
    paused and is set up again on the next turn, and nothing of it is processed before that."""
    from flywheel.kafka.clients import make_consumer
    from flywheel.kafka.lag import LagGauge
    from flywheel.metrics import new_registry
    from flywheel.stream.runner import StreamRunner

    feed_generations(kafka_settings, topics, 40)
    store = StateStore(tmp_path / "s.sqlite3")
    outbox = Outbox(store, make_output_producer(kafka_settings, "t"))
    real_recover, failures = outbox.recover, []

    def recover(shards):
        if not failures:
            failures.append(set(shards))
            raise TimeoutError("the broker did not answer the scan in time")
        return real_recover(shards)

    outbox.recover = recover
    consumer = make_consumer(kafka_settings, "t", f"{topics.prefix}relay")
    runner = StreamRunner(Relay(store, topics.episodes), store, outbox, consumer, [topics.generations],
                          LagGauge("ingest", new_registry()), 10, 50)
    def failed_turn(exc: BaseException) -> None:
        assert runner.records_in == 0  # the failed shard's records wait for its set-up

    try:
        assert deliver_retrying(runner, 40, failed_turn) == 1 and failures and runner.owned == failures[0]
    finally:
        consumer.close()
        outbox.producer.close()
        store.close()
    assert_relayed(kafka_settings, topics, 40)


def deliver_retrying(runner, n: int, failed_turn) -> int:
    """Turn ``runner`` until it delivered ``n`` records, retrying a turn that fails on the broker
    as StreamRunner.run does (``failed_turn(exc)`` checks each); returns how many failed."""
    from flywheel.stream.runner import BROKER_ERRORS

    deadline, failed = time.monotonic() + 30, 0
    while runner.delivered < n:
        assert time.monotonic() < deadline, f"delivered {runner.delivered} of {n}"
        try:
            runner.step()
        except BROKER_ERRORS as exc:
            failed += 1
            failed_turn(exc)
    return failed


def assert_relayed(kafka_settings, topics, n: int) -> None:
    """The episodes topic holds each of the ``n`` fed generations' values once."""
    values = [r.value for r in read_all(kafka_settings.bootstrap, topics.episodes, expect=n, timeout_s=10)]
    assert sorted(values) == sorted(f"v{i}".encode() for i in range(n))


def test_a_partition_whose_start_cannot_be_read_is_set_up_again_on_the_next_turn(kafka_settings, topics, tmp_path):
    """A partition the store never read gets its start stored before any of its records is read;
    when the broker gives no start in time, the turn fails (retried by the loop) with nothing
    stored or read, and the next turn sets the partition up."""
    from flywheel.kafka.clients import make_consumer
    from flywheel.kafka.lag import LagGauge
    from flywheel.metrics import new_registry
    from flywheel.stream.runner import StreamRunner

    feed_generations(kafka_settings, topics, 40)
    store = StateStore(tmp_path / "s.sqlite3")
    outbox = Outbox(store, make_output_producer(kafka_settings, "t"))
    consumer = make_consumer(kafka_settings, "t", f"{topics.prefix}relay")
    real_position, asked = consumer.position, []

    def position(tp, timeout_ms=None):
        asked.append(tp)
        return None if len(asked) == 1 else real_position(tp, timeout_ms=timeout_ms)  # (as on its timeout)

    consumer.position = position
    runner = StreamRunner(Relay(store, topics.episodes), store, outbox, consumer, [topics.generations],
                          LagGauge("ingest", new_registry()), 10, 50)
    def failed_turn(exc: BaseException) -> None:
        assert "no start offset" in str(exc)
        assert runner.records_in == 0 and store.offsets() == {} and not runner.owned

    try:
        assert deliver_retrying(runner, 40, failed_turn) == 1
        assert len(asked) >= 3  # asked again for the first, then the other
        assert sum(store.offsets().values()) == 40
    finally:
        consumer.close()
        outbox.producer.close()
        store.close()
    assert_relayed(kafka_settings, topics, 40)


def test_a_store_made_afresh_starts_where_the_group_committed(kafka_settings, topics, tmp_path):
    """A data_dir lost with its disk: the new store starts each partition at the offsets the lost
    one committed to the group (nothing it delivered is sent again), stores those starts, and
    goes on from there."""
    from flywheel.kafka.clients import make_consumer
    from flywheel.kafka.lag import LagGauge
    from flywheel.metrics import new_registry
    from flywheel.stream.runner import StreamRunner

    group = f"{topics.prefix}relay"
    parts = [TopicPartition(topics.generations, p) for p in (0, 1)]

    def run(store: StateStore, delivered: int) -> dict[tuple[str, int], int]:
        outbox = Outbox(store, make_output_producer(kafka_settings, "t"))
        consumer = make_consumer(kafka_settings, "t", group)
        runner = StreamRunner(Relay(store, topics.episodes), store, outbox, consumer, [topics.generations],
                              LagGauge("ingest", new_registry()), 10, 50)
        try:
            deadline = time.monotonic() + 30
            while runner.delivered < delivered or any(
                    consumer.committed(tp) != store.offsets().get((tp.topic, tp.partition)) for tp in parts):
                assert time.monotonic() < deadline, f"delivered {runner.delivered} of {delivered}"
                runner.step()
            return store.offsets()
        finally:
            consumer.close()
            outbox.producer.close()
            store.close()

    feed_generations(kafka_settings, topics, 40)
    committed = run(StateStore(tmp_path / "lost" / "s.sqlite3"), 40)
    assert sum(committed.values()) == 40
    feed(kafka_settings, topics.generations, 20, key="h", value="w")
    fresh = StateStore(tmp_path / "new" / "s.sqlite3")
    assert sum(run(fresh, 20).values()) == 60
    values = [r.value for r in read_all(kafka_settings.bootstrap, topics.episodes, expect=60, timeout_s=10)]
    assert sorted(values) == sorted([f"v{i}".encode() for i in range(40)] + [f"w{i}".encode() for i in range(20)])

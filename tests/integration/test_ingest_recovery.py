"""The outbox's delivery on the real broker, with each producer client: at least once.

Outbox rows are deleted when Kafka acks them and sent again otherwise (flywheel/stream/outbox.py,
docs/exactly-once.md). Crashes are simulated at the dangerous points by making the bookkeeping
call fail after its effect happened (Kafka acked / archive file renamed), or by closing the
producer with sends unreported; a fresh Outbox (new producer, as after a restart) then sends every
row still owed. What each test checks is what at-least-once promises: every owed record reaches
its topic (the distinct records are exactly the expected set), and a record appears twice only
where its row was sent before and not seen acked (in flight at a crash, or reported failed after
it landed). The archive is written from the store, so it holds each row once whatever happened.
"""

from __future__ import annotations

import time
from collections import Counter
from contextlib import contextmanager

import pyarrow as pa
import pytest
from conftest import read_all
from kafka import TopicPartition
from kafka.errors import KafkaError, MessageSizeTooLargeError
from relay_helpers import Crash, Relay, assert_at_least_once, count_sends, feed

from flywheel.kafka.producers import make_output_producer
from flywheel.stream.archive import ParquetArchive
from flywheel.stream.outbox import Outbox
from flywheel.stream.runner import BROKER_ERRORS
from flywheel.stream.store import StateStore

pytestmark = pytest.mark.integration
SCHEMA = pa.schema([pa.field("v", pa.string())])


@pytest.fixture(params=["confluent", pytest.param("kafka-python", marks=pytest.mark.slow)])
def out_settings(request, kafka_settings):
    """The fast-join test settings with each producer client the outbox supports. The default
    suite runs these faults on confluent, the default client; kafka-python's run in the slow suite
    (its recovery after a give-up stays in the default one: test_producer_gives_up.py)."""
    return kafka_settings.model_copy(update={"producer_client": request.param})


def fill(store: StateStore, topic: str, n: int) -> list[bytes]:
    """``2 * n`` rows over shards 0 and 1: ``n`` keyed and archived, ``n`` unkeyed; their values."""
    values = []
    with store.txn():
        for i in range(n):
            store.append(i % 2, topic, f"k{i}", f"v{i}".encode(), archive="a")
            store.append(i % 2, topic, None, f"unkeyed{i}".encode())  # like a dead letter without key
            values += [f"v{i}".encode(), f"unkeyed{i}".encode()]
    return values


def feed_generations(kafka_settings, topics, n: int) -> None:
    """``n`` records on the generations topic, keyed ``g<i>`` with value ``v<i>``."""
    feed(kafka_settings, topics.generations, n)


def archive(tmp_path) -> ParquetArchive:
    return ParquetArchive(tmp_path / "archive", SCHEMA, lambda v: (0.0, {"v": v.decode()}))


@contextmanager
def crash_on_ack(store: StateStore):
    """The process is "killed" when it next deletes acked rows: Kafka has them, the store still
    owes them."""
    real = store.delivered
    store.delivered = lambda seqs: (_ for _ in ()).throw(Crash())
    try:
        with pytest.raises(Crash):
            yield
    finally:
        store.delivered = real


def on_topic(kafka_settings, topic: str, expect: int) -> list:
    return read_all(kafka_settings.bootstrap, topic, expect=expect, timeout_s=10)


def test_rows_committed_but_never_sent_are_sent_at_the_next_start(kafka_settings, out_settings, topics, tmp_path):
    """Killed between the commit and the first send: the next start sends every row, once."""
    store = StateStore(tmp_path / "s.sqlite3")
    owed = fill(store, topics.episodes, 20)
    store.close()  # the crash: nothing was sent

    store = StateStore(tmp_path / "s.sqlite3")
    assert store.owed == 40
    outbox = Outbox(store, make_output_producer(out_settings, "t"), {"a": archive(tmp_path)})
    sent = count_sends(outbox)
    assert outbox.deliver({0, 1}, wait=True) == 40 and store.owed == 0
    values = [r.value for r in on_topic(kafka_settings, topics.episodes, 40)]
    assert Counter(values) == Counter(owed) and set(sent.values()) == {1}  # nothing was in flight: once each
    assert outbox.archive(force=True) == 20
    outbox.producer.close()
    store.close()


def test_a_crash_with_sends_in_flight_repeats_only_those_rows(kafka_settings, out_settings, topics, tmp_path):
    """Killed after Kafka acked a window of sends, before their rows were deleted, with later rows
    never sent: the next start sends every row still owed. The topic holds every owed record (the
    distinct records are exactly the expected set), the rows in flight at the crash twice, every
    other once; the archive holds each row once."""
    store = StateStore(tmp_path / "s.sqlite3")
    owed = fill(store, topics.episodes, 30)  # 60 rows
    first = Outbox(store, make_output_producer(out_settings, "t1"), {"a": archive(tmp_path)}, max_in_flight=20)
    assert first.deliver({0, 1}, wait=True) == 20 and store.owed == 40  # acked and deleted
    with crash_on_ack(store):
        first.deliver({0, 1}, wait=True)  # the next 20 land; killed before their rows are deleted
    first.producer.close()
    store.close()

    store = StateStore(tmp_path / "s.sqlite3")  # the restart
    assert store.owed == 40
    second = Outbox(store, make_output_producer(out_settings, "t2"), {"a": archive(tmp_path)})
    assert second.deliver({0, 1}, wait=True) == 40 and store.owed == 0
    got = Counter(r.value for r in on_topic(kafka_settings, topics.episodes, 80))
    assert set(got) == set(owed)
    assert got == Counter({v: 2 if 20 <= n < 40 else 1 for n, v in enumerate(owed)})  # in seq order
    assert second.archive(force=True) == 30  # the archive queue is the store's, whatever Kafka got
    assert len(archive(tmp_path).archived_seqs(store.epoch, 0, 10**9)) == 30
    second.producer.close()
    store.close()


@pytest.mark.parametrize(("first_client", "then_client"), [("confluent", "kafka-python"),
                                                            ("kafka-python", "confluent")])
def test_a_resent_record_lands_in_the_partition_of_its_first_send(kafka_settings, topics, tmp_path, first_client,
                                                                  then_client):
    """Both clients partition by key with murmur2: a row sent again after a crash, by either
    client, lands where its first send did, so the consumer shard that saw the first sees the
    repeat too, and drops it by its key."""
    store = StateStore(tmp_path / "s.sqlite3")
    with store.txn():
        for i in range(40):
            store.append(i % 2, topics.episodes, f"g{i}", f"v{i}".encode())
    first = Outbox(store, make_output_producer(kafka_settings.model_copy(update={"producer_client": first_client}),
                                               "t1"))
    with crash_on_ack(store):
        first.deliver({0, 1}, wait=True)
    first.producer.close()

    second = Outbox(store, make_output_producer(kafka_settings.model_copy(update={"producer_client": then_client}),
                                                "t2"))
    assert second.deliver({0, 1}, wait=True) == 40
    second.producer.close()
    records = on_topic(kafka_settings, topics.episodes, 80)
    where: dict[bytes, list[int]] = {}
    for rec in records:
        where.setdefault(rec.key, []).append(rec.partition)
    assert sorted(where) == sorted(f"g{i}".encode() for i in range(40))
    assert all(len(parts) == 2 and parts[0] == parts[1] for parts in where.values()), where
    assert {parts[0] for parts in where.values()} == {0, 1}  # (the keys do spread over both)
    store.close()


class LandedButReportedFailed:
    """Wraps a real producer; the first ``n`` acks turn into errors although the records landed.

    That is what a send that timed out on the client but reached the broker looks like.
    """

    def __init__(self, inner, n: int) -> None:
        self.inner, self.left = inner, n

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def reports(self):
        out = []
        for token, error in self.inner.reports():
            if self.left > 0 and error is None:
                self.left -= 1
                out.append((token, TimeoutError("simulated client timeout")))
            else:
                out.append((token, error))
        return out


def test_a_failed_send_that_landed_is_sent_again_after_a_crash(kafka_settings, out_settings, topics, tmp_path):
    """Three sends reported failed although they landed, then a crash before they were sent again:
    the next start sends them again. Their keys are on the topic twice; the distinct keys are
    exactly the expected set."""
    store = StateStore(tmp_path / "s.sqlite3")
    with store.txn():
        for i in range(10):
            store.append(0, topics.deadletter, f"k{i}", f"v{i}".encode())
    first = Outbox(store, LandedButReportedFailed(make_output_producer(out_settings, "t1"), n=3))
    assert first.deliver({0}, wait=True) == 7  # three "failed" (but landed), seven acked
    failed = {r.key.encode() for r in store.pending({0})}
    assert len(failed) == 3
    first.producer.close()  # the crash, before the failed rows are sent again
    store.close()

    store = StateStore(tmp_path / "s.sqlite3")
    second = Outbox(store, make_output_producer(out_settings, "t2"))
    assert second.deliver({0}, wait=True) == 3 and store.owed == 0
    keys = Counter(r.key for r in on_topic(kafka_settings, topics.deadletter, 13))
    assert set(keys) == {f"k{i}".encode() for i in range(10)}
    assert {k for k, n in keys.items() if n == 2} == failed and sum(keys.values()) == 13
    second.producer.close()
    store.close()


def test_failed_sends_are_sent_again_in_the_running_stage_and_archived_once(kafka_settings, out_settings, topics,
                                                                           tmp_path):
    """In a running stage, rows whose reports failed stay owed and go out again on the next turn;
    the archive, written from the store, holds every row once."""
    store = StateStore(tmp_path / "s.sqlite3")
    with store.txn():
        for i in range(10):
            store.append(0, topics.episodes, f"k{i}", f"v{i}".encode(), archive="a")
    arch = archive(tmp_path)
    outbox = Outbox(store, LandedButReportedFailed(make_output_producer(out_settings, "t1"), n=4), {"a": arch})
    sent = count_sends(outbox)
    assert outbox.deliver({0}, wait=True) == 6  # four reports "failed", though their rows landed
    again = {r.value for r in store.pending({0})}
    assert len(again) == 4 and outbox.stuck_s() > 0.0  # failing: a stall until they land
    assert outbox.deliver({0}, wait=True) == 4  # sent again, acked this time
    assert store.pending({0}) == [] and outbox.stuck_s() == 0.0
    assert outbox.archive(force=True) == 10 and len(arch.files()) == 1
    assert len(arch.archived_seqs(store.epoch, 0, 10**9)) == 10
    values = [r.value for r in on_topic(kafka_settings, topics.episodes, 14)]
    expected = [f"v{i}".encode() for i in range(10)]
    assert_at_least_once(values, expected, sent)
    assert {v for v, n in Counter(values).items() if n == 2} == again and len(values) == 14
    outbox.producer.close()


def test_a_crashed_shards_rows_are_sent_again_when_it_is_delivered(kafka_settings, out_settings, topics, tmp_path):
    """Shards share output partitions (dead letters are keyed off-partition). After a crash,
    shard 1's rows in flight are owed still, whatever shard 0 sent to the same partition since, as
    when a restarted stage gets shard 0 before the dead member's shard 1 moves to it: delivering
    shard 0 sends nothing of shard 1, and shard 1's delivery sends its rows again."""
    store = StateStore(tmp_path / "s.sqlite3")
    with store.txn():
        for i in range(5):
            store.append(1, topics.deadletter, "same-key", f"s1-{i}".encode())
    first = Outbox(store, make_output_producer(out_settings, "t1"))
    with crash_on_ack(store):
        first.deliver({1}, wait=True)  # killed after the acks
    first.producer.close()

    second = Outbox(store, make_output_producer(out_settings, "t2"))
    sent = count_sends(second)
    with store.txn():
        for i in range(5):
            store.append(0, topics.deadletter, "same-key", f"s0-{i}".encode())  # same partition
    assert second.deliver({0}, wait=True) == 5 and store.owed == 5
    assert sorted(sent) == [f"s0-{i}".encode() for i in range(5)]
    assert second.deliver({1}, wait=True) == 5 and store.owed == 0
    values = Counter(r.value for r in on_topic(kafka_settings, topics.deadletter, 15))
    assert values == Counter({**{f"s0-{i}".encode(): 1 for i in range(5)}, **{f"s1-{i}".encode(): 2 for i in range(5)}})
    second.producer.close()


def test_a_broker_that_does_not_answer_holds_outputs_back_without_losing_any(broker, kafka_settings, out_settings,
                                                                           topics, tmp_path):
    """With the broker stalled, sends are not acked (librdkafka queues them) or cannot be handed
    over at all (kafka-python's producer connects on first use, and fails on the broker's error,
    which the stage's loop retries): either way nothing leaves the outbox, and the stall shows
    (the outbox's stuck clock, or the loop's failing turns). Once the broker answers, every row is
    delivered."""
    store = StateStore(tmp_path / "s.sqlite3")
    owed = fill(store, topics.episodes, 20)
    outbox = Outbox(store, make_output_producer(out_settings, "t"))
    sent = count_sends(outbox)
    assert outbox.stuck_s() == 0.0
    broker.pause()
    try:
        try:
            assert outbox.deliver({0, 1}) == 0
            raised = None
        except BROKER_ERRORS as exc:
            raised = exc
        assert store.owed == 40 and len(store.pending({0, 1}, limit=100)) == 40
        time.sleep(0.2)
        assert raised is not None or (outbox.in_flight > 0 and outbox.stuck_s() >= 0.2)
    finally:
        broker.resume()
    delivered, deadline = 0, time.monotonic() + 30
    while delivered < 40 and time.monotonic() < deadline:  # as the stage's loop turns
        try:
            delivered += outbox.deliver({0, 1})
        except BROKER_ERRORS:
            pass  # the loop's retry
        time.sleep(0.05)
    assert delivered == 40 and store.owed == 0 and outbox.stuck_s() == 0.0
    assert_at_least_once([r.value for r in on_topic(kafka_settings, topics.episodes, 40)], owed, sent)
    outbox.producer.close()


class RefusesOne:
    """Wraps a real producer; the broker "refuses" one record at every try, as Kafka refuses a
    record larger than its topic's ``max.message.bytes`` (the embedded broker has no such limit)."""

    def __init__(self, inner, value: bytes) -> None:
        self.inner, self.value, self.refused = inner, value, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def send(self, token, topic, key, value, headers=None):
        if value == self.value:
            self.refused.append((token, MessageSizeTooLargeError("simulated")))
        else:
            self.inner.send(token, topic, key, value, headers)

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
    # as the stage's loop turns: until the other nine landed (the row's first refusal came with
    # them), then 0.7 s more. A fixed 1.5 s from the start left 0.45 s on the clock on a loaded
    # machine, where the first turn's connection took the rest
    deadline, delivered, settled = time.monotonic() + 15.0, 0, None
    while time.monotonic() < deadline and (settled is None or time.monotonic() - settled < 0.7):
        delivered += outbox.deliver({0}, wait=True)
        if delivered == 9 and settled is None:
            settled = time.monotonic()
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
    assert raised.deliver({0, 1}, wait=True) == 1 and raised.stuck_s() == 0.0 and store.owed == 0
    values = [r.value for r in read_all(kafka_settings.bootstrap, topics.episodes, expect=8, timeout_s=10)]
    assert len(values) == 8 and len(set(values)) == 8
    raised.producer.close()


def test_a_retired_kafka_python_producer_has_reported_its_sends_when_retire_returns(kafka_settings, topics,
                                                                                    tmp_path):
    """A failed send retires kafka-python's producer, failing what it still holds: each of those
    sends must be reported failed by then, or its row would wait in flight, never sent again,
    until a restart. The outbox sends them all again through the next producer."""
    from flywheel.kafka.clients import make_producer
    from flywheel.kafka.producers import KafkaPythonOutput

    # the first producer lingers far longer than queueing 500 sends can take on a loaded machine
    # (with 2 s, a starved run saw them acked before the first deliver returned); the next one
    # sends at once
    lingering = kafka_settings.model_copy(update={"linger_ms": 30_000})
    made: list[object] = []

    def producer():
        made.append(make_producer(kafka_settings if made else lingering, "t", max_block_ms=5000))
        return made[-1]

    out = KafkaPythonOutput(producer)
    store = StateStore(tmp_path / "s.sqlite3")
    with store.txn():
        for i in range(500):
            store.append(i % 2, topics.episodes, None, b"%03d" % i + b"v" * 200)
    outbox = Outbox(store, out)
    sent = count_sends(outbox)
    assert outbox.deliver({0, 1}) == 0 and outbox.in_flight == 500  # lingering: none acked yet
    out.producer.retire()
    # collected at once, with no wait for the broker: every send was reported failed by then
    assert outbox.deliver({0, 1}) == 0 and outbox.in_flight == 0 and store.owed == 500
    assert out.producer.made == 1 and out.producer.retired == 1
    assert outbox.deliver({0, 1}, wait=True) == 500 and store.owed == 0  # all sent again, and acked
    values = [r.value for r in on_topic(kafka_settings, topics.episodes, 500)]
    assert_at_least_once(values, [b"%03d" % i + b"v" * 200 for i in range(500)], sent)
    out.close()
    store.close()


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


class Unwritable:
    """Wraps a real producer; while ``closed`` every send to ``topic`` fails, as sends to a
    partition without a leader or a deleted topic are reported failed: the rows stay owed."""

    def __init__(self, inner, topic: str) -> None:
        self.inner, self.topic, self.closed, self.failed = inner, topic, True, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def send(self, token, topic, key, value, headers=None):
        if self.closed and topic == self.topic:
            self.failed.append((token, KafkaError("simulated: no leader for the partition")))
        else:
            self.inner.send(token, topic, key, value, headers)

    def reports(self):
        out, self.failed = self.failed + self.inner.reports(), []
        return out


def test_a_crash_between_commit_and_send_in_the_loop_is_sent_by_the_next_start(kafka_settings, topics, tmp_path):
    """The loop killed right after a batch's transaction committed, before its outputs were
    handed to the producer: the next start sends them while it sets its shards up, before it
    reads on from the stored offsets. Nothing was in flight, so every record arrives once."""
    from flywheel.kafka.clients import make_consumer
    from flywheel.kafka.lag import LagGauge
    from flywheel.metrics import new_registry
    from flywheel.stream.runner import StreamRunner

    feed_generations(kafka_settings, topics, 30)

    def runner_on(store: StateStore, group: str):
        outbox = Outbox(store, make_output_producer(kafka_settings, "t"))
        consumer = make_consumer(kafka_settings, "t", group)
        return StreamRunner(Relay(store, topics.episodes), store, outbox, consumer, [topics.generations],
                            LagGauge("ingest", new_registry()), 100, 50)

    store = StateStore(tmp_path / "s.sqlite3")
    first = runner_on(store, f"{topics.prefix}relay")
    real_deliver = first.outbox.deliver

    def deliver(shards, wait=False):
        if store.owed:
            raise Crash()  # killed before the batch's outputs were sent
        return real_deliver(shards, wait)

    first.outbox.deliver = deliver
    try:
        deadline = time.monotonic() + 30
        with pytest.raises(Crash):
            while True:
                assert time.monotonic() < deadline, "no batch was processed"
                first.step()
        owed = store.owed
        assert owed > 0 and first.records_in == 0  # (the crashed turn never counted its batch)
    finally:
        first.consumer.close()
        first.outbox.producer.close()
        store.close()

    store = StateStore(tmp_path / "s.sqlite3")  # the restart (its own group: the store has the offsets)
    assert store.owed == owed
    second = runner_on(store, f"{topics.prefix}relay2")
    try:
        deadline = time.monotonic() + 30
        while second.delivered < 30:
            assert time.monotonic() < deadline, f"delivered {second.delivered} of 30"
            second.step()
        assert second.records_in == 30 - owed and store.owed == 0
    finally:
        second.consumer.close()
        second.outbox.producer.close()
        store.close()
    assert_relayed(kafka_settings, topics, 30)


def test_an_assignment_whose_set_up_fails_is_set_up_again_on_the_next_turn(kafka_settings, topics, tmp_path):
    """Setting up an assigned shard sends what its previous owner left owed, which can fail on the
    broker: the shard stays paused and is set up again on the next turn, and nothing of it is
    processed before that."""
    from flywheel.kafka.clients import make_consumer
    from flywheel.kafka.lag import LagGauge
    from flywheel.metrics import new_registry
    from flywheel.stream.runner import StreamRunner

    feed_generations(kafka_settings, topics, 40)
    store = StateStore(tmp_path / "s.sqlite3")
    outbox = Outbox(store, make_output_producer(kafka_settings, "t"))
    real_deliver, failures = outbox.deliver, []

    def deliver(shards, wait=False):
        if shards and not failures:
            failures.append(set(shards))
            raise TimeoutError("the broker did not answer in time")
        return real_deliver(shards, wait)

    outbox.deliver = deliver
    consumer = make_consumer(kafka_settings, "t", f"{topics.prefix}relay")
    runner = StreamRunner(Relay(store, topics.episodes), store, outbox, consumer, [topics.generations],
                          LagGauge("ingest", new_registry()), 10, 50)

    def failed_turn(exc: BaseException) -> None:
        assert runner.records_in == 0 and not runner.owned  # the failed shard's records wait for its set-up

    try:
        assert deliver_retrying(runner, 40, failed_turn) == 1 and failures and runner.owned == failures[0]
    finally:
        consumer.close()
        outbox.producer.close()
        store.close()
    assert_relayed(kafka_settings, topics, 40)


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

"""Operational events the stages meet in production, on the real broker: output topics deleted
and recreated under a stage's outbox, input topics under its stored offsets, turns that outlast
the consumer's ``max_poll_interval_ms``, and a state store that cannot be written.

Delivery is at least once (docs/exactly-once.md): a row acked but not yet deleted from the outbox
when the process dies is sent again, and its readers drop the repeat by its key. So these tests
ask that every record owed reaches its topic, and that a record appears more than once only where
it was sent more than once.

Harnesses as in test_ingest_recovery.py: an in-process :class:`~flywheel.stream.outbox.Outbox` or
:class:`~flywheel.stream.runner.StreamRunner` with a relay stage, a "crash" simulated by making the
bookkeeping call fail after its effect happened.
"""

from __future__ import annotations

import time
from collections import Counter

import pytest
from conftest import read_all
from kafka import KafkaAdminClient, KafkaProducer, TopicPartition
from relay_helpers import Crash, Relay, assert_at_least_once, count_sends, feed

from flywheel.kafka.clients import ensure_topics, high_watermarks, make_consumer
from flywheel.kafka.lag import LagGauge
from flywheel.kafka.producers import make_output_producer
from flywheel.metrics import new_registry
from flywheel.stream.outbox import Outbox
from flywheel.stream.runner import StreamRunner
from flywheel.stream.store import StateStore

pytestmark = pytest.mark.integration


def recreate(kafka_settings, topic: str) -> None:
    """Delete ``topic`` and create it again, empty (offsets start at 0 once more)."""
    admin = KafkaAdminClient(bootstrap_servers=kafka_settings.bootstrap)
    try:
        admin.delete_topics([topic])
        deadline = time.monotonic() + 10
        while topic in admin.list_topics():
            assert time.monotonic() < deadline, f"{topic} was not deleted"
            time.sleep(0.1)
    finally:
        admin.close()
    ensure_topics(kafka_settings, [topic])
    tp = TopicPartition(topic, 0)
    assert high_watermarks(kafka_settings, [tp], client_id="test")[tp] == 0


def owe(store: StateStore, topic: str, values: list[str]) -> None:
    """Rows of shard 0, all keyed alike: one output partition."""
    with store.txn():
        for v in values:
            store.append(0, topic, "same-key", v.encode())


def deliver_then_crash(store: StateStore, outbox: Outbox) -> None:
    """Send what shard 0 owes and "die" after Kafka acked it, before the outbox deleted the rows:
    the next start sends them again."""
    real = store.delivered
    store.delivered = lambda *a, **k: (_ for _ in ()).throw(Crash())
    try:
        with pytest.raises(Crash):
            outbox.deliver({0}, wait=True)
    finally:
        store.delivered = real
        outbox.producer.close()


# -- an output topic deleted and recreated ------------------------------------------------------
def test_an_output_topic_recreated_between_runs_gets_every_row_owed_after_it(kafka_settings, topics, tmp_path):
    """The operator recreates an output topic as docs/exactly-once.md asks: stage stopped, outbox
    empty. The rows owed afterwards reach the new topic, and a crash after their acks, before
    the outbox deleted them, sends them again: each of them twice, nothing of the old topic's,
    every other row once."""
    out = topics.deadletter
    store = StateStore(tmp_path / "s.sqlite3")
    owe(store, out, [f"old{i}" for i in range(50)])
    first = Outbox(store, make_output_producer(kafka_settings, "t1"))
    assert first.deliver({0}, wait=True) == 50 and store.owed == 0
    first.producer.close()

    recreate(kafka_settings, out)  # between runs, the outbox empty

    second = Outbox(store, make_output_producer(kafka_settings, "t2"))
    owe(store, out, [f"new{i}" for i in range(20)])
    assert second.deliver({0}, wait=True) == 20 and store.owed == 0
    second.producer.close()

    third = Outbox(store, make_output_producer(kafka_settings, "t3"))
    owe(store, out, [f"late{i}" for i in range(40)])
    deliver_then_crash(store, third)  # acked, still owed
    assert store.owed == 40

    fourth = Outbox(store, make_output_producer(kafka_settings, "t4"))
    assert fourth.deliver({0}, wait=True) == 40 and store.owed == 0
    fourth.producer.close()
    values = [r.value for r in read_all(kafka_settings.bootstrap, out, expect=100, timeout_s=10)]
    want = Counter({f"new{i}".encode(): 1 for i in range(20)}) + Counter({f"late{i}".encode(): 2 for i in range(40)})
    assert Counter(values) == want, (
        f"the recreated topic holds {len(values)} records, {len(set(values))} distinct; "
        f"missing {sorted(set(want) - set(values))[:3]}, unexpected {sorted(set(values) - set(want))[:3]}")
    store.close()


def test_an_output_topic_recreated_under_a_running_stage_loses_no_record(kafka_settings, topics, tmp_path):
    """The topic is deleted and created again while the stage runs, with the producer that wrote
    to the old one. The rows owed afterwards reach the new topic (a send that fails on the change
    is sent again); then the stage dies after acks it did not record, others write to the topic,
    and the restart sends those rows again. The new topic holds every row owed since the
    recreation, the others' records once each, and a row twice only where it was sent twice."""
    out = topics.deadletter
    store = StateStore(tmp_path / "s.sqlite3")
    owe(store, out, [f"old{i}" for i in range(50)])
    running = Outbox(store, make_output_producer(kafka_settings, "t1"))
    assert running.deliver({0}, wait=True) == 50
    sent = count_sends(running)

    recreate(kafka_settings, out)  # under the running stage
    new = [f"new{i}" for i in range(30)]
    owe(store, out, new)
    deadline = time.monotonic() + 30
    while store.owed:
        assert time.monotonic() < deadline, f"{store.owed} rows still owed 30 s after the topic was recreated"
        running.deliver({0})
        time.sleep(0.05)
    late = [f"late{i}" for i in range(20)]
    owe(store, out, late)
    deliver_then_crash(store, running)  # acked, still owed
    assert store.owed == 20
    others = [b"other%d" % i for i in range(60)]
    writer = KafkaProducer(bootstrap_servers=kafka_settings.bootstrap)
    for value in others:
        writer.send(out, key=b"same-key", value=value)
    writer.flush()
    writer.close()

    restarted = Outbox(store, make_output_producer(kafka_settings, "t2"))
    sent_after = count_sends(restarted)
    assert restarted.deliver({0}, wait=True) == 20 and store.owed == 0
    restarted.producer.close()
    values = [r.value for r in read_all(kafka_settings.bootstrap, out, expect=30 + 2 * 20 + 60, timeout_s=10)]
    assert_at_least_once(values, [v.encode() for v in new + late], sent + sent_after, others)
    assert all(values.count(v.encode()) == 2 for v in late), "the rows acked before the crash, sent again, " \
        "are each there twice"
    store.close()


# -- an input topic deleted and recreated -------------------------------------------------------
def relay(kafka_settings, topics, store: StateStore, group: str, n: int, timeout_s: float = 20.0,
          stage: Relay | None = None, **overrides) -> StreamRunner:
    """Run a relay of generations -> episodes on ``store`` until it read ``n`` records and owes
    nothing (or ``timeout_s`` passed), then stop it. ``overrides``: the consumer's."""
    outbox = Outbox(store, make_output_producer(kafka_settings, "t"))
    consumer = make_consumer(kafka_settings, "t", group, **overrides)
    runner = StreamRunner(stage or Relay(store, topics.episodes), store, outbox, consumer, [topics.generations],
                          LagGauge("ingest", new_registry()), 10, 50)
    try:
        deadline = time.monotonic() + timeout_s
        while (runner.records_in < n or store.owed) and time.monotonic() < deadline:
            runner.step()
        end = time.monotonic() + 1.0  # a few more turns: a record read twice would show
        while time.monotonic() < end:
            runner.step()
    finally:
        consumer.close(autocommit=False)
        outbox.producer.close()
    return runner


# the topic grown past the old offsets is the same rule from the other side: slow (5-7 s)
@pytest.mark.parametrize("new_records", [6, pytest.param(40, marks=pytest.mark.slow)], ids=["shorter", "grown-past"])
def test_an_input_topic_recreated_between_runs_is_read_from_its_start(kafka_settings, topics, tmp_path, new_records):
    """The store's offsets (about 15 per partition) point into the old topic. Recreated, the
    topic's offsets restart at 0: every record in it is new to the store, and must be relayed,
    whether the new topic is still shorter than the stored offsets or has grown past them by the
    time the stage comes back (serving kept producing while it was down). Skipping the records
    below the stored offset loses them silently: nothing is logged, nothing dead-lettered."""
    old = feed(kafka_settings, topics.generations, 30, key="a", value="v-a")
    store = StateStore(tmp_path / "s.sqlite3")
    assert relay(kafka_settings, topics, store, f"{topics.prefix}g1", 30).records_in == 30
    assert sum(store.offsets().values()) == 30

    recreate(kafka_settings, topics.generations)
    new = feed(kafka_settings, topics.generations, new_records, key="b", value="v-b")

    runner = relay(kafka_settings, topics, store, f"{topics.prefix}g2", new_records, timeout_s=8)
    values = [r.value for r in read_all(kafka_settings.bootstrap, topics.episodes, expect=30 + new_records,
                                        timeout_s=3)]
    missing = sorted(set(new) - set(values))
    assert not missing and sorted(values) == sorted(old + new), (
        f"{len(missing)} of the recreated topic's {new_records} records never relayed (e.g. {missing[:3]}); "
        f"read {runner.records_in}, stored offsets {store.offsets()}")
    store.close()


# -- turns longer than the consumer's max_poll_interval_ms -------------------------------------
@pytest.mark.slow  # a fault run: turns made to outlast the poll interval, 9-12 s
def test_turns_outlasting_max_poll_interval_send_each_record_once_and_make_progress(kafka_settings, topics,
                                                                                    tmp_path, monkeypatch):
    """A slow labeler holds a turn past ``max_poll_interval_ms``: kafka-python's heartbeat thread
    leaves the group mid-batch, and the next poll rejoins (partitions lost, then assigned again).
    The batch in hand still commits with its offsets and is delivered; the sends in flight are
    settled before the shards move, and the rejoin seeks to the stored offsets, so with no send
    failing each record goes out once (no resend), and the stage goes on (no rebalance livelock)."""
    lost: list = []
    real_lost = StreamRunner.on_partitions_lost
    monkeypatch.setattr(StreamRunner, "on_partitions_lost", lambda self, tps: lost.append(tps) or real_lost(self, tps))
    feed(kafka_settings, topics.generations, 40, key="a", value="v-a")
    store = StateStore(tmp_path / "s.sqlite3")
    stage = Relay(store, topics.episodes, slow_s=2.0, slow_batches=2)
    slow = kafka_settings.model_copy(update={"max_poll_interval_ms": 1000})  # (kafka.max_poll_interval_ms)
    runner = relay(slow, topics, store, f"{topics.prefix}g", 40, timeout_s=25, stage=stage)
    assert lost, "the member was never evicted: the test shows nothing"
    values = [r.value for r in read_all(kafka_settings.bootstrap, topics.episodes, expect=40, timeout_s=5)]
    assert sorted(values) == sorted(f"v-a{i}".encode() for i in range(40)), (
        f"{len(values)} records out, {len(set(values))} distinct; read {runner.records_in}")
    assert stage.batches >= 4 and sum(store.offsets().values()) == 40 and store.owed == 0
    store.close()


# -- a state store that cannot be written --------------------------------------------------------
def _unwritable(store: StateStore, how: str) -> None:
    if how == "read-only":  # a volume remounted read-only after I/O errors
        store.db.execute("PRAGMA query_only=1")
    else:  # the disk is full: no page more than the file has now
        pages = store.db.execute("PRAGMA page_count").fetchone()[0]
        store.db.execute(f"PRAGMA max_page_count={pages}")


@pytest.mark.parametrize("how", ["read-only", "full"])
def test_a_state_store_that_cannot_be_written_is_waited_out_and_loses_nothing(kafka_settings, topics, tmp_path, how):
    """SQLite raises on the store's disk (a volume remounted read-only, a full disk): the loop
    waits it out as it waits out every error of its state database (flywheel/dberrors.py), with
    the failed turn neither stored nor sent, and goes on once the store is opened again (here at
    once for read-only, a limit of the old connection; the full disk once the operator made room,
    on the same connection). Every record goes out; the only repeats
    are rows sent before the error and still owed at it (their acks never recorded). Before, the
    loop stopped on the error and the stage exited."""
    import threading

    producer = KafkaProducer(bootstrap_servers=kafka_settings.bootstrap)
    values = [b"%d:" % i + b"x" * 8000 for i in range(60)]  # large: every batch needs new pages
    for i, value in enumerate(values):
        producer.send(topics.generations, key=f"a{i}".encode(), value=value)
    producer.flush()
    producer.close()

    store = StateStore(tmp_path / "s.sqlite3")
    outbox = Outbox(store, make_output_producer(kafka_settings, "t"))
    sent = count_sends(outbox)
    consumer = make_consumer(kafka_settings, "t", f"{topics.prefix}g1")
    runner = StreamRunner(Relay(store, topics.episodes), store, outbox, consumer, [topics.generations],
                          LagGauge("ingest", new_registry()), 10, 50)
    stop, owed, stalled = threading.Event(), [], [0.0]
    timer = threading.Timer(30, stop.set)  # a loop that never goes on would turn forever
    timer.start()

    def check() -> None:
        stalled[0] = max(stalled[0], runner.stalled_s())
        if runner.records_in >= 10 and not owed:
            owed.append({row.value for row in store.pending({0, 1}, limit=1000)} & set(sent))
            _unwritable(store, how)
        elif how == "full" and stalled[0] >= 1.5:  # the operator makes room on the disk
            store.db.execute("PRAGMA max_page_count=1073741823")
        if owed and sum(store.offsets().values()) == 60 and store.owed == 0:
            stop.set()

    try:
        runner.run(stop, check)
        assert timer.is_alive(), "the loop never got past the unwritable store"
        assert stalled[0] > 0, "the failed turns showed no stall"
    finally:
        timer.cancel()
        consumer.close(autocommit=False)
        outbox.producer.close()
        store.close()
    out = [r.value for r in read_all(kafka_settings.bootstrap, topics.episodes, expect=60, timeout_s=5)]
    repeated = {v for v, n in Counter(out).items() if n > 1}
    assert set(out) == set(values) and repeated <= owed[0], (
        f"{len(out)} records out, {len(set(out))} distinct, of 60; {len(repeated)} repeated, "
        f"{len(repeated - owed[0])} of them not sent and still owed at the error")


def test_health_counts_the_rows_delivered_while_a_rebalance_is_settled(kafka_settings, topics, tmp_path):
    """A rebalance (the member evicted after a slow turn, as above) settles the sends in flight
    before its shards move, and delivers the shards' rows when they come back: those acks are
    deliveries like any other. ``delivered`` in /health left them out (20 of 40 in the slow-turn
    run above), so a stage evicted every turn by a slow labeler reports a fraction of its output."""
    feed(kafka_settings, topics.generations, 20, key="a", value="v-a")
    store = StateStore(tmp_path / "s.sqlite3")
    outbox = Outbox(store, make_output_producer(kafka_settings, "t"))
    consumer = make_consumer(kafka_settings, "t", f"{topics.prefix}g")
    runner = StreamRunner(Relay(store, topics.episodes), store, outbox, consumer, [topics.generations],
                          LagGauge("ingest", new_registry()), 10, 50)
    try:
        deadline = time.monotonic() + 20
        while not (runner.records_in and outbox.in_flight):
            assert time.monotonic() < deadline, "nothing was read"
            runner.step()
        # what kafka-python's poll does for a member evicted mid-turn: partitions lost, then assigned
        mine = list(consumer.assignment())
        runner.on_partitions_lost(mine)
        runner.on_partitions_assigned(mine)
        while runner.records_in < 20 or store.owed:
            assert time.monotonic() < deadline, f"read {runner.records_in} of 20, {store.owed} owed"
            runner.step()
    finally:
        consumer.close(autocommit=False)
        outbox.producer.close()
    out = [r.value for r in read_all(kafka_settings.bootstrap, topics.episodes, expect=20, timeout_s=5)]
    assert len(out) == 20 == len(set(out))
    assert runner.healthy()[1]["delivered"] == 20, f"/health says {runner.healthy()[1]['delivered']} delivered of 20"
    store.close()

"""A record batch that cannot be unpacked, on the real broker.

kafka-python raised the error out of ``poll()`` once and then spun at full CPU inside ``poll()``
for good: one such batch stopped every reader of its partition, stage, trainer or tool, and no
SIGTERM could stop them. flywheel/kafka/batches.py hands out a stand-in record in its place; the
stages dead-letter it (``unreadable_batch``, with the offsets) and go on.

The batches are broken in the producer (tests/broken_batches.py), after their CRC is written or
with a CRC that matches the damage, since the embedded broker stores what it is sent. (It fails
on a batch whose compression bits name no codec, so that case is only read in the unit tests.)
"""

from __future__ import annotations

import base64
import time
from contextlib import closing

import pytest
from broken_batches import build, flip_a_byte, send_broken
from conftest import accept_feedback as _feedback
from conftest import read_all, running, stage_settings
from conftest import small_generation as _generation
from kafka import TopicPartition
from kafka.consumer.fetcher import Fetcher
from kafka.record.memory_records import MemoryRecords
from trainer_helpers import ListSink, make_trainer, reward_event

from flywheel.contracts import DeadLetterEvent, RewardEvent, decode, encode
from flywheel.kafka.batches import unreadable_batch
from flywheel.kafka.clients import make_consumer, make_producer, read_to_end
from flywheel.metrics import new_registry
from flywheel.stream.deadletters import DeadLetters
from ingest.join import resolve
from ingest.stage import episode_bytes
from trainer.batching import DEADLETTER_REASONS

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("breakage", ["crc", "decompress", "record"])
def test_every_reader_gets_past_an_unreadable_batch(kafka_settings, topics, breakage):
    topic = topics.generations
    with closing(make_producer(kafka_settings, "test", linger_ms=50)) as producer:
        producer.send(topic, key=b"a", value=b"before", partition=0).get(10)
        broken = send_broken(producer, topic, 0, [(b"k%d" % i, b"bad%d" % i) for i in range(3)], breakage)
        producer.send(topic, key=b"z", value=b"after", partition=0).get(10)
    assert broken == [1, 2, 3]
    # a stage's group consumer: the poll after the batch returns, and returns what follows it
    consumer = make_consumer(kafka_settings, "test", f"g-{topics.prefix}", [topic])
    try:
        got, deadline = [], time.monotonic() + 20
        while time.monotonic() < deadline and not any(r.value == b"after" for r in got):
            got += [r for recs in consumer.poll(timeout_ms=500).values() for r in recs]
    finally:
        consumer.close()
    # "record": the batch's first record reads; the stand-in covers the two after it
    read = [0, 1] if breakage == "record" else [0]
    assert [r.offset for r in got] == [*read, 3, 4]
    marker = unreadable_batch(got[-2].headers)
    assert marker is not None and (marker.first, marker.last) == (read[-1] + 1, 3)
    assert got[-1].value == b"after"
    # the reader behind the dead-letter tools
    scanned = [rec.offset for _, rec in read_to_end(kafka_settings, {TopicPartition(topic, 0): 0},
                                                     client_id="test", timeout_s=20)]
    assert scanned == [*read, 3, 4]


def test_stages_read_inputs_compressed_with_every_codec(kafka_settings, topics, tmp_path):
    """A product's producer may compress with any codec Kafka defines (lz4 and snappy are common
    choices): kafka-python could read none but gzip and zstd without their libraries."""
    from confluent_kafka import Producer as ConfluentProducer

    from ingest.main import run as run_ingest
    from reward.main import run as run_reward

    settings = stage_settings(kafka_settings, topics, tmp_path, FLYWHEEL_INGEST_WINDOW_S="1",
                              FLYWHEEL_INGEST_GRACE_S="0")
    t = time.time()
    codecs = ("gzip", "snappy", "lz4", "zstd")
    with running(run_ingest, settings), running(run_reward, settings):
        for codec in codecs:
            producer = ConfluentProducer({"bootstrap.servers": kafka_settings.bootstrap, "compression.codec": codec,
                                          "linger.ms": 20})
            for i in range(5):
                gid = f"{codec}-{i}"
                producer.produce(topics.generations, encode(_generation(gid, t)), gid)
                producer.produce(topics.feedback, encode(_feedback(f"f-{gid}", gid, t)), gid)
            assert producer.flush(30) == 0
            del producer
        rewards = [decode(RewardEvent, r.value) for r in read_all(kafka_settings.bootstrap, topics.rewards,
                                                                  expect=20, timeout_s=60)]
    assert sorted(r.generation_id for r in rewards) == sorted(f"{c}-{i}" for c in codecs for i in range(5))
    assert read_all(kafka_settings.bootstrap, topics.deadletter, timeout_s=1) == []


def test_stages_dead_letter_an_unreadable_batch_and_keep_going(kafka_settings, topics, tmp_path):
    from ingest.main import run as run_ingest
    from reward.main import run as run_reward

    settings = stage_settings(kafka_settings, topics, tmp_path, FLYWHEEL_INGEST_WINDOW_S="1",
                              FLYWHEEL_INGEST_GRACE_S="0")
    t = time.time()
    with closing(make_producer(kafka_settings, "test", linger_ms=50)) as producer, \
            running(run_ingest, settings), running(run_reward, settings):
        def send_pair(gid: str) -> None:  # one partition: what follows a broken batch is read only past it
            producer.send(topics.generations, key=gid, value=encode(_generation(gid, t)), partition=0)
            producer.send(topics.feedback, key=gid, value=encode(_feedback(f"f-{gid}", gid, t)), partition=0)
            producer.flush()

        send_pair("before")
        lost = [(gid.encode(), encode(_generation(gid, t))) for gid in ("lost-0", "lost-1")]
        lost_at = send_broken(producer, topics.generations, 0, lost, "crc")
        send_pair("after")
        # the reward stage's edge: a broken batch of episodes between two good ones
        def episode(gid: str) -> bytes:
            return episode_bytes(encode(_generation(gid, t)), resolve([_feedback(f"f-{gid}", gid, t)]), t)
        producer.send(topics.episodes, key=b"ep-before", value=episode("ep-before"), partition=0).get(10)
        ep_lost_at = send_broken(producer, topics.episodes, 0, [(b"ep-lost", episode("ep-lost"))], "decompress")
        producer.send(topics.episodes, key=b"ep-after", value=episode("ep-after"), partition=0).get(10)

        letters = [decode(DeadLetterEvent, r.value) for r in read_all(kafka_settings.bootstrap, topics.deadletter,
                                                                      expect=2, timeout_s=60)]
        rewards = [decode(RewardEvent, r.value) for r in read_all(kafka_settings.bootstrap, topics.rewards,
                                                                  expect=4, timeout_s=30)]

    assert sorted(r.generation_id for r in rewards) == ["after", "before", "ep-after", "ep-before"]
    assert sorted((d.stage, d.reason, d.source_topic, d.source_partition, d.source_offset) for d in letters) == [
        ("ingest", "unreadable_batch", topics.generations, 0, lost_at[0]),
        ("reward", "unreadable_batch", topics.episodes, 0, ep_lost_at[0])]
    gen_letter = next(d for d in letters if d.stage == "ingest")
    assert f"offsets {lost_at[0]}-{lost_at[-1]} of {topics.generations}[0]" in gen_letter.detail
    assert "CRC" in gen_letter.detail
    assert b"lost-1" in base64.b64decode(gen_letter.value_b64)  # the batch's bytes, for whoever looks
    ep_letter = next(d for d in letters if d.stage == "reward")
    assert f"offset {ep_lost_at[0]} of {topics.episodes}[0]" in ep_letter.detail


def test_the_trainer_dead_letters_a_stand_in_and_settles_its_offset(tiny_model_dir, tmp_path):
    sink = ListSink()
    dead = DeadLetters(sink, "t.deadletter", "trainer", new_registry(), DEADLETTER_REASONS)
    tr = make_trainer(tiny_model_dir, tmp_path, {"deadletters": dead}, loss="grpo")
    tr.start()
    good = reward_event(0, group="g", reward=1.0)
    part = Fetcher.PartitionRecords(20, TopicPartition("t.rewards", 0),
                                    MemoryRecords(bytes(flip_a_byte(build([(b"x", encode(good))] * 2, base=20)))))
    stand_in, = part.take()
    assert stand_in.offset == 21
    tr._intake(stand_in)
    letter, = (decode(DeadLetterEvent, v) for _, _, v in sink.records)
    assert (letter.reason, letter.source_topic, letter.source_offset) == ("unreadable_batch", "t.rewards", 20)
    assert tr.book.is_settled("t.rewards", 0, 21)  # nothing of it can be trained: it holds no floor back
    assert tr.m.dropped.labels("unreadable_batch")._value.get() == 1
    assert not tr.seen_ids

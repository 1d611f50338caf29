"""A record whose header key is not UTF-8, on the real broker.

kafka-python decodes header keys strictly: such a record made ``poll()`` raise once and then spin
at full CPU for good, so one bad producer stopped every reader of its partition, stage or tool.
flywheel/kafka/headers.py reads it leniently; the stages dead-letter it and go on.
"""

from __future__ import annotations

import base64
import time
from contextlib import closing

import pytest
from conftest import accept_feedback as _feedback
from conftest import read_all, running, stage_settings
from conftest import small_generation as _generation
from kafka import TopicPartition
from kafka.partitioner.default import murmur2

from flywheel.contracts import (
    DeadLetterEvent,
    EpisodeEvent,
    GenerationEvent,
    RewardEvent,
    decode,
    encode,
)
from flywheel.kafka.clients import make_producer, read_to_end
from flywheel.kafka.headers import UnreadableHeaderKey, unreadable_header
from ingest.join import resolve
from ingest.stage import episode_bytes

pytestmark = pytest.mark.integration
BAD_KEY = b"\xff\xfetrace"


class _NotUtf8(str):
    """A header key kafka-python's producer writes as bytes that are not UTF-8 (no client lets
    one write such a key on purpose; broken producers in other languages do)."""

    def encode(self, *args: object, **kwargs: object) -> bytes:
        return BAD_KEY


def _ids_in_partition(partition: int, partitions: int, n: int) -> list[str]:
    """``n`` generation ids the default partitioner puts in ``partition``."""
    ids = (f"g{i}" for i in range(10_000))
    return [g for g in ids if (murmur2(g.encode()) & 0x7FFFFFFF) % partitions == partition][:n]


def test_every_reader_gets_past_a_header_key_that_is_not_utf8(kafka_settings, topics):
    with closing(make_producer(kafka_settings, "test")) as producer:
        for i, headers in enumerate([[], [(_NotUtf8("trace"), b"1"), ("ok", b"2")], []]):
            producer.send(topics.generations, key=f"k{i}", value=b"v%d" % i, partition=0, headers=headers)
        producer.flush()
    recs = read_all(kafka_settings.bootstrap, topics.generations, expect=3)  # a plain KafkaConsumer
    assert [r.value for r in recs] == [b"v0", b"v1", b"v2"]
    bad = unreadable_header(recs[1].headers)
    assert isinstance(bad, UnreadableHeaderKey) and bad.raw == BAD_KEY
    assert bad == "\\xff\\xfetrace"  # readable in logs, and encodable again
    assert recs[1].headers[1] == ("ok", b"2")
    assert unreadable_header(recs[0].headers) is None
    # the reader behind the dead-letter tools
    scanned = [rec.offset for _, rec in read_to_end(kafka_settings, {TopicPartition(topics.generations, 0): 0},
                                                     client_id="test", timeout_s=20)]
    assert scanned == [0, 1, 2]


def test_stages_dead_letter_such_records_and_keep_going(kafka_settings, topics, tmp_path):
    from ingest.main import run as run_ingest
    from reward.main import run as run_reward

    settings = stage_settings(kafka_settings, topics, tmp_path, FLYWHEEL_INGEST_WINDOW_S="1",
                              FLYWHEEL_INGEST_ORPHAN_WAIT_S="1", FLYWHEEL_INGEST_GRACE_S="0")
    before, bad, after = _ids_in_partition(0, kafka_settings.partitions, 3)
    t = time.time()
    bad_header = [(_NotUtf8("trace"), b"1")]
    with closing(make_producer(kafka_settings, "test")) as producer, \
            running(run_ingest, settings), running(run_reward, settings):
        for gid in (before, bad, after):  # one partition: "after" is read only past "bad"
            producer.send(topics.generations, key=gid, value=encode(_generation(gid, t)), partition=0,
                          headers=bad_header if gid == bad else [])
            producer.send(topics.feedback, key=gid, value=encode(_feedback(f"f-{gid}", gid, t)), partition=0)
        # an episode with such a header, for the reward stage's edge
        episode = episode_bytes(encode(_generation("ep", t)), resolve([_feedback("f-ep", "ep", t)]), t)
        producer.send(topics.episodes, key="ep", value=episode, partition=0, headers=bad_header)
        producer.flush()

        deadline = time.monotonic() + 60
        letters: list[DeadLetterEvent] = []
        while time.monotonic() < deadline and len(letters) < 3:
            letters = [decode(DeadLetterEvent, r.value) for r in read_all(kafka_settings.bootstrap, topics.deadletter,
                                                                          expect=3, timeout_s=2)]
        rewards = [decode(RewardEvent, r.value) for r in read_all(kafka_settings.bootstrap, topics.rewards,
                                                                  expect=2, timeout_s=30)]

    by_reason = sorted((d.stage, d.reason, d.source_topic) for d in letters)
    assert by_reason == [("ingest", "orphan_feedback", topics.feedback),
                         ("ingest", "undecodable", topics.generations),
                         ("reward", "undecodable", topics.episodes)]
    undecodable = [d for d in letters if d.reason == "undecodable"]
    assert all("header key b'\\xff\\xfetrace' is not UTF-8" in d.detail for d in undecodable)
    # the record itself is quoted whole, so a replay (which sends no headers) is clean
    gen_letter = next(d for d in undecodable if d.stage == "ingest")
    assert decode(GenerationEvent, base64.b64decode(gen_letter.value_b64)).generation_id == bad
    assert sorted(r.generation_id for r in rewards) == sorted([before, after])
    episodes = [decode(EpisodeEvent, r.value).generation_id for r in read_all(kafka_settings.bootstrap,
                                                                              topics.episodes, timeout_s=1)]
    assert bad not in episodes

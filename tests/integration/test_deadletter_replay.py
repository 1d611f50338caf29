"""`flywheel deadletters` on the real broker, against a running ingest stage.

The story on-call meets: a producer's clock runs ahead, so its generations are dead-lettered as
``clock_skew`` and their feedback, waiting for them, as ``orphan_feedback``. Once the clock is
fixed, one replay of both joins them after all (feedback goes first and waits afresh); a second
replay skips the letters the first one sent, and one forced with ``--again`` changes nothing. A generation that turned up by itself after its feedback was
dead-lettered has closed as ``ignore``: its replayed feedback is ``late_feedback``.
"""

from __future__ import annotations

import base64
import time
from contextlib import closing

import pytest
from confluent_kafka import Producer as ConfluentProducer
from conftest import accept_feedback as feedback
from conftest import read_all, running, stage_settings
from conftest import small_generation as generation

from cli.deadletters import REPLAY_HEADER, read_letters
from cli.deadletters import run as deadletters
from cli.main import build_parser
from flywheel.contracts import (
    DeadLetterEvent,
    EpisodeEvent,
    decode,
    encode,
)
from flywheel.kafka.clients import make_producer

pytestmark = pytest.mark.integration
WINDOW_S = 2.0


def cli(settings, capsys, *argv: str) -> str:
    assert deadletters(settings, build_parser().parse_args(["deadletters", *argv])) == 0
    return capsys.readouterr().out


def wait_for(fn, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (got := fn()):
            return got
        time.sleep(0.3)
    raise AssertionError("timed out")


def episodes_of(kafka_settings, topics, gid: str) -> list[EpisodeEvent]:
    eps = [decode(EpisodeEvent, r.value) for r in read_all(kafka_settings.bootstrap, topics.episodes, timeout_s=1.5)]
    return [e for e in eps if e.generation_id == gid]


@pytest.mark.slow  # 27 s: the default suite must stay under 15 minutes on 2 cores
def test_orphans_replayed_with_their_generations_join_once(kafka_settings, topics, tmp_path, capsys):
    from ingest.main import run as run_ingest

    settings = stage_settings(kafka_settings, topics, tmp_path, FLYWHEEL_INGEST_WINDOW_S=str(WINDOW_S),
                              FLYWHEEL_INGEST_ORPHAN_WAIT_S=str(WINDOW_S), FLYWHEEL_INGEST_GRACE_S="0",
                              FLYWHEEL_INGEST_MAX_FUTURE_S="1")
    with closing(make_producer(kafka_settings, "test")) as producer, running(run_ingest, settings):
        t = time.time()
        producer.send(topics.generations, key="ok", value=encode(generation("ok", t)))
        producer.send(topics.feedback, key="ok", value=encode(feedback("f-ok", "ok", t)))
        producer.flush()
        wait_for(lambda: episodes_of(kafka_settings, topics, "ok"))  # the stage is up and caught up
        t = time.time()
        producer.send(topics.feedback, key="late", value=encode(feedback("f-late", "late", t)))
        # stamped by a clock 3 s ahead: clock_skew, and its feedback above becomes an orphan; its
        # producer sends it twice (two letters, one record: sent once, and marked for both)
        skewed = encode(generation("late", t + 3))
        producer.send(topics.generations, key="late", value=skewed)
        producer.send(topics.generations, key="late", value=skewed)
        producer.send(topics.feedback, key="gone", value=encode(feedback("f-gone", "gone", t)))
        producer.send(topics.generations, key="bad", value=b"{not json")
        # a dead letter from somewhere that is not a stage input: listed, never replayed
        producer.send(topics.deadletter, key="x", value=encode(DeadLetterEvent(
            stage="elsewhere", reason="manual", source_topic="other.topic", value_b64="eyJ9", failed_at=t)))
        producer.flush()

        def letters_of(reason: str, n: int = 1):
            got = [x for x in read_letters(kafka_settings, topics.deadletter)[0] if x.event.reason == reason]
            return got if len(got) >= n else None

        letters = wait_for(lambda: letters_of("orphan_feedback", 2))
        assert {x.event.source_topic for x in letters} == {topics.feedback}
        out = cli(settings, capsys, "summary")
        assert "6 dead letters, 6 selected" in out
        rows = {tuple(line.split()[:4]) for line in out.splitlines()[2:]}
        assert rows == {("ingest", "orphan_feedback", topics.feedback, "2"),
                        ("ingest", "clock_skew", topics.generations, "2"),
                        ("ingest", "undecodable", topics.generations, "1"),
                        ("elsewhere", "manual", "other.topic", "1")}
        assert "f-late" in cli(settings, capsys, "show", "--reason", "orphan_feedback")

        # "gone"'s generation turns up by itself, after its feedback was dead-lettered
        producer.send(topics.generations, key="gone", value=encode(generation("gone", t - 0.5)))
        producer.flush()
        (ep,) = wait_for(lambda: episodes_of(kafka_settings, topics, "gone"))
        assert (ep.signal, ep.timed_out) == ("ignore", True)

        time.sleep(max(0.0, t + 3.2 - time.time()))  # the skewed clock's time has come
        selection = ("--reason", "orphan_feedback", "--reason", "clock_skew")
        out = cli(settings, capsys, "replay", *selection, "--dry-run")
        assert "would replay 3 records" in out
        assert len(read_all(kafka_settings.bootstrap, topics.feedback, timeout_s=1.5)) == 3  # nothing sent
        out = cli(settings, capsys, "replay", *selection, "--since", "1h")
        assert "replayed 3 records" in out and "1 more dead letters hold a record above" in out
        assert f"1  clock_skew         -> {topics.generations}" in out
        assert f"2  orphan_feedback    -> {topics.feedback}" in out
        replayed = [r for r in read_all(kafka_settings.bootstrap, topics.feedback, expect=5) if r.headers]
        assert sorted((r.key, dict(r.headers)[REPLAY_HEADER]) for r in replayed) == sorted(
            (base64.b64decode(x.event.key_b64), f"{x.partition}:{x.offset}".encode()) for x in letters)

        (ep,) = wait_for(lambda: episodes_of(kafka_settings, topics, "late"))
        assert (ep.signal, ep.feedback_ids, ep.timed_out) == ("accept", ("f-late",), False)
        # a header of that name with no value (Kafka allows it; kafka-python cannot write one),
        # where the next replay looks for its own: it names no letter, and the record is undecodable
        other = ConfluentProducer({"bootstrap.servers": kafka_settings.bootstrap})
        other.produce(topics.generations, key=b"late", value=b"{not json", headers=[(REPLAY_HEADER, None)])
        assert other.flush(30) == 0
        del other  # its threads stop with it, before the broker does
        wait_for(lambda: letters_of("late_feedback"))
        out = cli(settings, capsys, "replay", *selection, "--reason", "manual")
        assert "replayed 0 records" in out and "4 dead letters were replayed before" in out
        assert "other.topic is not a stage input" in out
        assert len(read_all(kafka_settings.bootstrap, topics.feedback, timeout_s=1.5)) == 5  # nothing sent
        out = cli(settings, capsys, "replay", *selection, "--again")
        assert "replayed 3 records" in out and "replayed before" not in out
        time.sleep(WINDOW_S + 1.5)  # the second replay is folded as duplicates, not new episodes
        for gid in ("late", "gone", "ok"):
            assert len(episodes_of(kafka_settings, topics, gid)) == 1, gid
        reasons = sorted(x.event.reason for x in read_letters(kafka_settings, topics.deadletter)[0])
        # f-gone fails again on each replay (its generation is closed); nothing else does
        assert reasons == ["clock_skew", "clock_skew", "late_feedback", "late_feedback", "manual",
                           "orphan_feedback", "orphan_feedback", "undecodable", "undecodable"]

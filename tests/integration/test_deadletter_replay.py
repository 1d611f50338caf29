"""`flywheel deadletters` on the real broker, against a running ingest stage.

The story on-call meets: the serving tier's generations arrive late, so their feedback is
dead-lettered as ``orphan_feedback``; once the generations are in, a replay joins the feedback
after all, and replaying again changes nothing.
"""

from __future__ import annotations

import time
from contextlib import closing

import pytest
from conftest import read_all, running, stage_settings

from flywheel.bus import make_producer
from flywheel.cli import build_parser
from flywheel.contracts import (
    DeadLetterEvent,
    EpisodeEvent,
    FeedbackEvent,
    GenerationEvent,
    SamplingParams,
    decode,
    encode,
)
from flywheel.deadletters import REPLAY_HEADER, read_letters
from flywheel.deadletters import run as deadletters

pytestmark = pytest.mark.integration
WINDOW_S = 2.0


def generation(gid: str, t: float) -> GenerationEvent:
    return GenerationEvent(
        generation_id=gid, group_id=gid, model_name="m", model_version=0, user_id="u1", endpoint="chat",
        created_at=t, completed_at=t, latency_ms=5, prompt_text="p", prompt_token_ids=(1, 2),
        completion_text="c", completion_token_ids=(3, 4), logprobs=(-0.1, -0.2),
        sampling=SamplingParams(temperature=1, top_p=1, max_tokens=4), finish_reason="stop")


def feedback(fid: str, gid: str, t: float) -> FeedbackEvent:
    return FeedbackEvent(feedback_id=fid, generation_id=gid, signal="accept", decision_ms=800.0,
                         created_at=t, received_at=t)


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


def test_orphans_replayed_after_their_generations_join_once(kafka_settings, topics, tmp_path, capsys):
    from ingest.main import run as run_ingest

    settings = stage_settings(kafka_settings, topics, tmp_path, FLYWHEEL_INGEST_WINDOW_S=str(WINDOW_S),
                              FLYWHEEL_INGEST_GRACE_S="0")
    with closing(make_producer(kafka_settings, "test")) as producer, running(run_ingest, settings):
        t = time.time()
        producer.send(topics.feedback, key="late", value=encode(feedback("f-late", "late", t)))
        producer.send(topics.generations, key="ok", value=encode(generation("ok", t)))
        producer.send(topics.feedback, key="ok", value=encode(feedback("f-ok", "ok", t)))
        producer.send(topics.generations, key="bad", value=b"{not json")
        # a dead letter from somewhere that is not a stage input: listed, never replayed
        producer.send(topics.deadletter, key="x", value=encode(DeadLetterEvent(
            stage="elsewhere", reason="manual", source_topic="other.topic", value_b64="eyJ9", failed_at=t)))
        producer.flush()

        letters = wait_for(lambda: [x for x in read_letters(kafka_settings, topics.deadletter)[0]
                                    if x.event.reason == "orphan_feedback"])
        assert [x.event.source_topic for x in letters] == [topics.feedback]
        out = cli(settings, capsys, "summary")
        assert "3 dead letters, 3 selected" in out
        rows = {tuple(line.split()[:4]) for line in out.splitlines()[2:]}
        assert rows == {("ingest", "orphan_feedback", topics.feedback, "1"),
                        ("ingest", "undecodable", topics.generations, "1"),
                        ("elsewhere", "manual", "other.topic", "1")}
        assert "f-late" in cli(settings, capsys, "show", "--reason", "orphan_feedback")

        # the generation arrives late; its feedback comes back from the dead-letter topic
        producer.send(topics.generations, key="late", value=encode(generation("late", time.time())))
        producer.flush()
        out = cli(settings, capsys, "replay", "--reason", "orphan_feedback", "--dry-run")
        assert "would replay 1 records" in out
        assert len(read_all(kafka_settings.bootstrap, topics.feedback, timeout_s=1.5)) == 2  # nothing sent
        out = cli(settings, capsys, "replay", "--source-topic", "feedback", "--since", "1h")
        assert f"replayed 1 records\n        1  orphan_feedback    -> {topics.feedback}" in out
        replayed = [r for r in read_all(kafka_settings.bootstrap, topics.feedback, expect=3) if r.headers]
        assert [(r.key, dict(r.headers)[REPLAY_HEADER]) for r in replayed] == [
            (b"late", f"{letters[0].partition}:{letters[0].offset}".encode())]

        (ep,) = wait_for(lambda: episodes_of(kafka_settings, topics, "late"))
        assert (ep.signal, ep.feedback_ids, ep.timed_out) == ("accept", ("f-late",), False)
        out = cli(settings, capsys, "replay", "--reason", "orphan_feedback", "--reason", "manual")
        assert "replayed 1 records" in out and "refused" in out and "other.topic is not a stage input" in out
        time.sleep(WINDOW_S + 1.5)  # the second replay is folded as a duplicate, not a new episode
        assert len(episodes_of(kafka_settings, topics, "late")) == 1
        assert len(episodes_of(kafka_settings, topics, "ok")) == 1
        reasons = sorted(x.event.reason for x in read_letters(kafka_settings, topics.deadletter)[0])
        assert reasons == ["manual", "orphan_feedback", "undecodable"]  # nothing failed again

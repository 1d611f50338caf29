"""Table tests for the dead-letter tool's pure parts (cli/deadletters.py)."""

from __future__ import annotations

import argparse
import base64
import json

import pytest

from cli.deadletters import (
    Letter,
    Selection,
    Summary,
    parse_age,
    plan_replay,
    replay_waves,
    selection_from_args,
    show,
)
from cli.main import build_parser
from flywheel.contracts import (
    MAX_RECORD_BYTES,
    ContractError,
    DeadLetterEvent,
    Topics,
    decode,
    encode,
)

T = Topics("p.")


def dl(reason="invalid", stage="ingest", topic="p.feedback", at=1000.0, value=b'{"x":1}', key=b"g1",
       offset=7) -> DeadLetterEvent:
    return DeadLetterEvent(stage=stage, reason=reason, detail="why", source_topic=topic, source_partition=1,
                           source_offset=offset, key_b64=base64.b64encode(key).decode() if key is not None else None,
                           value_b64=base64.b64encode(value).decode(), failed_at=at)


@pytest.mark.parametrize(("text", "seconds"), [("90s", 90), ("30m", 1800), ("2h", 7200), ("1.5d", 129600), (" 7d ", 604800)])
def test_parse_age(text, seconds):
    assert parse_age(text) == seconds


@pytest.mark.parametrize("text", ["", "2", "h", "2w", "-1h", "two hours"])
def test_parse_age_refuses_with_the_expected_form(text):
    with pytest.raises(argparse.ArgumentTypeError, match="90s, 30m, 2h, 7d"):
        parse_age(text)


@pytest.mark.parametrize(("selection", "event", "hit"), [
    (Selection(), dl(), True),
    (Selection(reasons=frozenset({"invalid", "orphan_feedback"})), dl("orphan_feedback"), True),
    (Selection(reasons=frozenset({"invalid"})), dl("late_feedback"), False),
    (Selection(stages=frozenset({"reward"})), dl(stage="ingest"), False),
    (Selection(source_topics=frozenset({"p.generations"})), dl(topic="p.feedback"), False),
    (Selection(since=1000.0), dl(at=1000.0), True),
    (Selection(since=1000.5), dl(at=1000.0), False),
    (Selection(until=1000.0), dl(at=1000.0), False),
    (Selection(since=900.0, until=1100.0, reasons=frozenset({"invalid"})), dl(at=1000.0), True),
])
def test_selection(selection, event, hit):
    assert selection.matches(event) is hit


def test_command_line_filters_name_topics_by_kind_and_ages_from_now():
    args = build_parser().parse_args(["deadletters", "replay", "--reason", "invalid", "--reason", "unknown_version",
                                      "--source-topic", "feedback", "--source-topic", "other.t", "--since", "2h",
                                      "--until", "30m"])
    sel = selection_from_args(args, T, now=10_000.0)
    assert sel.reasons == {"invalid", "unknown_version"} and sel.stages == frozenset()
    assert sel.source_topics == {"p.feedback", "other.t"}
    assert (sel.since, sel.until) == (10_000.0 - 7200, 10_000.0 - 1800)


def test_summary_counts_by_stage_reason_and_topic_with_time_span():
    summary = Summary()
    for event in (dl(at=30.0, offset=1), dl(at=10.0, offset=2), dl(at=20.0, offset=3), dl("orphan_feedback", at=5.0),
                  dl(stage="reward", topic="p.episodes")):
        summary.add(event)
    assert summary.rows == {("ingest", "invalid", "p.feedback"): [3, 10.0, 30.0],
                            ("ingest", "orphan_feedback", "p.feedback"): [1, 5.0, 5.0],
                            ("reward", "invalid", "p.episodes"): [1, 1000.0, 1000.0]}
    lines = summary.render().splitlines()
    assert lines[1].split()[:4] == ["ingest", "invalid", "p.feedback", "3"]  # biggest first
    assert Summary().render() == "no dead letters match"


def test_summary_counts_a_letter_delivered_twice_once():
    # the stages' outboxes deliver at least once: the same stage, reason and source record is one
    # letter, however often it is on the topic; the same record failing at another stage is not
    summary = Summary()
    for event in (dl(offset=1), dl(offset=1, at=1001.0), dl(offset=2), dl(offset=1, stage="reward")):
        summary.add(event)
    assert summary.rows[("ingest", "invalid", "p.feedback")][0] == 2
    assert summary.rows[("reward", "invalid", "p.feedback")][0] == 1
    assert summary.repeats == 1 and "1 repeated deliveries" in summary.render()


def test_plan_replay_refuses_foreign_topics_empty_and_truncated_values():
    letters = [Letter(0, 1, dl()), Letter(0, 2, dl(topic="elsewhere")), Letter(1, 3, dl(value=b"")),
               Letter(1, 4, dl(topic="p.generations", key=None)),
               Letter(1, 5, dl().model_copy(update={"truncated": True, "source_partition": 2, "source_offset": 9}))]
    go, refused, repeats = plan_replay(letters, frozenset({"p.feedback", "p.generations"}))
    assert [x.offset for x in go] == [1, 4] and repeats == {}
    assert [(x.offset, why) for x, why in refused] == [
        (2, "elsewhere is not a stage input of this deployment"), (3, "no original value to replay"),
        (5, "only the start of the record is quoted; the whole record is at p.feedback[2]@9")]


def test_show_prints_where_why_and_the_original_bytes():
    text = show([Letter(0, 4, dl(value=b"x" * 500)), Letter(1, 9, dl(key=None))], limit=1, width=50)
    assert "[0:4]" in text and "ingest invalid: why" in text and "p.feedback[1]@7 key=b'g1'" in text
    assert "value (500 bytes): " + "x" * 50 + " ..." in text and "[1:9]" not in text
    assert "key=None" in show([Letter(1, 9, dl(key=None))], limit=5)
    assert show([], limit=5) == "no dead letters match"


def test_show_and_the_summary_print_what_a_record_holds_escaped():
    # anyone who can write a topic chooses a dead letter's bytes, and its detail quotes them: a
    # terminal must not take them as line breaks, escape sequences or bidirectional overrides
    forged = "ok\nfake [0:1] line\x1b[2J\x9b31m\u202eevil\u2028"
    letter = dl(value=forged.encode(), reason="invalid\x1b[8m", stage="ingest\u2066").model_copy(
        update={"detail": forged})
    text = show([Letter(0, 4, letter)], limit=5)
    assert len(text.splitlines()) == 3  # where, from, value: no line of the record's making
    assert not any(c in text for c in "\x1b\x9b\u202e\u2028\u2066")
    assert "ok\\nfake [0:1] line\\x1b[2J\\x9b31m\\u202eevil\\u2028" in text
    summary = Summary()
    summary.add(letter)
    rendered = summary.render()
    assert not any(c in rendered for c in "\x1b\u2066") and "invalid\\x1b[8m" in rendered


def test_plan_replay_sends_a_record_that_failed_again_once():
    # the record failed, was replayed, failed again: two letters, one record (marked as the
    # replay of both, so that the next replay skips both)
    letters = [Letter(0, 1, dl("orphan_feedback", at=1.0)), Letter(1, 8, dl("orphan_feedback", at=50.0)),
               Letter(0, 9, dl("orphan_feedback", at=60.0, key=b"g2")),  # same bytes, another key
               Letter(1, 12, dl("orphan_feedback", at=70.0, value=b'{"x":2}'))]
    go, refused, repeats = plan_replay(letters, frozenset({"p.feedback"}))
    assert [x.offset for x in go] == [1, 9, 12] and refused == []
    assert {at: [(x.partition, x.offset) for x in xs] for at, xs in repeats.items()} == {(0, 1): [(1, 8)]}


@pytest.mark.parametrize("topics, waves", [
    (["p.generations", "p.feedback", "p.generations", "p.feedback"], [[2, 4], [1, 3]]),
    (["p.generations", "p.episodes"], [[1, 2]]),
    (["p.feedback"], [[1]]),
    ([], []),
])
def test_replay_sends_feedback_first_in_its_own_wave(topics, waves):
    """Orphaned feedback must be waiting when its replayed generation arrives (the generation's
    window is long past, so it closes soon after): feedback is sent, and acked, before anything else."""
    letters = [Letter(0, i, dl(topic=t)) for i, t in enumerate(topics, start=1)]
    assert [[x.offset for x in wave] for wave in replay_waves(letters, T.feedback)] == waves


def test_plan_replay_refuses_a_partition_its_topic_does_not_have():
    letters = [Letter(0, 1, dl()), Letter(0, 2, dl().model_copy(update={"source_partition": 5}))]
    go, refused, _ = plan_replay(letters, frozenset({"p.feedback"}), {"p.feedback": 2})
    assert [x.offset for x in go] == [1]
    assert [(x.offset, why) for x, why in refused] == [(2, "p.feedback has no partition 5 (it has 2)")]


@pytest.mark.parametrize("change", [
    {"value_b64": "abc"}, {"value_b64": "\u00e9\u00e9\u00e9\u00e9"}, {"key_b64": "a"},
    {"source_partition": -5}, {"source_offset": -1},
])
def test_a_letter_the_cli_could_not_use_is_unreadable_not_a_crash(change):
    """Written by some other tool, such a letter made `show` and `replay` exit with a traceback."""
    raw = dl().model_dump(mode="json") | change
    with pytest.raises(ContractError) as exc:
        decode(DeadLetterEvent, json.dumps(raw).encode())
    assert exc.value.reason == "invalid"


def test_the_largest_letter_a_stage_writes_is_readable():
    from flywheel.contracts import DEADLETTER_QUOTE_BYTES, MAX_DEADLETTER_BYTES

    big = dl(value=b"x" * (DEADLETTER_QUOTE_BYTES - 100), key=b"k" * 50)
    raw = encode(big)
    assert MAX_RECORD_BYTES < len(raw) <= MAX_DEADLETTER_BYTES
    assert decode(DeadLetterEvent, raw, max_bytes=MAX_DEADLETTER_BYTES) == big

"""Table tests for the join rules (ingest/join.py) and the stage's handling of messy input."""

from __future__ import annotations

import base64

import pytest
from kafka.consumer.fetcher import ConsumerRecord
from prometheus_client import CollectorRegistry

from flywheel.contracts import (
    MAX_DEADLETTER_BYTES,
    MAX_RECORD_BYTES,
    DeadLetterEvent,
    EpisodeEvent,
    FeedbackEvent,
    GenerationEvent,
    SamplingParams,
    Topics,
    decode,
    encode,
)
from flywheel.settings import IngestSettings
from flywheel.stream.store import StateStore
from ingest.join import (
    closes_at,
    closes_on_signal,
    generation_deadline,
    is_from_future,
    is_late,
    orphan_deadline,
    resolve,
    signal_of,
)
from ingest.stage import DEADLETTER_REASONS, SCHEMA, IngestStage, episode_bytes


def fb(fid: str, signal: str, t: float, text: str | None = None, ms: float | None = None,
       user: str | None = None) -> FeedbackEvent:
    return FeedbackEvent(feedback_id=fid, generation_id="g", signal=signal, edited_text=text,
                         decision_ms=ms, user_id=user, created_at=t, received_at=t)


@pytest.mark.parametrize("feedback, signal, text, ids, timed_out, conflicted", [
    ([], "ignore", None, (), True, False),
    ([fb("a", "accept", 1)], "accept", None, ("a",), False, False),
    ([fb("a", "accept", 1), fb("a", "accept", 1)], "accept", None, ("a",), False, False),  # duplicate id
    ([fb("a", "accept", 1), fb("b", "reject", 2)], "reject", None, ("a", "b"), False, True),  # latest wins
    ([fb("b", "reject", 2), fb("a", "accept", 1)], "reject", None, ("a", "b"), False, True),  # order-free
    ([fb("a", "accept", 1), fb("b", "edit", 2, "new")], "edit", "new", ("a", "b"), False, True),
    ([fb("a", "edit", 1, "x"), fb("b", "edit", 2, "y")], "edit", "y", ("a", "b"), False, True),
    ([fb("a", "edit", 1, "x"), fb("b", "edit", 2, "x")], "edit", "x", ("a", "b"), False, False),
    ([fb("a", "accept", 1), fb("b", "ignore", 5)], "accept", None, ("a", "b"), False, False),  # decisive beats ignore
    ([fb("a", "ignore", 1)], "ignore", None, ("a",), False, False),
    ([fb("b", "accept", 1), fb("a", "reject", 1)], "accept", None, ("a", "b"), False, True),  # tie: larger id
])
def test_resolve(feedback, signal, text, ids, timed_out, conflicted):
    r = resolve(feedback)
    assert (r.signal, r.edited_text, r.feedback_ids, r.timed_out, r.conflicted) == (
        signal, text, ids, timed_out, conflicted)


def test_resolve_carries_winner_decision_time():
    assert resolve([fb("a", "accept", 1, ms=10), fb("b", "reject", 2, ms=99)]).decision_ms == 99


@pytest.mark.parametrize("feedback, rater", [
    ([], None),
    ([fb("a", "accept", 1)], None),  # feedback that named no user
    ([fb("a", "accept", 1, user="")], None),
    ([fb("a", "accept", 1, user="r1")], "r1"),
    ([fb("a", "accept", 1, user="r1"), fb("b", "reject", 2, user="r2")], "r2"),  # the winner's user
    ([fb("a", "accept", 1, user="r1"), fb("b", "ignore", 5, user="r2")], "r1"),  # decisive beats ignore
])
def test_resolve_names_the_winner_as_rater(feedback, rater):
    assert resolve(feedback).rater_id == rater


def other(fid: str, signal: str, t: float, user: str = "someone-else") -> FeedbackEvent:
    """Feedback serving recorded on another user's answer (serve.feedback_other_user = "record")."""
    return FeedbackEvent(feedback_id=fid, generation_id="g", signal=signal, edited_text="x" if signal == "edit" else None,
                         user_id=user, created_at=t, received_at=t, other_user=True)


@pytest.mark.parametrize("feedback, signal, ids, timed_out, rater", [
    ([other("x", "accept", 1)], "ignore", (), True, None),  # no one's judgement: as if none came
    ([fb("a", "reject", 1, user="owner"), other("x", "accept", 2)], "reject", ("a",), False, "owner"),
    ([fb("a", "reject", 1), other("x", "accept", 2), other("y", "edit", 3)], "reject", ("a",), False, None),
])
def test_feedback_of_another_user_is_never_folded_into_the_signal(feedback, signal, ids, timed_out, rater):
    r = resolve(feedback)
    assert (r.signal, r.feedback_ids, r.timed_out, r.rater_id, r.conflicted) == (signal, ids, timed_out, rater, False)


@pytest.mark.parametrize("event, signal", [
    (fb("a", "accept", 1), "accept"),
    (other("x", "accept", 1), "ignore"),  # another user's accept must not close the owner's window early
])
def test_signal_of_for_early_emission(event, signal):
    assert signal_of(event) == signal


def test_other_user_is_on_the_wire_only_when_set():
    """Fields added without changing old records' bytes: an owner's feedback encodes as before."""
    assert b"other_user" not in encode(fb("a", "accept", 1, user="u"))
    marked = encode(other("x", "accept", 1))
    assert b'"other_user":true' in marked and decode(FeedbackEvent, marked).other_user


@pytest.mark.parametrize("created, deadline, late", [(10.0, 10.0, False), (10.001, 10.0, True), (3.0, 10.0, False)])
def test_is_late(created, deadline, late):
    assert is_late(created, deadline) is late


@pytest.mark.parametrize("created, arrived, wait, deadline", [
    (100.0, 101.0, 10.0, 111.0),  # waits from arrival
    (105.0, 101.0, 10.0, 115.0),  # stamped a little ahead (within max_future_s): from created_at
    (100.0, 5000.0, 10.0, 5010.0),  # a replayed orphan waits afresh
])
def test_orphan_deadline(created, arrived, wait, deadline):
    assert orphan_deadline(created, arrived, wait) == deadline


@pytest.mark.parametrize("deadline, arrived, window, grace, closes", [
    (110.0, 101.0, 10.0, 1.0, 111.0),  # on time: grace after the deadline
    (110.0, 100.5, 10.0, 1.0, 111.0),
    (110.0, 103.0, 10.0, 1.0, 113.0),  # transport took longer than grace: the window counts from arrival
    (110.0, 500.0, 10.0, 1.0, 510.0),  # arrived long after its deadline (a replayed journal): waits afresh
    (110.0, 90.0, 10.0, 0.0, 110.0),  # arrived "before" it completed (clock skew): the deadline rules
])
def test_closes_at(deadline, arrived, window, grace, closes):
    assert closes_at(deadline, arrived, window, grace) == closes


@pytest.mark.parametrize("close_at, signal, now, emit_after, closes", [
    (111.0, "accept", 101.0, None, 111.0),  # early emission off: the window rules
    (111.0, "accept", 101.0, 1.0, 102.0),  # a decisive signal: a second after it came
    (111.0, "reject", 101.0, 0.0, 101.0),
    (111.0, "edit", 101.0, 1.0, 102.0),
    (111.0, "ignore", 101.0, 1.0, 111.0),  # an explicit ignore decides nothing: the window rules
    (111.0, "accept", 110.5, 5.0, 111.0),  # never later than the window would have closed
])
def test_closes_on_signal(close_at, signal, now, emit_after, closes):
    assert closes_on_signal(close_at, signal, now, emit_after) == closes


@pytest.mark.parametrize("stamped, now, limit, future", [
    (1000.0, 1000.0, 600, False), (1600.0, 1000.0, 600, False), (1600.5, 1000.0, 600, True),
    (10.0, 1000.0, 600, False),  # the past is never skew: backfills and replays are old
])
def test_is_from_future(stamped, now, limit, future):
    assert is_from_future(stamped, now, limit) is future


def test_generation_deadline():
    assert generation_deadline(100.0, 5.0) == 105.0


# -- the stage over a real SQLite store, fed hand-made records --------------------------------
T = Topics("u.")


def rec(topic: str, key: str | None, value: bytes, offset: int) -> ConsumerRecord:
    return ConsumerRecord(topic=topic, partition=0, leader_epoch=-1, offset=offset, timestamp=0,
                          timestamp_type=0, key=key.encode() if key else None, value=value, headers=[],
                          checksum=None, serialized_key_size=0, serialized_value_size=len(value),
                          serialized_header_size=0)


def gen(gid: str, t: float) -> GenerationEvent:
    return GenerationEvent(
        generation_id=gid, group_id=gid, model_name="m", model_version=1, user_id="u", endpoint="chat",
        created_at=t, completed_at=t, latency_ms=1, prompt_text="p", prompt_token_ids=(1,),
        completion_text="c", completion_token_ids=(2,), logprobs=(-1.0,),
        sampling=SamplingParams(temperature=1, top_p=1, max_tokens=4), finish_reason="stop")


def outputs(store: StateStore) -> tuple[list[EpisodeEvent], list[DeadLetterEvent]]:
    rows = store.pending([0])
    eps = [decode(EpisodeEvent, r.value) for r in rows if r.topic == T.episodes]
    dls = [decode(DeadLetterEvent, r.value, max_bytes=MAX_DEADLETTER_BYTES) for r in rows if r.topic == T.deadletter]
    return eps, dls


@pytest.fixture
def stage(tmp_path):
    store = StateStore(tmp_path / "s.sqlite3", SCHEMA)
    yield IngestStage(IngestSettings(window_s=10, orphan_wait_s=10, grace_s=1), T, store, CollectorRegistry()), store
    store.close()


def test_every_dead_letter_reason_is_exported_at_zero_from_the_start(tmp_path):
    """A series born holding a burst has no rate() for it: the DeadLettersSpike alert would miss
    the first burst of a reason this process had not seen yet."""
    registry = CollectorRegistry()
    store = StateStore(tmp_path / "s.sqlite3", SCHEMA)
    IngestStage(IngestSettings(), T, store, registry)
    store.close()
    assert {"late_feedback", "orphan_feedback", "wrong_key", "invalid"} <= set(DEADLETTER_REASONS)
    for reason in DEADLETTER_REASONS:
        assert registry.get_sample_value("ingest_deadletters_total", {"reason": reason}) == 0.0


def run(stage_store, records, now):
    stage, store = stage_store
    with store.txn():
        stage.process(records, now)
        stage.tick({0}, now)


def test_stage_joins_feedback_before_generation_and_emits_once_at_close(stage):
    f = fb("f1", "accept", 101, user="r1")
    run(stage, [rec(T.feedback, "g", encode(f), 0), rec(T.generations, "g", encode(gen("g", 100)), 0),
                rec(T.feedback, "g", encode(f), 1)], now=102)
    run(stage, [], now=111.5)
    assert outputs(stage[1]) == ([], [])  # window still open: 10 s from the generation's arrival at 102
    run(stage, [], now=112.5)
    eps, dls = outputs(stage[1])
    assert [(e.generation_id, e.signal, e.feedback_ids, e.rater_id) for e in eps] == [("g", "accept", ("f1",), "r1")]
    assert not dls
    run(stage, [rec(T.feedback, "g", encode(f), 2), rec(T.generations, "g", encode(gen("g", 100)), 1)], now=113)
    assert len(outputs(stage[1])[0]) == 1  # late duplicate feedback and generation fold away


@pytest.fixture
def early(tmp_path):
    store = StateStore(tmp_path / "s.sqlite3", SCHEMA)
    cfg = IngestSettings(window_s=10, orphan_wait_s=10, grace_s=1, emit_after_signal_s=1)
    yield IngestStage(cfg, T, store, CollectorRegistry()), store
    store.close()


@pytest.mark.parametrize("feedback_first", [False, True])
def test_early_emission_emits_a_second_after_the_signal_and_dead_letters_a_later_one(early, feedback_first):
    g = rec(T.generations, "g", encode(gen("g", 100)), 0)
    f = rec(T.feedback, "g", encode(fb("f1", "accept", 101, user="r1")), 0)
    run(early, [f, g] if feedback_first else [g, f], now=101)
    run(early, [], now=101.5)
    assert outputs(early[1]) == ([], [])  # signals arriving within the second still fold in
    run(early, [rec(T.feedback, "g", encode(fb("f2", "reject", 101.4, user="r1")), 1)], now=101.6)
    run(early, [], now=102.1)
    eps, dls = outputs(early[1])
    assert [(e.signal, e.feedback_ids, e.conflicted) for e in eps] == [("reject", ("f1", "f2"), True)]
    run(early, [rec(T.feedback, "g", encode(fb("f3", "accept", 103)), 2)], now=103)
    eps, dls = outputs(early[1])
    assert len(eps) == 1 and [d.reason for d in dls] == ["late_feedback"]  # the changed mind, kept for audit


def test_early_emission_waits_out_the_window_without_a_decisive_signal(early):
    run(early, [rec(T.generations, "g", encode(gen("g", 100)), 0),
                rec(T.feedback, "g", encode(fb("f1", "ignore", 101)), 0)], now=101)
    run(early, [], now=105)
    assert outputs(early[1]) == ([], [])
    run(early, [], now=111.5)
    assert [(e.signal, e.timed_out) for e in outputs(early[1])[0]] == [("ignore", False)]


def test_stage_metrics_count_episodes_by_signal_and_what_waits_in_the_window(tmp_path):
    registry = CollectorRegistry()
    store = StateStore(tmp_path / "s.sqlite3", SCHEMA)
    stage = IngestStage(IngestSettings(window_s=10, orphan_wait_s=10, grace_s=1), T, store, registry)

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    def on(gid: str, fid: str, signal: str, t: float) -> ConsumerRecord:
        return rec(T.feedback, gid, encode(fb(fid, signal, t).model_copy(update={"generation_id": gid})), 0)

    records = [rec(T.generations, g, encode(gen(g, 100)), i) for i, g in enumerate(("a", "b", "c"))]
    records += [on("a", "fa", "accept", 101), on("b", "fb1", "accept", 101), on("b", "fb2", "reject", 102),
                on("b", "fb2", "reject", 102),  # a repeat: folded
                on("x", "fx", "accept", 101)]  # its generation has not come (yet)
    run((stage, store), records, now=102)
    assert (value("ingest_window_open_records", kind="generation"), value("ingest_window_open_records", kind="feedback")) == (3, 4)
    assert value("ingest_duplicates_total", kind="feedback") == 1
    run((stage, store), [], now=113)  # the three windows close (a prune of the gauge is due 10 s on)
    assert (value("ingest_window_open_records", kind="generation"), value("ingest_window_open_records", kind="feedback")) == (0, 1)
    signals = {s: value("ingest_episodes_total", signal=s) for s in ("accept", "reject", "ignore")}
    assert signals == {"accept": 1, "reject": 1, "ignore": 1}  # b's conflict resolved to reject (the later)
    assert value("ingest_conflicts_total") == 1
    store.close()


def test_stage_dead_letters_late_orphan_and_bad_records(stage):
    late = fb("late", "reject", 111)  # acted after the window (deadline 110)
    orphan = FeedbackEvent(feedback_id="o", generation_id="nope", signal="accept", created_at=100, received_at=100)
    run(stage, [rec(T.generations, "g", encode(gen("g", 100)), 0), rec(T.feedback, "g", encode(late), 0),
                rec(T.feedback, "nope", encode(orphan), 1), rec(T.feedback, "g", b"{oops", 2),
                rec(T.generations, "other", encode(gen("g2", 100)), 1)], now=101)
    run(stage, [], now=112.5)  # the orphan arrived at 101: it waits until 111, + grace
    eps, dls = outputs(stage[1])
    assert [(e.generation_id, e.signal, e.timed_out) for e in eps] == [("g", "ignore", True)]
    assert sorted(d.reason for d in dls) == ["late_feedback", "orphan_feedback", "undecodable", "wrong_key"]
    assert {d.source_offset for d in dls if d.reason == "orphan_feedback"} == {1}


def test_feedback_for_a_window_closed_before_the_stage_remembers_is_an_orphan_that_says_so(tmp_path):
    """Past ``closed_retention_s`` a closed generation is forgotten: feedback delivered that long
    after it was made can no longer be told from an orphan, so its dead letter's detail says it
    may be very late. A fresh orphan's does not, however long it waited (``orphan_wait_s`` here
    exceeds window and retention together)."""
    store = StateStore(tmp_path / "s.sqlite3", SCHEMA)
    stage_store = IngestStage(IngestSettings(window_s=10, orphan_wait_s=40, grace_s=1, closed_retention_s=20),
                              T, store, CollectorRegistry()), store
    run(stage_store, [rec(T.generations, "g", encode(gen("g", 100)), 0)], now=100)
    run(stage_store, [], now=112)  # closed: the episode is out
    run(stage_store, [rec(T.feedback, "g", encode(fb("f1", "accept", 101)), 0)], now=125)  # late, plainly
    run(stage_store, [], now=137)  # closed 25 s ago: forgotten
    very_late = FeedbackEvent(feedback_id="f2", generation_id="g", signal="reject", created_at=105, received_at=150)
    orphan = FeedbackEvent(feedback_id="o", generation_id="nope", signal="accept", created_at=150, received_at=150)
    run(stage_store, [rec(T.feedback, "g", encode(very_late), 1), rec(T.feedback, "nope", encode(orphan), 2)], now=150)
    run(stage_store, [], now=192)
    eps, dls = outputs(store)
    assert [e.generation_id for e in eps] == ["g"]
    assert [(d.reason, d.source_offset) for d in dls] == [
        ("late_feedback", 0), ("orphan_feedback", 1), ("orphan_feedback", 2)]
    assert "came 45s after it was made" in dls[1].detail
    assert "longer ago than ingest.closed_retention_s (20s)" in dls[1].detail
    assert dls[2].detail == "generation nope never arrived"
    store.close()


def test_an_episode_over_its_limit_is_dead_lettered_at_close(stage):
    """Every input within its limit can still add up to an episode over MAX_EPISODE_BYTES: a
    generation near its limit, an edit near its limit and thousands of distinct feedback ids
    folded in. Reward would refuse that episode; so ingest dead-letters its generation, and every
    feedback record folded into it: no user signal disappears without a letter saying where it was."""
    big = gen("g", 100).model_copy(update={"prompt_text": "p" * (MAX_RECORD_BYTES - 10_000)})
    edit = fb("e" * 128, "edit", 101, text="x" * 1_000_000)
    votes = [fb(f"{i:0128d}", "accept", 101) for i in range(2_000)]
    run(stage, [rec(T.generations, "g", encode(big), 7), rec(T.generations, "h", encode(gen("h", 100)), 8),
                *(rec(T.feedback, "g", encode(f), i) for i, f in enumerate([edit, *votes]))], now=101)
    run(stage, [], now=112.5)
    eps, dls = outputs(stage[1])
    assert [e.generation_id for e in eps] == ["h"]
    dead, *folded = dls
    assert (dead.reason, dead.source_topic, dead.source_partition, dead.source_offset, dead.truncated) == (
        "oversized", T.generations, 0, 7, False)
    assert "2001 feedback records" in dead.detail and base64.b64decode(dead.value_b64) == encode(big)
    assert {(d.reason, d.source_topic, d.key_b64) for d in folded} == {("oversized", T.feedback, "Zw==")}
    assert sorted(d.source_offset for d in folded) == list(range(2001))
    assert {base64.b64decode(d.value_b64) for d in folded} == {encode(f) for f in [edit, *votes]}
    run(stage, [rec(T.feedback, "g", encode(votes[0]), 3000)], now=113)  # its window is closed: a duplicate
    assert outputs(stage[1]) == (eps, dls)


def test_a_key_that_is_not_utf8_never_matches_a_generation_id(stage):
    """Compared as text with replacement characters, key ``g\\xff`` would pass as the id ``g\ufffd``
    and the record could land on another partition than its generation's other records."""
    odd = rec(T.generations, None, encode(gen("g\ufffd", 100)), 0)._replace(key=b"g\xff")
    run(stage, [odd, rec(T.generations, "g", encode(gen("g", 100)), 1)], now=101)
    (dead,) = outputs(stage[1])[1]
    assert (dead.reason, dead.source_offset) == ("wrong_key", 0)
    assert "b'g\\xff'" in dead.detail


def run_split(stage, records: list[ConsumerRecord], one_batch: bool, now: float) -> None:
    """``records`` as one batch, or as a batch each."""
    for batch in [records] if one_batch else [[r] for r in records]:
        run(stage, batch, now=now)


@pytest.mark.parametrize("one_batch", [True, False])
def test_a_generation_id_reused_for_another_completion_is_dead_lettered_not_folded(stage, one_batch):
    """Folded as a repeat, the second completion was lost without a trace, and its feedback
    judged against the first one's text: a repeat with the same content still counts once."""
    first = gen("g", 100)
    other = first.model_copy(update={"completion_text": "another answer", "user_id": "v"})
    run_split(stage, [rec(T.generations, "g", encode(first), 0), rec(T.generations, "g", encode(other), 1),
                      rec(T.generations, "g", encode(first), 2)], one_batch, now=101)
    run(stage, [], now=112.5)
    eps, dls = outputs(stage[1])
    assert [(e.generation_id, e.generation.completion_text) for e in eps] == [("g", "c")]
    assert [(d.reason, d.source_offset) for d in dls] == [("reused_generation_id", 1)]
    assert "already names another generation" in dls[0].detail
    assert stage[0].m.duplicates.labels("generation")._value.get() == 1  # the third, a repeat


def test_a_repeat_of_a_generation_stored_in_another_encoding_is_a_repeat(stage):
    """Stores written by earlier versions hold generations as they were sent: the repeat of one
    is the same event in other bytes, not another generation under its id."""
    import json

    g = gen("g", 100)
    as_sent = json.dumps(json.loads(encode(g)), indent=1, sort_keys=True).encode()
    assert as_sent != encode(g)
    with stage[1].txn():
        stage[1].db.execute("INSERT INTO gens (gid, shard, deadline, raw, close_at) VALUES ('g', 0, 110, ?, 111)",
                            (as_sent,))
    run(stage, [rec(T.generations, "g", encode(g), 3)], now=101)
    assert outputs(stage[1])[1] == [] and stage[0].m.duplicates.labels("generation")._value.get() == 1


@pytest.mark.parametrize("one_batch", [True, False])
def test_a_feedback_id_reused_for_another_generation_is_dead_lettered_not_folded(stage, one_batch):
    """Folded as a repeat, the second signal was lost without a trace: it is not a repeat (its
    generation differs), and its producer mints ids that collide."""
    first = fb("f1", "accept", 101)
    reused = FeedbackEvent(feedback_id="f1", generation_id="h", signal="reject", created_at=101, received_at=101)
    run_split(stage, [rec(T.feedback, "g", encode(first), 0), rec(T.feedback, "h", encode(reused), 1),
                      rec(T.feedback, "g", encode(first), 2)], one_batch, now=101)
    run(stage, [rec(T.generations, "g", encode(gen("g", 100)), 0), rec(T.generations, "h", encode(gen("h", 100)), 1)],
        now=102)
    run(stage, [], now=112.5)
    eps, dls = outputs(stage[1])
    assert sorted((e.generation_id, e.signal, e.feedback_ids) for e in eps) == [
        ("g", "accept", ("f1",)), ("h", "ignore", ())]
    assert [(d.reason, d.source_offset) for d in dls] == [("reused_feedback_id", 1)]
    assert "already names feedback on generation 'g'" in dls[0].detail


def test_replayed_orphan_waits_afresh_and_joins_its_generation(stage):
    """The replay story (dashboards/runbooks/dead-letters.md): feedback dead-lettered as an orphan
    and replayed before its generation turns up joins it; feedback whose generation turned up
    after it was dead-lettered cannot, because that generation closed, ``window_s`` after it
    arrived, as ``ignore``."""
    f_wait, f_gone = fb("f1", "accept", 101), FeedbackEvent(
        feedback_id="f2", generation_id="h", signal="reject", created_at=101, received_at=101)
    run(stage, [rec(T.feedback, "g", encode(f_wait), 0), rec(T.feedback, "h", encode(f_gone), 1)], now=101)
    run(stage, [], now=112.5)
    assert sorted(d.reason for d in outputs(stage[1])[1]) == ["orphan_feedback", "orphan_feedback"]
    # h's generation (completed before its feedback) arrives: its window is long past
    run(stage, [rec(T.generations, "h", encode(gen("h", 100)), 2)], now=200)
    run(stage, [], now=210.5)  # and closes window_s later, no feedback having come
    # both orphans are replayed; g's generation arrives afterwards, as late as h's
    run(stage, [rec(T.feedback, "g", encode(f_wait), 2), rec(T.feedback, "h", encode(f_gone), 3)], now=300)
    run(stage, [], now=305)  # 101 + 10 would have orphaned the replay again here
    run(stage, [rec(T.generations, "g", encode(gen("g", 100)), 3)], now=306)
    run(stage, [], now=316.5)
    eps, dls = outputs(stage[1])
    assert sorted((e.generation_id, e.signal, e.feedback_ids, e.timed_out) for e in eps) == [
        ("g", "accept", ("f1",), False), ("h", "ignore", (), True)]
    assert sorted((d.reason, d.source_offset) for d in dls) == [
        ("late_feedback", 3), ("orphan_feedback", 0), ("orphan_feedback", 1)]


def test_stage_dead_letters_records_stamped_far_ahead_and_keeps_no_state_for_them(stage):
    # now=100, max_future_s=600: 700 is at the limit, 701 beyond it
    ahead = FeedbackEvent(feedback_id="fa", generation_id="g2", signal="accept", created_at=701, received_at=100)
    run(stage, [rec(T.generations, "g", encode(gen("g", 700)), 0), rec(T.generations, "g2", encode(gen("g2", 701)), 1),
                rec(T.feedback, "g2", encode(ahead), 0)], now=100)
    store = stage[1]
    eps, dls = outputs(store)
    assert eps == []
    assert sorted((d.reason, d.source_topic, d.source_offset) for d in dls) == [
        ("clock_skew", T.feedback, 0), ("clock_skew", T.generations, 1)]
    assert "601s ahead" in dls[0].detail and "ingest.max_future_s" in dls[0].detail
    assert [r[0] for r in store.db.execute("SELECT gid FROM gens")] == ["g"]
    assert store.db.execute("SELECT count(*) FROM fbs").fetchone()[0] == 0


@pytest.mark.parametrize("field, literal", [
    (b"_at", b"NaN"), (b"_at", b"Infinity"), (b"_at", b"1e400"),
    (b"_text", b'"\\ud800"'),  # a lone surrogate: re-encoding the generation failed the batch
])
def test_stage_dead_letters_poison_records_instead_of_failing_its_batch(stage, field, literal):
    """Each of these once failed the batch's transaction (a NaN time reached SQLite as NULL; a
    lone surrogate could not be re-encoded), and the stage crash-looped on the same batch after
    every restart."""
    g_old, f_old = (b'"completed_at":100.0', b'"created_at":101.0') if field == b"_at" else (
        b'"completion_text":"c"', b'"edited_text":"e"')
    good = rec(T.generations, "g", encode(gen("g", 100)), 0)
    bad_gen = rec(T.generations, "h", encode(gen("h", 100)).replace(g_old, g_old.split(b":")[0] + b":" + literal), 1)
    bad_fb = rec(T.feedback, "g", encode(fb("f", "edit", 101, text="e")).replace(f_old, f_old.split(b":")[0] + b":" + literal), 0)
    assert bad_gen.value != good.value.replace(b'"g"', b'"h"') and literal in bad_fb.value
    run(stage, [good, bad_gen, bad_fb], now=101)
    run(stage, [], now=112)
    eps, dls = outputs(stage[1])
    assert [(e.generation_id, e.signal) for e in eps] == [("g", "ignore")]
    assert sorted((d.reason, d.source_topic) for d in dls) == [("invalid", T.feedback), ("invalid", T.generations)]


def test_stage_dead_letters_a_token_id_its_archive_cannot_hold(stage):
    """A token id past int32 once failed every archive write of its batch: the stage could no
    longer deliver anything."""
    big = encode(gen("h", 100)).replace(b'"completion_token_ids":[2]', b'"completion_token_ids":[2147483648]')
    run(stage, [rec(T.generations, "g", encode(gen("g", 100)), 0), rec(T.generations, "h", big, 1)], now=101)
    run(stage, [], now=112)
    eps, dls = outputs(stage[1])
    assert [e.generation_id for e in eps] == ["g"]
    assert [(d.reason, d.source_offset) for d in dls] == [("invalid", 1)]


def test_a_generation_that_arrives_after_its_window_waits_for_the_feedback_behind_it(stage):
    """After a broker outage serving replays its journal: a generation reaches the stage long
    after its deadline, its in-time feedback a few seconds later. Closed at once, the generation
    had made that feedback ``late_feedback``; feedback acted on after the deadline is still late."""
    run(stage, [rec(T.generations, "g", encode(gen("g", 100)), 0)], now=500)
    run(stage, [], now=503)  # caught up, nothing else yet: the window must stay open
    assert outputs(stage[1]) == ([], [])
    in_time, too_late = fb("f1", "accept", 105), fb("f2", "reject", 111)
    run(stage, [rec(T.feedback, "g", encode(in_time), 0), rec(T.feedback, "g", encode(too_late), 1)], now=504)
    run(stage, [], now=509.5)
    assert outputs(stage[1])[0] == []
    run(stage, [], now=510.5)
    eps, dls = outputs(stage[1])
    assert [(e.generation_id, e.signal, e.feedback_ids) for e in eps] == [("g", "accept", ("f1",))]
    assert [(d.reason, d.source_offset) for d in dls] == [("late_feedback", 1)]


def test_a_store_from_before_close_at_keeps_its_open_windows(tmp_path):
    """A data_dir written before ``gens.close_at`` existed: its open windows close by the old rule
    (grace after the deadline) and new generations take the new one."""
    old = SCHEMA.replace("raw BLOB NOT NULL, close_at REAL NOT NULL, off INTEGER, hdr BLOB);", "raw BLOB NOT NULL);\n"
                         "CREATE INDEX IF NOT EXISTS gens_due ON gens (shard, deadline);")
    assert old != SCHEMA
    store = StateStore(tmp_path / "s.sqlite3", old)
    with store.txn():
        store.db.execute("INSERT INTO gens VALUES ('g', 0, 110.0, ?)", (encode(gen("g", 100)),))
    store.close()
    store = StateStore(tmp_path / "s.sqlite3", SCHEMA)
    stage = IngestStage(IngestSettings(window_s=10, orphan_wait_s=10, grace_s=1), T, store, CollectorRegistry())
    assert "gens_due" not in {r[0] for r in store.db.execute("SELECT name FROM sqlite_master WHERE type='index'")}
    assert {"close_at", "off"} <= {r[1] for r in store.db.execute("PRAGMA table_info(gens)")}
    run((stage, store), [rec(T.generations, "h", encode(gen("h", 100)), 0)], now=110.5)
    run((stage, store), [], now=111.5)
    assert [e.generation_id for e in outputs(store)[0]] == ["g"]  # h arrived at 110.5: open until 120.5
    run((stage, store), [], now=121)
    assert [e.generation_id for e in outputs(store)[0]] == ["g", "h"]
    store.close()


def test_stage_waits_for_caught_up_shards(stage):
    st, store = stage
    with store.txn():
        st.process([rec(T.generations, "g", encode(gen("g", 100)), 0)], 100)
        st.tick(set(), 200)  # shard 0 not caught up: the window must not close yet
    assert outputs(store) == ([], [])


def test_stage_dead_letters_early_feedback_that_turns_out_late(stage):
    # waiting feedback is read back from the store (earlier batch) and from the same batch
    early = FeedbackEvent(feedback_id="e1", generation_id="g", signal="accept", created_at=111, received_at=111)
    same = FeedbackEvent(feedback_id="e2", generation_id="g", signal="reject", created_at=112, received_at=112)
    ok = fb("ok", "edit", 105, text="t")
    run(stage, [rec(T.feedback, "g", encode(early), 0)], now=100)
    run(stage, [rec(T.feedback, "g", encode(same), 1), rec(T.feedback, "g", encode(ok), 2),
                rec(T.generations, "g", encode(gen("g", 100)), 0)], now=101)
    run(stage, [], now=112)
    eps, dls = outputs(stage[1])
    assert [(e.signal, e.edited_text, e.feedback_ids) for e in eps] == [("edit", "t", ("ok",))]
    assert sorted((d.reason, d.source_offset) for d in dls) == [("late_feedback", 0), ("late_feedback", 1)]


@pytest.mark.parametrize("feedback", [
    [],
    [fb("a", "accept", 1, ms=12.5)],
    [fb("a", "edit", 1, text="é \"quoted\"\n", user="r"), fb("b", "reject", 0.1)],
])
def test_spliced_episode_is_the_encoded_episode(feedback):
    g = gen("g", 1700000000.123456)
    res = resolve(feedback)
    spliced = episode_bytes(encode(g), res, 1700000010.987654)
    built = EpisodeEvent(generation=g, signal=res.signal, edited_text=res.edited_text,
                         decision_ms=res.decision_ms, feedback_ids=res.feedback_ids,
                         timed_out=res.timed_out, conflicted=res.conflicted, rater_id=res.rater_id,
                         resolved_at=1700000010.987654)
    assert decode(EpisodeEvent, spliced) == built
    assert spliced == encode(built)


@pytest.mark.parametrize(("chunk", "parses"), [(4096, [3]), (2, [2, 1])])
def test_episode_archive_batch_path_writes_the_row_path_files(tmp_path, monkeypatch, chunk, parses):
    import pyarrow.parquet as pq

    from flywheel.stream import archive
    from flywheel.stream.archive import ParquetArchive
    from flywheel.stream.store import ArchiveRow
    from ingest.archive import EPISODE_SCHEMA, episode_row, episode_table

    monkeypatch.setattr(archive, "TABLE_CHUNK", chunk)  # large batches are parsed in chunks

    values = [
        episode_bytes(encode(gen("a", 100)), resolve([]), 1000.0),
        episode_bytes(encode(gen("b", 100)), resolve([fb("x", "edit", 1, 'é "q"\nz', ms=3.5)]), 1001.5),
        episode_bytes(encode(gen("c", 100)), resolve([fb("y", "accept", 1), fb("z", "reject", 2, user="r")]), 5000.0),
    ]  # resolved in two different hours: two files each
    rows = [ArchiveRow(10 + i, "episodes", v) for i, v in enumerate(values)]
    batches = []
    fast = ParquetArchive(tmp_path / "fast", EPISODE_SCHEMA, episode_row,
                          lambda vs: batches.append(len(vs)) or episode_table(vs))
    slow = ParquetArchive(tmp_path / "slow", EPISODE_SCHEMA, episode_row)
    fast.write("e", rows)
    slow.write("e", rows)
    names = [p.relative_to(tmp_path / "fast") for p in fast.files()]
    assert len(names) == 2 and names == [p.relative_to(tmp_path / "slow") for p in slow.files()]
    for a, b in zip(fast.files(), slow.files()):
        assert pq.read_table(a).equals(pq.read_table(b))
    assert batches == parses and fast.archived_seqs("e", 0, 99) == {10, 11, 12}
    assert [r for p in fast.files() for r in pq.read_table(p).column("rater_id").to_pylist()] == [None, None, "r"]


def test_hours_of_formats_each_stamp_like_hour_of():
    from flywheel.stream.archive import hour_of, hours_of

    # both sides of hour boundaries (1699999200 is one), and hours out of order
    stamps = [1700000000.0, 1699999199.999, 1699999200.0, 1700006400.25, 1700000000.5, 0.0]
    assert hours_of(stamps) == [hour_of(t) for t in stamps]
    assert len(set(hours_of(stamps))) == 4


@pytest.mark.slow  # about 2.3 GB of text through the archive: tens of seconds, several GB of memory
def test_a_write_past_2_gib_of_text_across_an_hour_splits_into_its_hours(tmp_path):
    """One write of the archive queue spanning an hour's edge, with more than 2 GiB in a string
    column (50,000 queued episodes of long chat histories): splitting it by hour must not join
    each column's chunks into one array, which Arrow cannot do past 2 GiB of string data."""
    import pyarrow.parquet as pq

    from flywheel.stream.archive import ParquetArchive
    from flywheel.stream.store import ArchiveRow
    from ingest.archive import EPISODE_SCHEMA, episode_row, episode_table

    prompt = "x" * (4 * 1024 * 1024 - 4096)
    g = gen("g", 100).model_copy(update={"prompt_text": prompt})
    rows = [ArchiveRow(i, "episodes", episode_bytes(encode(g.model_copy(update={"generation_id": f"g{i}"})),
                                                    resolve([]), 1699999199.0 + 2 * (i >= 300)))
            for i in range(600)]
    archive = ParquetArchive(tmp_path, EPISODE_SCHEMA, episode_row, episode_table)
    archive.write("e", rows)
    files = archive.files()
    assert [p.parent.name for p in files] == ["hour=2023-11-14T21", "hour=2023-11-14T22"]
    assert [pq.read_metadata(p).num_rows for p in files] == [300, 300]


def test_a_backlog_of_due_windows_closes_max_batch_per_turn_each_once(tmp_path):
    """Hours of windows can fall due at once (a stage that was down): each turn closes the first
    ``max_batch`` of a shard by closing time and says more are due, so no transaction has to hold
    them all; over the turns every window closes once, in order, ties in closing time included."""
    store = StateStore(tmp_path / "s.sqlite3", SCHEMA)
    stage = IngestStage(IngestSettings(window_s=10, orphan_wait_s=10, grace_s=1, max_batch=7), T, store,
                        CollectorRegistry())
    # 20 generations arrive in one batch, so their windows share one closing time; 5 more later
    records = [rec(T.generations, f"a{i:02d}", encode(gen(f"a{i:02d}", 100)), i) for i in range(20)]
    records += [rec(T.feedback, f"a{i:02d}", encode(fb(f"f{i}", "accept", 101).model_copy(
        update={"generation_id": f"a{i:02d}"})), i) for i in range(0, 20, 3)]
    with store.txn():
        stage.process(records, 101)
        stage.process([rec(T.generations, f"b{i}", encode(gen(f"b{i}", 100)), 20 + i) for i in range(5)], 102)
    closed, turns = [], []
    for _ in range(6):
        before = len(store.pending([0], limit=10**6))
        with store.txn():
            more = stage.tick({0}, 500)
        after = store.pending([0], limit=10**6)
        turns.append((len(after) - before, more))
        closed = [decode(EpisodeEvent, r.value) for r in after]
    assert turns == [(7, True), (7, True), (7, True), (4, False), (0, False), (0, False)]
    ids = [e.generation_id for e in closed]
    assert sorted(ids) == sorted({*(f"a{i:02d}" for i in range(20)), *(f"b{i}" for i in range(5))})
    assert ids[-5:] == [f"b{i}" for i in range(5)]  # the later closing time closes last
    assert {e.generation_id for e in closed if e.signal == "accept"} == {f"a{i:02d}" for i in range(0, 20, 3)}
    assert store.db.execute("SELECT count(*) FROM gens").fetchone() == (0,)
    assert store.db.execute("SELECT count(*) FROM fbs").fetchone() == (0,)
    store.close()


def test_orphaned_feedback_is_dead_lettered_max_batch_per_turn(tmp_path):
    store = StateStore(tmp_path / "s.sqlite3", SCHEMA)
    stage = IngestStage(IngestSettings(window_s=10, orphan_wait_s=10, grace_s=1, max_batch=4), T, store,
                        CollectorRegistry())
    orphans = [FeedbackEvent(feedback_id=f"o{i}", generation_id=f"none{i}", signal="accept", created_at=100,
                             received_at=100) for i in range(10)]
    with store.txn():
        stage.process([rec(T.feedback, o.generation_id, encode(o), i) for i, o in enumerate(orphans)], 101)
    letters = []
    for _ in range(4):
        with store.txn():
            more = stage.tick({0}, 500)
        letters.append((len(outputs(store)[1]), more))
    assert letters == [(4, True), (8, True), (10, False), (10, False)]
    assert {d.reason for d in outputs(store)[1]} == {"orphan_feedback"}
    store.close()


def test_join_rows_an_earlier_version_stored_are_checked_once_at_start(tmp_path):
    """An earlier version stored generations as sent and decoded more leniently (UTF-16 text,
    1.0 for an integer): a window close or archive write that met such a row failed at every
    restart. At start each open row is decoded as arrivals are now: one in another form than
    encode writes is stored canonically, one that no longer decodes is dead-lettered with its
    bytes, once."""
    import json

    store = StateStore(tmp_path / "s.sqlite3", SCHEMA)
    IngestStage(IngestSettings(window_s=10, orphan_wait_s=10, grace_s=1), T, store, CollectorRegistry())
    # not how it is written now: indented, and 100 where encode writes 100.0 (1.0 for an integer
    # no longer decodes at all: tests/unit/test_contracts_strict.py)
    lenient = {**json.loads(encode(gen("lenient", 100))), "created_at": 100}
    invalid = {**json.loads(encode(gen("invalid", 100))), "model_version": 1.5}  # refused by decode today
    utf16 = encode(gen("utf16", 100)).decode().encode("utf-16")
    feedback16 = encode(fb("f16", "accept", 101).model_copy(update={"generation_id": "lenient"})).decode().encode("utf-16")
    with store.txn():
        store.db.executemany("INSERT INTO gens (gid, shard, deadline, raw, close_at, off) VALUES (?, 0, 110, ?, 111, ?)",
                             [("lenient", json.dumps(lenient, indent=1).encode(), 5), ("utf16", utf16, 6),
                              ("invalid", json.dumps(invalid).encode(), 7)])
        store.db.execute("INSERT INTO fbs VALUES ('f16', 'lenient', 0, 101, 111, ?, ?, 0, 9, ?)",
                         (feedback16, T.feedback, b"lenient"))
        store.db.execute("DELETE FROM meta WHERE k='ingest_rows_checked'")  # as a store of that version
    stage = IngestStage(IngestSettings(window_s=10, orphan_wait_s=10, grace_s=1), T, store, CollectorRegistry())
    eps, dls = outputs(store)
    assert eps == [] and sorted((d.reason, d.source_topic, d.source_offset) for d in dls) == [
        ("invalid", T.generations, 7), ("undecodable", T.feedback, 9), ("undecodable", T.generations, 6)]
    assert {base64.b64decode(d.value_b64) for d in dls} == {utf16, feedback16, json.dumps(invalid).encode()}
    assert store.db.execute("SELECT raw FROM gens").fetchall() == [(encode(gen("lenient", 100)),)]
    with store.txn():
        stage.tick({0}, 200)
    eps, _ = outputs(store)
    assert [(e.generation_id, e.generation.model_version, e.signal) for e in eps] == [("lenient", 1, "ignore")]
    IngestStage(IngestSettings(), T, store, CollectorRegistry())  # checked once: nothing more sent
    assert len(store.pending([0])) == 4
    store.close()


def test_rows_of_walks_a_table_in_chunks_while_it_changes(tmp_path):
    from ingest.stage import _rows_of

    store = StateStore(tmp_path / "s.sqlite3", SCHEMA)
    with store.txn():
        store.db.executemany("INSERT INTO gens (gid, shard, deadline, raw, close_at) VALUES (?, 0, 0, x'00', 0)",
                             [(f"g{i}",) for i in range(7)])
        seen = []
        for (gid,) in _rows_of(store.db, "SELECT rowid, gid FROM gens", chunk=2):
            seen.append(gid)
            store.db.execute("DELETE FROM gens WHERE gid=?", (gid,))
    assert seen == [f"g{i}" for i in range(7)] and store.db.execute("SELECT count(*) FROM gens").fetchone() == (0,)
    store.close()


def test_dead_letters_are_counted_by_reason_as_they_are_sent(tmp_path):
    from collections import Counter

    registry = CollectorRegistry()
    store = StateStore(tmp_path / "s.sqlite3", SCHEMA)
    stage = IngestStage(IngestSettings(window_s=10, orphan_wait_s=10, grace_s=1), T, store, registry)
    orphan = FeedbackEvent(feedback_id="o", generation_id="nope", signal="accept", created_at=100, received_at=100)
    records = [rec(T.generations, "g", encode(gen("g", 100)), 0), rec(T.feedback, "g", encode(fb("late", "reject", 111)), 0),
               rec(T.feedback, "nope", encode(orphan), 1), rec(T.feedback, "g", b"{oops", 2), rec(T.feedback, "g", b"", 3),
               rec(T.generations, "other", encode(gen("g2", 100)), 1), rec(T.feedback, "g", b"{oops", 4)]
    run((stage, store), records, now=101)
    run((stage, store), [], now=112.5)
    _, dls = outputs(store)
    sent = Counter(d.reason for d in dls)
    assert sent == {"undecodable": 2, "late_feedback": 1, "orphan_feedback": 1, "wrong_key": 1, "empty": 1}
    counted = {r: registry.get_sample_value("ingest_deadletters_total", {"reason": r}) for r in DEADLETTER_REASONS}
    assert counted == {r: float(sent.get(r, 0)) for r in DEADLETTER_REASONS}
    store.close()

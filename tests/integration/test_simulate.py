"""``flywheel simulate`` against a real app on the shared vLLM engine and broker: simulated users
ask, judge by their hidden taste and send feedback late, each recorded once."""

from __future__ import annotations

import socket
import threading

import pytest
from serving_helpers import KEY, generations

from flywheel.contracts import FeedbackEvent, decode
from local.simulate import TRANSPORT_ERROR, Config, Simulator, summarise
from tests.conftest import read_all

pytestmark = pytest.mark.integration


def test_simulated_users_drive_the_api_and_their_feedback_is_recorded_once(serve, broker, tmp_path):
    s = serve(rate_limit_per_minute=60, rate_limit_burst=3)  # the abuser's flood meets the rate limit
    sim = Simulator(Config(url=s.url, key=KEY, duration_s=4, rate=10, users=12, max_tokens=8, max_delay_s=1.0,
                           seed=3), out=tmp_path / "sim.jsonl")
    rows = sim.run()
    ok = [r for r in rows if r.status == 200]
    assert len(ok) >= 15 and all(r.version == 0 for r in ok)
    assert {r.status for r in rows} <= {200, 429}
    assert (tmp_path / "sim.jsonl").read_text().count("\n") == len(rows)
    judged = [r for r in ok if r.signal is not None]
    assert sim.feedback_sent == len(judged) and sim.feedback_failed == 0
    events = generations(broker, s, expect=len(ok))
    assert {r.generation_id for r in ok} <= set(events)
    fb = [decode(FeedbackEvent, r.value) for r in read_all(broker.bootstrap, s.topics.feedback, expect=len(judged))]
    assert sorted(f.generation_id for f in fb) == sorted(r.generation_id for r in judged)  # each once
    for f in fb:  # feedback came after its answer, as late as the user took
        assert f.received_at >= events[f.generation_id].completed_at
    signals = {r.generation_id: r.signal for r in judged}
    assert all(signals[f.generation_id] == f.signal for f in fb)
    assert all(r.signal == "accept" for r in judged if r.cohort == "abuser")
    summary = summarise(rows)
    assert summary["versions"][0]["requests"] == len(ok) and 0 <= summary["versions"][0]["accept_rate"] <= 1

    # the user named with the feedback is the one who asked: the controller counts outcomes per rater
    assert {f.user_id for f in fb} == {events[f.generation_id].user_id for f in fb}


def test_a_connection_dropped_by_the_server_is_an_error_row_not_a_crash(tmp_path):
    """A server that closes every connection without answering (as a keep-alive connection closed
    under a request looks): each request is recorded with no HTTP status, and the run completes."""
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(0.2)
    done = threading.Event()

    def drop() -> None:
        while not done.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(1.0)
                try:
                    conn.recv(65536)
                except OSError:  # the client gave up (or reset) first: dropped all the same
                    pass

    dropper = threading.Thread(target=drop, daemon=True)
    dropper.start()
    try:
        rows = Simulator(Config(url=f"http://127.0.0.1:{srv.getsockname()[1]}", key="k", duration_s=1, rate=10,
                                users=3, seed=1)).run()
    finally:
        # the thread ends before the socket it accepts on is closed: closed under accept(), it
        # raised after the test (EBADF)
        done.set()
        dropper.join(10)
        srv.close()
    assert not dropper.is_alive()
    assert rows and {r.status for r in rows} == {TRANSPORT_ERROR}
    assert summarise(rows)["refused"] == {TRANSPORT_ERROR: len(rows)}


def test_users_shown_two_answers_judge_each_and_the_two_form_one_group(serve, broker, monkeypatch):
    """A taste with ``choices=2`` (the knowing users'): each request asks ``n=2``, each answer is
    a row judged on its own, and its feedback names that answer's generation, so the trainer's
    grouped loss compares the two answers to one question."""
    from local.simulate import DEFAULT_COHORTS, TASTES, Taste

    monkeypatch.setitem(TASTES, "two", Taste("two", DEFAULT_COHORTS, None, chat=False, choices=2))
    s = serve()
    sim = Simulator(Config(url=s.url, key=KEY, duration_s=3, rate=4, users=12, max_tokens=8, max_delay_s=0.5,
                           seed=5, taste="two", abuser=False))
    ok = [r for r in sim.run() if r.status == 200]
    assert ok and len(ok) % 2 == 0 and len({r.generation_id for r in ok}) == len(ok)
    events = generations(broker, s, expect=len(ok))
    groups: dict[str, list[int]] = {}
    for r in ok:
        groups.setdefault(events[r.generation_id].group_id, []).append(events[r.generation_id].choice_index)
    assert all(sorted(ix) == [0, 1] for ix in groups.values()) and len(groups) == len(ok) // 2
    judged = [r for r in ok if r.signal is not None]
    fb = [decode(FeedbackEvent, r.value) for r in read_all(broker.bootstrap, s.topics.feedback, expect=len(judged))]
    assert sorted(f.generation_id for f in fb) == sorted(r.generation_id for r in judged)

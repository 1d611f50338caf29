"""The start's first broker call (flywheel/stream/serve.py until_the_broker_answers): retried while the
broker does not answer, and given up at once when the process is told to stop, even while the
call itself is blocked on a broker that does not answer."""

from __future__ import annotations

import logging
import threading
import time

import pytest
from kafka.errors import KafkaTimeoutError

from flywheel.stream import serve as runner
from flywheel.stream.serve import until_the_broker_answers


@pytest.fixture(autouse=True)
def short_retry_pause(monkeypatch):
    monkeypatch.setattr(runner, "RETRY_PAUSE_S", 0.05)


def test_a_stop_ends_a_call_blocked_on_the_broker():
    """An admin client's bootstrap blocks up to its timeout (30 s by default): a SIGTERM then
    used to wait it out, past a supervisor's grace period."""
    stop, blocked = threading.Event(), threading.Event()
    threading.Timer(0.3, stop.set).start()
    began = time.monotonic()
    try:
        assert until_the_broker_answers(lambda: blocked.wait(30), stop, "ingest") is False
        assert time.monotonic() - began < 5
    finally:
        blocked.set()


def test_a_call_that_fails_on_the_broker_is_retried_until_it_answers(caplog):
    calls = []

    def call() -> None:
        calls.append(1)
        if len(calls) < 3:
            raise KafkaTimeoutError("no broker")

    with caplog.at_level(logging.WARNING, logger="flywheel.stream.serve"):
        assert until_the_broker_answers(call, threading.Event(), "ingest") is True
    assert len(calls) == 3
    said = [r.getMessage() for r in caplog.records if "does not answer at start" in r.getMessage()]
    assert len(said) == 1 and "KafkaTimeoutError" in said[0]  # said once, not once a try


def test_a_stop_between_tries_ends_the_wait():
    stop, calls = threading.Event(), []

    def call() -> None:
        calls.append(1)
        if len(calls) == 2:
            stop.set()
        raise KafkaTimeoutError("no broker")

    assert until_the_broker_answers(call, stop, "ingest") is False
    assert len(calls) == 2


def test_an_error_that_is_not_the_brokers_is_raised():
    """A bad setting is not a broker that does not answer: the start fails with it."""
    def call() -> None:
        raise ValueError("replication factor larger than the cluster")

    with pytest.raises(ValueError, match="replication factor"):
        until_the_broker_answers(call, threading.Event(), "ingest")


def test_a_stop_that_came_first_makes_no_call():
    stop, calls = threading.Event(), []
    stop.set()
    assert until_the_broker_answers(lambda: calls.append(1), stop, "ingest") is False
    assert calls == []

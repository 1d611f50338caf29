"""A stage started while the broker does not answer waits for it instead of exiting; one stopped
while it does not answer stops in time."""

from __future__ import annotations

import subprocess
import sys
import time
from collections import Counter
from contextlib import closing

import pytest
from conftest import read_all, small_generation, stage_env

from flywheel.contracts import EpisodeEvent, decode, encode
from flywheel.kafka.clients import make_producer

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("stage", ["ingest", pytest.param("reward", marks=pytest.mark.slow)])
def test_a_stage_started_while_the_broker_is_down_waits_for_it(broker, kafka_settings, topics, tmp_path, stage):
    """A cluster restart can bring the stages up before the broker: each used to exit with a
    traceback after its first bootstrap timed out, to be restarted in a loop by its supervisor.
    (Both start through flywheel/stream/runner.py's serve_stage: the reward run is in the slow suite.)"""
    log = tmp_path / f"{stage}.log"
    broker.pause()
    try:
        # the first attempt gives up after kafka.request_timeout_ms (30 s by default)
        env = stage_env(kafka_settings, topics, tmp_path, FLYWHEEL_KAFKA_REQUEST_TIMEOUT_MS="3000")
        with open(log, "wb") as out:
            proc = subprocess.Popen([sys.executable, "-m", f"{stage}.main"], stdout=out, stderr=subprocess.STDOUT,
                                    env={**env, "PATH": ""})
        deadline = time.monotonic() + 90
        while "the broker does not answer at start" not in log.read_text(errors="replace"):
            assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "no word of the broker in the log"
            time.sleep(0.5)
    finally:
        broker.resume()
    try:
        deadline = time.monotonic() + 90
        while not (tmp_path / stage / "state.sqlite3").exists():  # past the topics: the store opens
            assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "the stage did not go on once the broker answered"
            time.sleep(0.2)
        time.sleep(1.0)
        assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0


def _start(stage: str, env: dict[str, str], log) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", f"{stage}.main"], stdout=out, stderr=subprocess.STDOUT,
                                env={**env, "PATH": ""})


def _stop_in_a_stall(broker, proc: subprocess.Popen, after_s: float) -> tuple[int, float]:
    """Stall the broker, SIGTERM ``proc`` ``after_s`` later: its exit code and how long it took."""
    broker.pause()
    try:
        time.sleep(after_s)
        proc.terminate()
        stopped = time.monotonic()
        rc = proc.wait(timeout=60)
        return rc, time.monotonic() - stopped
    finally:
        broker.resume()


@pytest.mark.slow
def test_a_stage_stopped_during_a_broker_stall_exits_within_a_grace_period(broker, kafka_settings, topics, tmp_path):
    """SIGTERM while the broker is stalled, with windows closing into sends it does not ack: the
    stop must end before a supervisor's grace period does (Kubernetes: 30 s, then SIGKILL).
    Each step of it waited on the broker in turn (acks 30 s, then each consumer's group leave
    up to 30 s): 29-36 s. What the stop left unacked stays in the outbox and the next start sends
    it again (at least once, docs/exactly-once.md): every generation gets its episode, and one
    gets two only where its first send, unacked at the stop, landed after all."""
    env = stage_env(kafka_settings, topics, tmp_path, FLYWHEEL_INGEST_WINDOW_S="1", FLYWHEEL_INGEST_GRACE_S="0",
                    FLYWHEEL_LOG_LEVEL="INFO")
    log = tmp_path / "ingest.log"
    t, gids = time.time(), [f"g{i}" for i in range(600)]
    proc = _start("ingest", env, log)
    try:
        with closing(make_producer(kafka_settings, "test")) as producer:
            for gid in gids[:100]:
                producer.send(topics.generations, key=gid, value=encode(small_generation(gid, t)))
            producer.flush()
            assert len(read_all(kafka_settings.bootstrap, topics.episodes, expect=100, timeout_s=60)) >= 100
            for gid in gids[100:]:  # their windows close while the broker is stalled
                producer.send(topics.generations, key=gid, value=encode(small_generation(gid, t)))
            producer.flush()
        time.sleep(0.5)
        rc, took = _stop_in_a_stall(broker, proc, 1.5)
        assert rc == 0, log.read_text(errors="replace")[-3000:]
        assert took < 25, f"the stop took {took:.1f}s: {log.read_text(errors='replace')[-3000:]}"
    finally:
        if proc.poll() is None:
            proc.kill()
    proc = _start("ingest", env, log)  # the restart sends again what the stop left unacked
    try:
        deadline = time.monotonic() + 90
        while True:  # repeats count towards read_all's expect: read again until every id is there
            episodes = read_all(kafka_settings.bootstrap, topics.episodes, expect=len(gids),
                                timeout_s=max(1.0, deadline - time.monotonic()))
            got = Counter(decode(EpisodeEvent, r.value).generation_id for r in episodes)
            if set(got) >= set(gids) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        # the first run's late acks can hold every episode already: the restart is stopped only
        # once it runs (a SIGTERM while it still imports ends it by the signal's default, -15)
        while log.read_text(errors="replace").count("ingest running") < 2:
            assert proc.poll() is None and time.monotonic() < deadline + 60, log.read_text(errors="replace")[-3000:]
            time.sleep(0.2)
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0
    assert sorted(got) == sorted(gids), f"{len(set(gids) - set(got))} generations without an episode"
    # a row goes out once before the stop and at most once more after it
    assert max(got.values()) <= 2, {g: n for g, n in got.items() if n > 2}


@pytest.mark.slow
def test_a_stage_stopped_while_its_claim_waits_on_a_stalled_broker_exits_in_time(broker, kafka_settings, topics,
                                                                                 tmp_path):
    """SIGTERM while the process waits for its shard claim's verdict and the broker stalls: the
    wait (up to 30 s) used to be waited out before the stop was seen, past a supervisor's grace
    period. It now ends the wait, and the process stops having processed nothing."""
    env = stage_env(kafka_settings, topics, tmp_path, FLYWHEEL_LOG_LEVEL="INFO")
    log = tmp_path / "ingest.log"
    proc = _start("ingest", env, log)
    try:
        deadline = time.monotonic() + 90
        while "waiting for the claims group's verdict" not in log.read_text(errors="replace"):
            assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "the stage never waited for its claim"
            time.sleep(0.02)
        # the embedded broker holds a join for half a session: the verdict is not in yet
        rc, took = _stop_in_a_stall(broker, proc, 1.0)
        text = log.read_text(errors="replace")
        assert rc == 0, text[-3000:]
        assert "stopped while waiting for the claims group's verdict" in text, text[-3000:]
        assert took < 15, f"the stop took {took:.1f}s: {text[-3000:]}"
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
def test_a_stage_stopped_while_its_first_broker_call_waits_on_a_stalled_broker_exits_in_time(
        broker, kafka_settings, topics, tmp_path):
    """SIGTERM while the start's first call (creating the topics) waits on a stalled broker: the
    call would give up only at kafka.request_timeout_ms (30 s by default, kept here), past a
    supervisor's grace period. The stop now ends it, and nothing was opened."""
    env = stage_env(kafka_settings, topics, tmp_path, FLYWHEEL_LOG_LEVEL="INFO")
    env.pop("FLYWHEEL_KAFKA_REQUEST_TIMEOUT_MS", None)
    log = tmp_path / "ingest.log"
    broker.pause()
    proc = None
    try:
        proc = _start("ingest", env, log)
        deadline = time.monotonic() + 90
        while "checking the topics on the broker" not in log.read_text(errors="replace"):
            assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "the stage never reached the broker"
            time.sleep(0.02)
        time.sleep(1.0)  # inside the call, which the stalled broker does not answer
        proc.terminate()
        stopped = time.monotonic()
        rc = proc.wait(timeout=60)
        took = time.monotonic() - stopped
    finally:
        broker.resume()
        if proc is not None and proc.poll() is None:
            proc.kill()
    text = log.read_text(errors="replace")
    assert rc == 0, text[-3000:]
    assert "stopped before the broker answered" in text, text[-3000:]
    assert took < 10, f"the stop took {took:.1f}s: {text[-3000:]}"
    assert not (tmp_path / "ingest" / "state.sqlite3").exists()  # nothing was opened
